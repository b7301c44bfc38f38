// Dispatch `adaptive_cost` (routing/adaptive_cost.h): never above adaptive's modeled time, at
// most the exhaustive optimum's where that can be enumerated and the fixed part is all that
// counts, valid shares routed exactly, and the same shares from the same counts.
#include "eplb/routing/adaptive_cost.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

#include "eplb/core/error.h"
#include "eplb/routing/dispatch.h"
#include "unit/routing/random_placement.h"

namespace eplb::routing {
namespace {

// A model from its parameters (designated initializers would leave `source` out).
struct Params {
  double rank_us = 0, slot_us = 0, token_us = 1, knee_tokens = 0, token_us_above = 0;
};
placement::CostModel model(Params p) {
  placement::CostModel m;
  m.rank_us = p.rank_us;
  m.slot_us = p.slot_us;
  m.token_us = p.token_us;
  m.knee_tokens = p.knee_tokens;
  m.token_us_above = p.token_us_above;
  return m;
}

// The least largest modeled rank time over every split of `counts` into whole tokens per
// replica, by enumeration.
int64_t exhaustive(const DispatchTables& t, const std::vector<int64_t>& counts,
                   const CostTicks& m) {
  std::vector<int64_t> share(static_cast<size_t>(t.experts * t.max_replicas), 0);
  std::vector<int64_t> rank_time(static_cast<size_t>(t.ranks));
  const AdaptiveLayer view = adaptive_layer(t);
  int64_t best = std::numeric_limits<int64_t>::max();
  std::function<void(int64_t, int64_t, int64_t)> go = [&](int64_t e, int64_t i, int64_t left) {
    if (e == t.experts) {
      best = std::min(best, modeled_max_rank_ticks(view, share.data(), m, rank_time.data()));
      return;
    }
    const int64_t r = t.replica_count[e];
    if (i == r - 1) {
      share[e * t.max_replicas + i] = left;
      go(e + 1, 0, e + 1 < t.experts ? counts[e + 1] : 0);
      return;
    }
    for (int64_t x = 0; x <= left; ++x) {
      share[e * t.max_replicas + i] = x;
      go(e, i + 1, left - x);
    }
  };
  go(0, 0, counts[0]);
  return best;
}

void check_shares(const DispatchTables& t, const std::vector<int64_t>& counts,
                  const AdaptiveShares& s) {
  for (int64_t e = 0; e < t.experts; ++e) {
    int64_t sum = 0;
    for (int64_t i = 0; i < t.max_replicas; ++i) {
      const int64_t v = s.share[e * t.max_replicas + i];
      EXPECT_GE(v, 0);
      if (i >= t.replica_count[e]) {
        EXPECT_EQ(v, 0);
      }
      sum += v;
    }
    EXPECT_EQ(sum, counts[e]) << "expert " << e;
  }
}

TEST(AdaptiveCost, NeverAboveAdaptiveAndNearTheOptimumOnSmallCases) {
  const uint64_t seed = 20240611;
  std::mt19937 rng(seed);
  const CostTicks fixed_heavy = cost_ticks(model({.slot_us = 10, .token_us = 1}));
  const CostTicks roofline = cost_ticks(model({.slot_us = 10, .token_us = 0, .knee_tokens = 6,
                                         .token_us_above = 2}));
  const CostTicks tokens = cost_ticks(model({.slot_us = 0, .token_us = 1}));
  int wins = 0;
  for (int trial = 0; trial < 300; ++trial) {
    Layout layout;
    const int64_t ranks = 2 + trial % 2, per_rank = 2 + (trial / 2) % 2;
    const Placement p =
        random_placement(rng, std::min<int64_t>(3 + trial % 3, ranks * per_rank), ranks, per_rank,
                         layout);
    const DispatchTables t = build_dispatch_tables(p, 0, layout);
    std::vector<int64_t> counts(static_cast<size_t>(t.experts));
    for (int64_t& c : counts) c = static_cast<int64_t>(rng() % 6);
    for (int which = 0; which < 3; ++which) {
      const CostTicks& m = which == 0 ? fixed_heavy : which == 1 ? roofline : tokens;
      AdaptiveShares token_split, cost_split;
      adaptive_shares(t, counts, token_split);
      adaptive_cost_shares(t, counts, m, cost_split);
      check_shares(t, counts, cost_split);
      std::vector<int64_t> rank_time(static_cast<size_t>(t.ranks));
      const int64_t adaptive_time =
          modeled_max_rank_ticks(adaptive_layer(t), token_split.share.data(), m, rank_time.data());
      ASSERT_LE(cost_split.modeled_ticks, adaptive_time) << "seed " << seed << " trial " << trial;
      ASSERT_EQ(cost_split.modeled_ticks, modeled_max_rank_ticks(adaptive_layer(t),
                                                                  cost_split.share.data(), m,
                                                                  rank_time.data()));
      const int64_t optimum = exhaustive(t, counts, m);
      ASSERT_GE(cost_split.modeled_ticks, optimum);
      wins += cost_split.modeled_ticks < adaptive_time ? 1 : 0;
      // Under the token model the split is adaptive's, token for token in its largest rank.
      if (which == 2) {
        EXPECT_EQ(cost_split.modeled_ticks, adaptive_time);
      }
      // Where only the fixed part counts the fewest-slots start is exact.
      if (m.token == 0 && counts == std::vector<int64_t>(counts.size(), 1)) {
        EXPECT_EQ(cost_split.modeled_ticks, optimum);
      }
    }
  }
  EXPECT_GT(wins, 0) << "the fixed part never mattered: the test lost its point";
}

TEST(AdaptiveCost, LeavesAReplicaIdleRatherThanWakeItForAFewTokens) {
  // Expert 0 on ranks 0 and 1; expert 1 on rank 1 only. 4 tokens of expert 0, 4 of expert 1.
  const Layout layout{.experts = 2, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  Placement p(1, 2, 4);
  p.phy2log = {0, 0, 0, 1};
  p.derive_from_phy2log();
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  const std::vector<int64_t> counts{4, 4};
  AdaptiveShares token_split, cost_split;
  adaptive_shares(t, counts, token_split);
  // adaptive evens the tokens: 4 on rank 0, expert 1's 4 on rank 1 (expert 0 all on rank 0).
  EXPECT_EQ(token_split.max_rank_load, 4);
  const CostTicks m = cost_ticks(model({.slot_us = 10, .token_us = 1}));
  adaptive_cost_shares(t, counts, m, cost_split);
  // Rank 0 holds three replicas of expert 0: the cost split puts its part on one of them.
  int64_t active_on_rank0 = 0;
  for (int64_t i = 0; i < t.replica_count[0]; ++i) {
    active_on_rank0 += t.log2phy[i] / 2 == 0 && cost_split.share[i] > 0 ? 1 : 0;
  }
  EXPECT_EQ(active_on_rank0, 1);
  EXPECT_EQ(cost_split.modeled_ticks, 14 * static_cast<int64_t>(kTicksPerUs));
}

TEST(AdaptiveCost, DeterministicAndRoutedExactly) {
  std::mt19937 rng(5);
  Layout layout;
  const Placement p = random_placement(rng, 64, 8, 9, layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  std::vector<int64_t> counts(64);
  for (int64_t& c : counts) c = static_cast<int64_t>(rng() % 40);
  const CostTicks m = cost_ticks(placement::cost_model_preset("h100-v3-decode"));
  AdaptiveShares a, b;
  adaptive_cost_shares(t, counts, m, a);
  adaptive_cost_shares(t, counts, m, b);
  EXPECT_EQ(a.share, b.share);
  // Route every token of one "rank" by prefix 0: each replica receives exactly its share.
  std::vector<int32_t> experts;
  for (int32_t e = 0; e < 64; ++e) {
    for (int64_t j = 0; j < counts[e]; ++j) experts.push_back(e);
  }
  std::vector<int32_t> slots(experts.size());
  const std::vector<int64_t> prefix(64, 0);
  route_adaptive(t, a, prefix, experts, 1, slots);
  std::vector<int64_t> got(static_cast<size_t>(layout.physical), 0);
  for (const int32_t s : slots) ++got[s];
  for (int64_t e = 0; e < 64; ++e) {
    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
      EXPECT_EQ(got[t.log2phy[e * t.max_replicas + i]], a.share[e * t.max_replicas + i]);
    }
  }
}

TEST(AdaptiveCost, NamesAndErrors) {
  EXPECT_EQ(parse_dispatch_policy("adaptive_cost"), DispatchPolicy::kAdaptiveCost);
  EXPECT_EQ(dispatch_policy_name(DispatchPolicy::kAdaptiveCost), "adaptive_cost");
  EXPECT_TRUE(routes_by_shares(DispatchPolicy::kAdaptiveCost));
  const Layout layout{.experts = 2, .physical = 2, .ranks = 1, .nodes = 1, .groups = 1};
  const Placement p = trivial_placement(1, 2, 2);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  const std::vector<int32_t> experts{0, 1};
  std::vector<int32_t> slots(2);
  uint64_t state = 1;
  try {
    route(t, DispatchPolicy::kAdaptiveCost, experts, 1, slots, 0, 0, state);
    FAIL() << "route took adaptive_cost";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("adaptive_cost_shares"));
  }
  AdaptiveShares s;
  const std::vector<int64_t> bad{1, -1};
  EXPECT_THROW(adaptive_cost_shares(t, bad, cost_ticks(model({.token_us = 1})), s), InvalidArgument);
  EXPECT_THROW(cost_ticks(model({.slot_us = -1})), InvalidArgument);
}

}  // namespace
}  // namespace eplb::routing
