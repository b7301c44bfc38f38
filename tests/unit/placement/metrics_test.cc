// Tests of the placement metrics, on cases worked out by hand, and the lower bound against a
// plain greedy on random layers.

#include "eplb/placement/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::placement {
namespace {

Layout make_layout(int64_t experts, int64_t physical, int64_t ranks, int64_t nodes = 1) {
  Layout layout;
  layout.experts = experts;
  layout.physical = physical;
  layout.ranks = ranks;
  layout.nodes = nodes;
  return layout;
}

// 4 experts, 6 slots, 3 ranks of 2 slots. Experts 0 and 1 have two replicas each.
//   slots:  [0 0 | 1 2 | 3 1]   loads w = [6 3 2 1], per replica [3 1.5 2 1]
//   ranks:  3+3 = 6, 1.5+2 = 3.5, 1+1.5 = 2.5; mean 4, max 6
const std::vector<double> kLoad = {6, 3, 2, 1};
const std::vector<int32_t> kPhy2log = {0, 0, 1, 2, 3, 1};

TEST(MetricsTest, RankLoadsShareLoadEquallyAmongReplicas) {
  const std::vector<double> ranks = rank_loads(kLoad, kPhy2log, make_layout(4, 6, 3));
  EXPECT_EQ(ranks, (std::vector<double>{6, 3.5, 2.5}));
}

TEST(MetricsTest, LayerBalancedness) {
  EXPECT_DOUBLE_EQ(layer_balancedness(kLoad, kPhy2log, make_layout(4, 6, 3)), 4.0 / 6.0);
  // Perfect: [0 3 | 1 2] with w = [5 5 5 5] on 2 ranks.
  EXPECT_DOUBLE_EQ(layer_balancedness(std::vector<double>{5, 5, 5, 5},
                                      std::vector<int32_t>{0, 3, 1, 2}, make_layout(4, 4, 2)),
                   1.0);
  // All-zero layer: 1 by definition.
  EXPECT_DOUBLE_EQ(layer_balancedness(std::vector<double>{0, 0, 0, 0}, kPhy2log,
                                      make_layout(4, 6, 3)),
                   1.0);
}

TEST(MetricsTest, LowerBoundIsTheMeanWhenReplicasAreSmall) {
  // Greedy replicas of w = [6 3 2 1] into 6 slots: [6 3 2 1] -> e0: [3 3 2 1] -> tie, lowest
  // e0: [2 3 2 1]; per-replica bound 3 < mean 12 / 3 = 4.
  EXPECT_DOUBLE_EQ(layer_lower_bound(kLoad, make_layout(4, 6, 3)), 4.0);
}

TEST(MetricsTest, LowerBoundIsTheLargestReplicaWhenItDominates) {
  // No redundant slot: w = [9 1] on 2 ranks, bound max(5, 9) = 9.
  EXPECT_DOUBLE_EQ(layer_lower_bound(std::vector<double>{9, 1}, make_layout(2, 2, 2)), 9.0);
  // w = [8 4], 5 slots on 5 ranks: counts (3, 2) give max(8/3, 2); (4, 1) give 4. Mean 2.4.
  EXPECT_DOUBLE_EQ(layer_lower_bound(std::vector<double>{8, 4}, make_layout(2, 5, 5)), 8.0 / 3.0);
  // w = [100 1 1 1], 8 slots on 2 ranks: expert 0 gets 5 replicas (20 each); mean 51.5.
  EXPECT_DOUBLE_EQ(layer_lower_bound(std::vector<double>{100, 1, 1, 1}, make_layout(4, 8, 2)),
                   51.5);
  // Same on 8 ranks: mean 12.875 < 20.
  EXPECT_DOUBLE_EQ(layer_lower_bound(std::vector<double>{100, 1, 1, 1}, make_layout(4, 8, 8)),
                   20.0);
}

TEST(MetricsTest, LowerBoundMatchesTheGreedyCountsOnRandomLayers) {
  // The per-replica term against a plain greedy over every expert (each extra replica to the
  // largest w / r, lowest expert on a tie), on lognormal, tied and zero loads.
  // Both sides of the bound are reached: the mean (where it is found without the greedy) and
  // the per-replica term.
  std::mt19937_64 rng(31);
  std::lognormal_distribution<double> dist(0.0, 1.5);
  int mean_wins = 0, replica_wins = 0;
  for (int trial = 0; trial < 200; ++trial) {
    // From a few extra replicas to two and a half times as many slots as experts.
    const int64_t experts = 4 + trial % 29, ranks = 1 + trial % 7;
    const int64_t wanted = experts + experts * (trial % 7) / 4 + trial % 3;
    const int64_t physical = ranks * ((wanted + ranks - 1) / ranks);
    // With one slot per rank the mean rank load does not hide the per-replica term.
    const Layout layout = make_layout(experts, physical, trial % 2 == 0 ? physical : ranks);
    std::vector<double> w(static_cast<size_t>(experts));
    for (double& v : w) v = trial % 4 == 0 ? std::round(dist(rng)) : dist(rng) * 100;
    std::vector<int64_t> count(w.size(), 1);
    for (int64_t extra = physical - experts; extra > 0; --extra) {
      size_t best = 0;
      for (size_t e = 1; e < w.size(); ++e) {
        if (w[e] / static_cast<double>(count[e]) > w[best] / static_cast<double>(count[best])) {
          best = e;
        }
      }
      ++count[best];
    }
    double total = 0, per_replica = 0;
    for (size_t e = 0; e < w.size(); ++e) {
      total += w[e];
      per_replica = std::max(per_replica, w[e] / static_cast<double>(count[e]));
    }
    if (layout.slots_per_rank() == 2) continue;  // the pairing bound also applies there
    const double mean = total / static_cast<double>(layout.ranks);
    EXPECT_EQ(layer_lower_bound(w, layout), std::max(mean, per_replica))
        << "trial " << trial << ": " << experts << " experts, " << physical << " slots";
    ++(per_replica <= mean ? mean_wins : replica_wins);
  }
  EXPECT_GT(mean_wins, 20);
  EXPECT_GT(replica_wins, 20);
}

TEST(MetricsTest, MovedSlots) {
  Placement a(2, 3, 4);
  a.phy2log = {0, 1, 2, 0, 2, 1, 0, 0};
  a.derive_from_phy2log();
  Placement b = a;
  EXPECT_EQ(moved_slots(a, b), 0);
  b.phy2log = {0, 1, 2, 1, 1, 2, 0, 0};
  b.derive_from_phy2log();
  EXPECT_EQ(moved_slots(a, b), 3);

  const Placement other_shape(2, 3, 6);
  EXPECT_THROW(moved_slots(a, other_shape), InvalidArgument);
}

TEST(MetricsTest, EvaluateTwoLayers) {
  // Layer 0: the worked case above. Layer 1: all zero, a dense layer: out of the means.
  const Layout layout = make_layout(4, 6, 3);
  LoadMatrix load(2, 4);
  load.values = {6, 3, 2, 1, 0, 0, 0, 0};
  Placement placement(2, 4, 6);
  placement.phy2log = {0, 0, 1, 2, 3, 1, 0, 1, 2, 3, 0, 1};
  placement.derive_from_phy2log();

  const PlacementMetrics m = evaluate(load, placement, layout);
  ASSERT_EQ(m.balancedness.size(), 2u);
  EXPECT_DOUBLE_EQ(m.balancedness[0], 4.0 / 6.0);
  EXPECT_DOUBLE_EQ(m.balancedness[1], 1.0);
  EXPECT_DOUBLE_EQ(m.mean_rank_load[0], 4.0);
  EXPECT_DOUBLE_EQ(m.max_rank_load[0], 6.0);
  EXPECT_DOUBLE_EQ(m.mean_rank_load[1], 0.0);
  EXPECT_DOUBLE_EQ(m.max_rank_load[1], 0.0);
  EXPECT_DOUBLE_EQ(m.lower_bound_balancedness[0], 1.0);  // mean 4 / bound 4
  EXPECT_DOUBLE_EQ(m.lower_bound_balancedness[1], 1.0);
  EXPECT_EQ(m.dense, (std::vector<char>{0, 1}));
  EXPECT_EQ(m.moe_layers, 1);
  EXPECT_DOUBLE_EQ(m.balancedness_mean, 4.0 / 6.0);
  EXPECT_DOUBLE_EQ(m.balancedness_step, (4.0 + 0.0) / (6.0 + 0.0));
  EXPECT_DOUBLE_EQ(m.lower_bound_mean, 1.0);
  EXPECT_EQ(m.moved, -1);
  EXPECT_TRUE(m.moved_per_layer.empty());

  // Against the trivial placement (slot p holds p mod 4, [0 1 2 3 0 1]): layer 0 differs in
  // slots 1, 2, 3, 4; layer 1 is the trivial placement.
  const Placement trivial = trivial_placement(2, 4, 6);
  const PlacementMetrics moved = evaluate(load, placement, layout, &trivial);
  EXPECT_EQ(moved.moved, 4);
  EXPECT_EQ(moved.moved_per_layer, (std::vector<int64_t>{4, 0}));
}

TEST(MetricsTest, StepWeightedFavoursHeavyLayers) {
  // Layer 0 (light) is unbalanced, layer 1 (heavy) is balanced: the step-weighted figure is
  // near 1, the plain mean is not.
  const Layout layout = make_layout(2, 2, 2);
  LoadMatrix load(2, 2);
  load.values = {1, 0, 100, 100};
  Placement placement(2, 2, 2);
  placement.phy2log = {0, 1, 0, 1};
  placement.derive_from_phy2log();
  const PlacementMetrics m = evaluate(load, placement, layout);
  EXPECT_DOUBLE_EQ(m.balancedness[0], 0.5);
  EXPECT_DOUBLE_EQ(m.balancedness[1], 1.0);
  EXPECT_DOUBLE_EQ(m.balancedness_mean, 0.75);
  EXPECT_DOUBLE_EQ(m.balancedness_step, (0.5 + 100.0) / (1.0 + 100.0));
}

TEST(MetricsTest, RejectsBadInput) {
  const Layout layout = make_layout(4, 6, 3);
  // Wrong sizes.
  EXPECT_THROW(rank_loads(std::vector<double>{1, 2, 3}, kPhy2log, layout), InvalidArgument);
  EXPECT_THROW(rank_loads(kLoad, std::vector<int32_t>{0, 1, 2, 3}, layout), InvalidArgument);
  // Expert out of range, expert without a slot.
  EXPECT_THROW(rank_loads(kLoad, std::vector<int32_t>{0, 1, 2, 3, 4, 0}, layout),
               InvalidArgument);
  EXPECT_THROW(rank_loads(kLoad, std::vector<int32_t>{0, 1, 2, 0, 1, 2}, layout),
               InvalidArgument);
  // Negative, NaN, infinite loads.
  EXPECT_THROW(layer_lower_bound(std::vector<double>{1, -1, 0, 0}, layout), InvalidArgument);
  EXPECT_THROW(layer_lower_bound(std::vector<double>{1, std::numeric_limits<double>::quiet_NaN(),
                                                     0, 0},
                                 layout),
               InvalidArgument);
  EXPECT_THROW(layer_balancedness(std::vector<double>{1, std::numeric_limits<double>::infinity(),
                                                      0, 0},
                                  kPhy2log, layout),
               InvalidArgument);
  // Bad layout.
  EXPECT_THROW(layer_lower_bound(kLoad, make_layout(4, 7, 3)), InvalidArgument);
  // Placement of another shape.
  LoadMatrix load(1, 4);
  load.values = kLoad;
  const Placement wrong = trivial_placement(1, 4, 9);
  EXPECT_THROW(evaluate(load, wrong, layout), InvalidArgument);
  const Placement right = trivial_placement(1, 4, 6);
  const Placement two_layers = trivial_placement(2, 4, 6);
  EXPECT_THROW(evaluate(load, right, layout, &two_layers), InvalidArgument);
  try {
    rank_loads(kLoad, std::vector<int32_t>{0, 1, 2, 0, 1, 2}, layout);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert 3 has no slot"), std::string::npos) << e.what();
  }
}

// The recorded window's balancedness and the plans' predictions count the slots that serve:
// a lost seat's slots take no token, so its replicas share nothing; an expert left without a
// usable slot on the members reads 0 (its tokens had nowhere to go).
TEST(ServedMetrics, CountOnlyTheSlotsThatServe) {
  Layout layout;
  layout.experts = 4;
  layout.physical = 8;
  layout.ranks = 4;
  Placement p(1, 4, 8);
  p.phy2log = {0, 1, 2, 3, 0, 2, 1, 3};  // seats {0,1} {2,3} {0,2} {1,3}
  p.derive_from_phy2log();
  LoadMatrix load(1, 4);
  load.values = {4, 4, 4, 4};
  const auto all = served_metrics(load, p, layout, {}, {});
  ASSERT_TRUE(all.has_value());
  EXPECT_DOUBLE_EQ(all->balancedness_mean, 1.0);
  // Seat 3 lost: experts 1 and 3 keep one replica each, 4 per slot; seats 0-2 carry 6, 6, 4.
  const std::vector<int32_t> members = {0, 1, 2};
  const auto three = served_metrics(load, p, layout, members, {});
  ASSERT_TRUE(three.has_value());
  EXPECT_DOUBLE_EQ(three->balancedness_mean, (16.0 / 3.0) / 6.0);
  EXPECT_EQ(three->moe_layers, 1);
  // And expert 3's last replica (seat 1, slot 3) without valid weights: nothing serves it.
  std::vector<uint8_t> usable(8, 1);
  usable[3] = 0;
  EXPECT_FALSE(served_metrics(load, p, layout, members, usable).has_value());
  // Every seat a member but slot 3 unusable: expert 3 is still served on seat 3.
  EXPECT_TRUE(served_metrics(load, p, layout, {}, usable).has_value());
}

}  // namespace
}  // namespace eplb::placement
