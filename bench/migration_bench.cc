// Planning and scheduling every layer of a rebalance, DeepSeek-V3 shape: 58 MoE layers,
// 256 experts in 288 slots on 32 ranks of 4 nodes. The target is <= 2 ms for all layers.
// Counters: rounds against their lower bound, and bytes moved against the naive baseline of
// reading every changed slot from a peer (what an engine without a planner does).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "eplb/migration/migration.h"

namespace eplb::migration {
namespace {

constexpr int64_t kLayers = 58, kExperts = 256, kPhysical = 288, kRanks = 32, kNodes = 4;
constexpr int64_t kExpertBytes = 44 << 20;  // 3 x 7168 x 2048 bf16

Placement random_placement(std::mt19937& rng) {
  Placement p(kLayers, kExperts, kPhysical);
  std::uniform_int_distribution<int32_t> pick(0, kExperts - 1);
  for (int64_t l = 0; l < kLayers; ++l) {
    auto row = p.layer_phy2log(l);
    std::iota(row.begin(), row.begin() + kExperts, 0);
    for (int64_t s = kExperts; s < kPhysical; ++s) row[s] = pick(rng);
    std::shuffle(row.begin(), row.end(), rng);
  }
  p.derive_from_phy2log();
  return p;
}

// `from` with about a quarter of the slots of every layer swapped (a sticky rebalance).
Placement perturbed(const Placement& from, std::mt19937& rng) {
  Placement p = from;
  std::uniform_int_distribution<int64_t> slot(0, kPhysical - 1);
  for (int64_t l = 0; l < kLayers; ++l) {
    auto row = p.layer_phy2log(l);
    for (int64_t i = 0; i < kPhysical / 8; ++i) std::swap(row[slot(rng)], row[slot(rng)]);
  }
  p.derive_from_phy2log();
  return p;
}

void run(benchmark::State& state, const Placement& from, const Placement& to) {
  const Layout layout{
      .experts = kExperts, .physical = kPhysical, .ranks = kRanks, .nodes = kNodes, .groups = 8};
  const MigrationOptions options{
      .expert_bytes = kExpertBytes,
      .schedule = {.peers_per_round = state.range(0), .half_duplex = state.range(1) != 0}};
  MigrationPlan plan;
  for (auto _ : state) {
    plan = plan_migration(from, to, layout, options);
    benchmark::DoNotOptimize(plan);
  }
  int64_t changed = 0;
  for (size_t i = 0; i < from.phy2log.size(); ++i) changed += from.phy2log[i] != to.phy2log[i];
  state.counters["rounds"] = static_cast<double>(plan.totals.rounds);
  state.counters["rounds_bound"] = static_cast<double>(plan.totals.rounds_lower_bound);
  state.counters["GiB_moved"] = static_cast<double>(plan.totals.bytes_total) / (1 << 30);
  state.counters["bytes_vs_naive"] =
      changed ? static_cast<double>(plan.totals.bytes_total) / (changed * kExpertBytes) : 0.0;
}

void BM_RandomRebalance(benchmark::State& state) {
  std::mt19937 rng(1);
  const Placement from = random_placement(rng);
  const Placement to = random_placement(rng);
  run(state, from, to);
}

void BM_StickyRebalance(benchmark::State& state) {
  std::mt19937 rng(2);
  const Placement from = random_placement(rng);
  const Placement to = perturbed(from, rng);
  run(state, from, to);
}

// Args: {peers per round, half duplex}.
BENCHMARK(BM_RandomRebalance)
    ->Args({1, 0})
    ->Args({2, 0})
    ->Args({1, 1})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StickyRebalance)->Args({1, 0})->Args({1, 1})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace eplb::migration
