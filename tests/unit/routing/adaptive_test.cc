// Dispatches `split` and `adaptive`: the solver's optimum against exhaustive search on small
// cases, the shares' invariants, and the realized loads of routing by prefix.
#include "eplb/routing/adaptive.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include "eplb/core/error.h"
#include "eplb/routing/dispatch.h"
#include "unit/routing/random_placement.h"

namespace eplb::routing {
namespace {

// The least largest rank load over every integer split of `counts`, by enumeration.
int64_t exhaustive_optimum(const DispatchTables& t, const std::vector<int64_t>& counts) {
  std::vector<int64_t> load(static_cast<size_t>(t.ranks), 0);
  int64_t best = std::numeric_limits<int64_t>::max();
  std::function<void(int64_t)> expert = [&](int64_t e) {
    if (e == t.experts) {
      best = std::min(best, *std::max_element(load.begin(), load.end()));
      return;
    }
    const auto reps = t.replicas(e);
    std::function<void(size_t, int64_t)> give = [&](size_t i, int64_t left) {
      const int64_t g = reps[i] / t.slots_per_rank;
      if (i + 1 == reps.size()) {
        load[g] += left;
        expert(e + 1);
        load[g] -= left;
        return;
      }
      for (int64_t x = 0; x <= left; ++x) {
        load[g] += x;
        give(i + 1, left - x);
        load[g] -= x;
      }
    };
    give(0, counts[e]);
  };
  expert(0);
  return best;
}

// Loads of the ranks under `shares`.
std::vector<int64_t> rank_loads(const DispatchTables& t, const AdaptiveShares& s) {
  std::vector<int64_t> load(static_cast<size_t>(t.ranks), 0);
  for (int64_t e = 0; e < t.experts; ++e) {
    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
      load[t.log2phy[e * t.max_replicas + i] / t.slots_per_rank] += s.share[e * t.max_replicas + i];
    }
  }
  return load;
}

TEST(Adaptive, MatchesExhaustiveSearchOnSmallCases) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    Layout layout;
    const int64_t experts = 3 + static_cast<int64_t>(rng() % 3);
    const int64_t ranks = 2 + static_cast<int64_t>(rng() % 3);
    const int64_t per_rank = (experts + ranks) / ranks + static_cast<int64_t>(rng() % 2);
    const Placement p = random_placement(rng, experts, ranks, per_rank, layout);
    const DispatchTables t = build_dispatch_tables(p, 0, layout);
    std::vector<int64_t> counts(static_cast<size_t>(experts));
    for (auto& c : counts) c = static_cast<int64_t>(rng() % 7);
    AdaptiveShares s;
    adaptive_shares(t, counts, s);
    ASSERT_EQ(s.max_rank_load, exhaustive_optimum(t, counts)) << "trial " << trial;
    const auto load = rank_loads(t, s);
    EXPECT_EQ(*std::max_element(load.begin(), load.end()), s.max_rank_load);
    for (int64_t e = 0; e < experts; ++e) {
      int64_t sum = 0;
      for (int64_t i = 0; i < t.max_replicas; ++i) {
        const int64_t x = s.share[e * t.max_replicas + i];
        EXPECT_GE(x, 0);
        if (i >= t.replica_count[e]) {
          EXPECT_EQ(x, 0);
        }
        sum += x;
      }
      EXPECT_EQ(sum, counts[e]);
    }
  }
}

TEST(Adaptive, OptimalAtDeepSeekScaleAgainstTheCutBound) {
  // 256 experts on 288 slots, 32 ranks; skewed counts. The optimum is at least the mean and at
  // least every rank's unavoidable load; with the replicas spread, it reaches the mean's ceiling
  // or a fixed rank's load.
  std::mt19937 rng(5);
  Layout layout;
  const Placement p = random_placement(rng, 256, 32, 9, layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  std::lognormal_distribution<double> skew(0, 1);
  std::vector<int64_t> counts(256);
  for (auto& c : counts) c = static_cast<int64_t>(skew(rng) * 30);
  AdaptiveShares s;
  adaptive_shares(t, counts, s);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  EXPECT_GE(s.max_rank_load, (total + 31) / 32);
  // No single-rank move improves it: every rank at the maximum has no flexible token that
  // could go to a rank below the maximum minus one (the optimality certificate of the flow).
  const auto load = rank_loads(t, s);
  for (int64_t e = 0; e < 256; ++e) {
    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
      if (s.share[e * t.max_replicas + i] == 0) continue;
      const int64_t from = t.log2phy[e * t.max_replicas + i] / 9;
      if (load[from] < s.max_rank_load) continue;
      for (int64_t j = 0; j < t.replica_count[e]; ++j) {
        const int64_t to = t.log2phy[e * t.max_replicas + j] / 9;
        EXPECT_GE(load[to], s.max_rank_load - 1) << "expert " << e << " could move";
      }
    }
  }
  // Deterministic: the same counts give the same shares.
  AdaptiveShares again;
  adaptive_shares(t, counts, again);
  EXPECT_EQ(again.share, s.share);
}

