// The policies' internal steps that the public API reaches only partly, tested directly:
// greedy_replica_counts with a cap that binds (balanced's counts at two or more slots per rank,
// where no placement shows them), and sticky's two-slot repair (two_slots::repair), which runs
// only where the incremental search fails.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "placement/replicas.h"
#include "placement/two_slots.h"
#include "unit/placement/greedy_reference.h"

namespace eplb::placement {
namespace {

// A layer of `n` experts, every load of kind `kind` (greedy_reference.h).
std::vector<double> layer_of_kind(int kind, int64_t n, std::mt19937_64& rng) {
  std::lognormal_distribution<double> lognormal(0.0, 1.0);
  std::vector<double> w(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) w[e] = testing::load_of_kind(kind, lognormal, rng, e, n);
  return w;
}

TEST(ReplicaCounts, GreedyWithABindingCapIsTheOneAtATimeGreedy) {
  std::mt19937_64 rng(17);
  int64_t capped = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const int kind = trial % 7;
    const int64_t n = 1 + static_cast<int64_t>(rng() % 40);
    const int64_t cap = 1 + static_cast<int64_t>(rng() % 8);
    const int64_t slots =
        n + static_cast<int64_t>(rng() % static_cast<uint64_t>(n * (cap - 1) + 1));
    const std::vector<double> w = layer_of_kind(kind, n, rng);
    const std::vector<int32_t> want = testing::greedy_one_at_a_time(w, slots, cap);
    capped += std::count(want.begin(), want.end(), static_cast<int32_t>(cap)) > 0 && cap > 1;
    ASSERT_EQ(greedy_replica_counts(w, slots, cap), want)
        << "kind " << kind << ", " << n << " experts, " << slots << " slots, cap " << cap;
  }
  // The cap bound on many of them (else the heap's restart would go untested).
  EXPECT_GT(capped, 1000);
}

// Two slots per rank: the loads per replica under `counts`, and each rank's load.
struct TwoSlotLayer {
  std::vector<double> share;  // [experts]
  double rank_load(std::span<const int32_t> slots, int64_t g) const {
    return share[slots[2 * g]] + share[slots[2 * g + 1]];
  }
};

TEST(TwoSlotsRepair, KeepsTheCountsTheRulesAndTheCap) {
  std::mt19937_64 rng(5);
  int64_t repaired = 0, kept_checked = 0, exact = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t ranks = 2 + static_cast<int64_t>(rng() % 11);
    const int64_t experts = ranks + static_cast<int64_t>(rng() % static_cast<uint64_t>(ranks + 1));
    const int kind = trial % 7;
    const std::vector<double> w = layer_of_kind(kind, experts, rng);
    // balanced's counts where it can place the layer (as sticky passes them), else the greedy.
    std::vector<int32_t> counts;
    if (trial % 2 == 0) {
      std::vector<int32_t> phy2log(static_cast<size_t>(2 * ranks)), greedy;
      bool traded = false;
      double greedy_top = 0;
      two_slots::place(w, ranks, phy2log, traded, greedy, greedy_top);
      ASSERT_EQ(greedy_top, two_slots::pairing_top(w, greedy, ranks)) << "trial " << trial;
      counts.assign(static_cast<size_t>(experts), 0);
      for (const int32_t e : phy2log) ++counts[e];
    } else {
      counts = greedy_replica_counts(w, 2 * ranks, ranks);
    }
    // A previous layer: any expert in any slot, one expert twice on a rank allowed.
    std::vector<int32_t> prev(static_cast<size_t>(2 * ranks));
    for (int32_t& e : prev) e = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
    TwoSlotLayer layer;
    for (int64_t e = 0; e < experts; ++e) layer.share.push_back(w[e] / counts[e]);
    const double best = two_slots::pairing_top(w, counts, ranks);
    const double slack[] = {0.0, 0.02, 0.2};
    const double cap =
        trial % 4 == 3 ? std::numeric_limits<double>::infinity() : best * (1 + slack[trial % 4]);
    std::vector<int32_t> out(prev.size(), -1);
    const std::string where = "trial " + std::to_string(trial) + ", " + std::to_string(ranks) +
                              " ranks, " + std::to_string(experts) + " experts";
    if (!two_slots::repair(w, prev, counts, ranks, cap, out)) {
      // Without a cap every count vector can be placed (at most one replica per rank).
      ASSERT_LT(cap, std::numeric_limits<double>::infinity()) << where;
      continue;
    }
    ++repaired;
    std::vector<int32_t> got(static_cast<size_t>(experts), 0);
    for (int64_t g = 0; g < ranks; ++g) {
      ASSERT_GE(out[2 * g], 0) << where;
      ASSERT_LT(out[2 * g], experts) << where;
      ASSERT_GE(out[2 * g + 1], 0) << where;
      ASSERT_LT(out[2 * g + 1], experts) << where;
      ASSERT_NE(out[2 * g], out[2 * g + 1]) << where << ": rank " << g << " holds one expert twice";
      ASSERT_LE(layer.rank_load(out, g), cap) << where << ": rank " << g;
      ++got[out[2 * g]];
      ++got[out[2 * g + 1]];
    }
    ASSERT_EQ(got, counts) << where;
    if (cap == std::numeric_limits<double>::infinity()) {
      // No trade runs: each expert keeps as many of its previous slots as it has replicas (a
      // rank's second copy of one expert excluded), the fewest moves these counts allow, but
      // where a new replica finds free slots only beside its own expert (one slot more each
      // time; with an expert on more than half the ranks that happens often).
      std::vector<int32_t> held(static_cast<size_t>(experts), 0);
      int64_t can_keep = 0, kept = 0;
      for (int64_t g = 0; g < ranks; ++g) {
        ++held[prev[2 * g]];
        if (prev[2 * g + 1] != prev[2 * g]) ++held[prev[2 * g + 1]];
      }
      for (int64_t e = 0; e < experts; ++e) can_keep += std::min(held[e], counts[e]);
      for (size_t p = 0; p < prev.size(); ++p) kept += out[p] == prev[p];
      ASSERT_LE(kept, can_keep) << where;
      const int32_t most = *std::max_element(counts.begin(), counts.end());
      if (2 * most <= ranks) {
        ASSERT_GE(kept, can_keep - 1) << where;
        ++kept_checked;
        exact += kept == can_keep;
      }
    }
  }
  EXPECT_GT(repaired, 2000);
  EXPECT_GT(kept_checked, 500);
  EXPECT_GE(exact, kept_checked * 98 / 100);
}

}  // namespace
}  // namespace eplb::placement
