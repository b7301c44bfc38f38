// Routing at DeepSeek-V3's prefill shape (256 experts in 288 slots on 32 ranks, top-8), per
// layer and step, on one thread: the adaptive split of a step's counts (routing::adaptive_shares)
// at decode and prefill sizes, and one rank's batch routed by hash, split and adaptive. The
// placement is `balanced` on lognormal(0, 1) loads; the step's tokens are drawn from those loads.
// The per-layer cost of adaptive dispatch an engine pays is adaptive_shares + route_adaptive.

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"

namespace {

using eplb::Layout;
using eplb::LoadMatrix;
namespace routing = eplb::routing;

constexpr int64_t kExperts = 256, kRanks = 32, kTopK = 8;

struct Fixture {
  Layout layout{.experts = kExperts, .physical = 288, .ranks = kRanks, .nodes = 4, .groups = 8};
  std::vector<double> weight;
  routing::DispatchTables tables;

  Fixture() {
    std::mt19937_64 rng(7);
    std::lognormal_distribution<double> skew(0, 1);
    LoadMatrix load(1, kExperts);
    for (double& v : load.values) v = std::round(skew(rng) * 1000);
    weight = load.values;
    eplb::placement::PolicyOptions options;
    options.policy = eplb::placement::Policy::kBalanced;
    tables =
        routing::build_dispatch_tables(eplb::placement::place(load, layout, options), 0, layout);
  }

  // `tokens` tokens per rank, top-8 each, every rank's ids [ranks][tokens * top_k].
  std::vector<std::vector<int32_t>> step(int64_t tokens, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::discrete_distribution<int32_t> pick(weight.begin(), weight.end());
    std::vector<std::vector<int32_t>> ids(kRanks);
    for (auto& rank : ids) {
      for (int64_t i = 0; i < tokens * kTopK; ++i) rank.push_back(pick(rng));
    }
    return ids;
  }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

void BM_AdaptiveShares(benchmark::State& state) {
  const Fixture& f = fixture();
  const auto ids = f.step(state.range(0), 1);
  std::vector<int64_t> counts(kExperts, 0);
  for (const auto& rank : ids) routing::count_experts(rank, kExperts, counts);
  routing::AdaptiveShares shares;
  for (auto _ : state) {
    routing::adaptive_shares(f.tables, counts, shares);
    benchmark::DoNotOptimize(shares.max_rank_load);
  }
  state.SetLabel("tokens per rank " + std::to_string(state.range(0)));
}
BENCHMARK(BM_AdaptiveShares)->Arg(16)->Arg(128)->Arg(1024)->Unit(benchmark::kMicrosecond);

void BM_Route(benchmark::State& state) {
  const Fixture& f = fixture();
  const auto ids = f.step(state.range(1), 2);
  const auto policy = static_cast<routing::DispatchPolicy>(state.range(0));
  std::vector<int64_t> counts(kExperts, 0), prefix(kExperts, 0);
  for (const auto& rank : ids) routing::count_experts(rank, kExperts, counts);
  for (int64_t g = 0; g < 5; ++g) routing::count_experts(ids[g], kExperts, prefix);
  routing::AdaptiveShares shares;
  routing::adaptive_shares(f.tables, counts, shares);
  std::vector<int32_t> slots(ids[5].size());
  uint64_t random_state = 1;
  for (auto _ : state) {
    if (policy == routing::DispatchPolicy::kAdaptive) {
      routing::route_adaptive(f.tables, shares, prefix, ids[5], kTopK, slots);
    } else {
      routing::route(f.tables, policy, ids[5], kTopK, slots, 0, 5, random_state);
    }
    benchmark::DoNotOptimize(slots.data());
  }
  state.SetLabel(std::string(routing::dispatch_policy_name(policy)) + ", tokens per rank " +
                 std::to_string(state.range(1)));
}
BENCHMARK(BM_Route)
    ->ArgsProduct({{static_cast<int64_t>(routing::DispatchPolicy::kHash),
                    static_cast<int64_t>(routing::DispatchPolicy::kSplit),
                    static_cast<int64_t>(routing::DispatchPolicy::kAdaptive)},
                   {16, 1024}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