TEST(Adaptive, RoutingByPrefixRealizesTheShares) {
  std::mt19937 rng(3);
  Layout layout;
  const Placement p = random_placement(rng, 16, 4, 6, layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  const int64_t ranks = 4, tokens = 12, top_k = 2;
  std::vector<std::vector<int32_t>> batch(ranks);
  std::vector<int64_t> rank_counts(static_cast<size_t>(ranks * 16), 0), global(16, 0);
  for (int64_t g = 0; g < ranks; ++g) {
    for (int64_t i = 0; i < tokens * top_k; ++i)
      batch[g].push_back(static_cast<int32_t>(rng() % 5));
    count_experts(batch[g], 16, {rank_counts.data() + g * 16, 16});
    count_experts(batch[g], 16, global);
  }
  AdaptiveShares s;
  adaptive_shares(t, global, s);
  std::vector<int64_t> per_slot(static_cast<size_t>(layout.physical), 0);
  std::vector<int64_t> prefix(16);
  for (int64_t g = 0; g < ranks; ++g) {
    exclusive_prefix(rank_counts, 16, g, prefix);
    std::vector<int32_t> slots(batch[g].size());
    route_adaptive(t, s, prefix, batch[g], top_k, slots);
    for (size_t i = 0; i < slots.size(); ++i) {
      ASSERT_EQ(p.phy2log[slots[i]], batch[g][i]);
      ++per_slot[slots[i]];
    }
  }
  for (int64_t e = 0; e < 16; ++e) {
    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
      EXPECT_EQ(per_slot[t.log2phy[e * t.max_replicas + i]], s.share[e * t.max_replicas + i]);
    }
  }
}

TEST(Adaptive, RejectsBadInput) {
  std::mt19937 rng(1);
  Layout layout;
  const Placement p = random_placement(rng, 4, 2, 3, layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  AdaptiveShares s;
  EXPECT_THROW(adaptive_shares(t, std::vector<int64_t>(3, 1), s), InvalidArgument);
  EXPECT_THROW(adaptive_shares(t, std::vector<int64_t>{1, -1, 0, 0}, s), InvalidArgument);
  std::vector<int32_t> ids{0, 1}, slots(2);
  std::vector<int64_t> prefix(4, 0);
  EXPECT_THROW(route_adaptive(t, s, prefix, ids, 1, slots), InvalidArgument);  // no shares yet
  adaptive_shares(t, std::vector<int64_t>{1, 1, 0, 0}, s);
  route_adaptive(t, s, prefix, ids, 1, slots);
  ids[1] = 4;
  EXPECT_THROW(route_adaptive(t, s, prefix, ids, 1, slots), InvalidArgument);
  uint64_t state = 1;
  EXPECT_THROW(route(t, DispatchPolicy::kAdaptive, ids, 1, slots, 0, 0, state), InvalidArgument);
  EXPECT_EQ(parse_dispatch_policy("adaptive"), DispatchPolicy::kAdaptive);
  EXPECT_EQ(dispatch_policy_name(DispatchPolicy::kSplit), "split");
}

TEST(Split, EachRanksTokensSplitEvenlyAndRanksSpreadTheirRemainders) {
  std::mt19937 rng(9);
  Layout layout;
  const Placement p = random_placement(rng, 8, 8, 2, layout);  // 8 redundant slots
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  std::vector<int64_t> per_slot(16, 0);
  for (int64_t g = 0; g < 8; ++g) {
    // Every rank sends 5 tokens of every expert.
    std::vector<int32_t> ids;
    for (int32_t e = 0; e < 8; ++e) {
      for (int j = 0; j < 5; ++j) ids.push_back(e);
    }
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> slots(ids.size());
    uint64_t state = 1;
    route(t, DispatchPolicy::kSplit, ids, 1, slots, 0, g, state);
    std::vector<int64_t> mine(16, 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_EQ(p.phy2log[slots[i]], ids[i]);
      ++mine[slots[i]];
      ++per_slot[slots[i]];
    }
    for (int32_t e = 0; e < 8; ++e) {  // this rank's 5 tokens of e: within one of each other
      const auto reps = t.replicas(e);
      int64_t lo = 5, hi = 0;
      for (int32_t slot : reps) lo = std::min(lo, mine[slot]), hi = std::max(hi, mine[slot]);
      EXPECT_LE(hi - lo, 1);
    }
  }
  // Over all ranks (40 tokens of each expert), the remainders spread: within one too.
  for (int32_t e = 0; e < 8; ++e) {
    const auto reps = t.replicas(e);
    int64_t lo = 40, hi = 0;
    for (int32_t slot : reps) lo = std::min(lo, per_slot[slot]), hi = std::max(hi, per_slot[slot]);
    EXPECT_LE(hi - lo, 1) << "expert " << e;
  }
}

}  // namespace
}  // namespace eplb::routing
