// Two slots per rank (DeepSeek-V3's decode shapes): balanced's counts and pairing, and the
// bound, against exhaustive search on small layers, against every count vector on layers of
// 8-12 ranks, and on lognormal loads at 144 ranks; and
// what balanced's Step 4 relies on to skip deepseek: deepseek's own counts, and that its layer
// is never below their sorted pairing.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "placement/balanced.h"
#include "placement/deepseek.h"
#include "placement/two_slots.h"
#include "eplb/placement/metrics.h"

namespace eplb::placement {
namespace {

Layout two_slots(int64_t experts, int64_t ranks) {
  Layout layout;
  layout.experts = experts;
  layout.physical = 2 * ranks;
  layout.ranks = ranks;
  return layout;
}

// The best largest pair of `items` (weight, expert) paired two by two, never one expert twice
// on a rank: every perfect matching.
double best_pairing(std::vector<std::pair<double, int32_t>>& items, size_t from) {
  if (from == items.size()) return 0;
  double best = std::numeric_limits<double>::infinity();
  for (size_t j = from + 1; j < items.size(); ++j) {
    if (items[j].second == items[from].second) continue;
    std::swap(items[from + 1], items[j]);
    const double here = items[from].first + items[from + 1].first;
    if (here < best) best = std::min(best, std::max(here, best_pairing(items, from + 2)));
    std::swap(items[from + 1], items[j]);
  }
  return best;
}

// The optimum over every count vector (1 <= r_e <= G, sum 2G) and every pairing.
double optimum(const std::vector<double>& w, int64_t ranks) {
  const size_t n = w.size();
  std::vector<int32_t> count(n, 1);
  double best = std::numeric_limits<double>::infinity();
  std::function<void(size_t, int64_t)> walk = [&](size_t e, int64_t left) {
    if (e == n - 1) {
      if (left < 1 || left > ranks) return;
      count[e] = static_cast<int32_t>(left);
      std::vector<std::pair<double, int32_t>> items;
      for (size_t i = 0; i < n; ++i) {
        for (int32_t r = 0; r < count[i]; ++r) {
          items.emplace_back(w[i] / count[i], static_cast<int32_t>(i));
        }
      }
      best = std::min(best, best_pairing(items, 0));
      return;
    }
    for (int64_t r = 1; r <= std::min<int64_t>(ranks, left - static_cast<int64_t>(n - 1 - e));
         ++r) {
      count[e] = static_cast<int32_t>(r);
      walk(e + 1, left - r);
    }
  };
  walk(0, 2 * ranks);
  return best;
}

double largest_rank(const LoadMatrix& load, const Placement& p, const Layout& layout) {
  const std::vector<double> ranks = rank_loads(load.row(0), p.layer_phy2log(0), layout);
  return *std::max_element(ranks.begin(), ranks.end());
}

int64_t duplicates(const Placement& p, const Layout& layout) {
  int64_t out = 0;
  for (int64_t l = 0; l < p.layers; ++l) {
    const auto slots = p.layer_phy2log(l);
    for (int64_t r = 0; r < layout.ranks; ++r) out += slots[2 * r] == slots[2 * r + 1];
  }
  return out;
}

TEST(TwoSlots, AgainstExhaustiveSearch) {
  // The bound never exceeds the optimum and never falls below the old one; balanced follows
  // the rules and reaches the optimum on nearly every layer.
  std::mt19937_64 rng(17);
  int cases = 0, optimal = 0;
  double worst = 1;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t ranks = 2 + static_cast<int64_t>(rng() % 3);
    const int64_t experts = 2 + static_cast<int64_t>(rng() % (2 * ranks - 1));
    LoadMatrix load(1, experts);
    const int kind = trial % 4;
    for (double& v : load.values) {
      v = static_cast<double>(kind == 1 ? 4 + rng() % 3 : rng() % 20);
      if (kind == 2 && rng() % 2 == 0) v = 0;
    }
    if (kind == 3) load.values[0] = 60 + static_cast<double>(rng() % 20);
    const Layout layout = two_slots(experts, ranks);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(experts) +
                 " experts on " + std::to_string(ranks) + " ranks");
    const double best = optimum(load.values, ranks);
    const double bound = layer_lower_bound(load.row(0), layout);
    EXPECT_LE(bound, best * (1 + 1e-9));
    double total = 0;
    for (const double v : load.values) total += v;
    EXPECT_GE(bound, total / static_cast<double>(ranks) * (1 - 1e-12));
    const Placement out = balanced(load, layout, false);
    ASSERT_NO_THROW(out.validate());
    EXPECT_EQ(duplicates(out, layout), 0);
    const double got = largest_rank(load, out, layout);
    EXPECT_GE(got, best * (1 - 1e-9));
    ++cases;
    optimal += got <= best * (1 + 1e-9);
    if (best > 0) worst = std::max(worst, got / best);
    // thorough keeps the better counts: the same rules, never above the default.
    const Placement deep = balanced(load, layout, false, true);
    ASSERT_NO_THROW(deep.validate());
    EXPECT_EQ(duplicates(deep, layout), 0);
    const double deep_got = largest_rank(load, deep, layout);
    EXPECT_GE(deep_got, best * (1 - 1e-9));
    EXPECT_LE(deep_got, got * (1 + 1e-12));
  }
  // Moving one replica at a time can stop short on tiny layers where the rule against two
  // replicas on a rank binds (a few experts, zeros, one dominant): about 9 in 10 are optimal, the
  // worst up to 1.7x the optimum. At production sizes the rule almost never binds (next test).
  EXPECT_GE(optimal, cases * 8 / 10) << optimal << " of " << cases << " layers optimal, worst "
                                     << worst << "x";
}

// The least largest pair over every count vector (r_e >= 1, sum 2 ranks, two replicas of an
// expert on one rank allowed): the sorted pairing of each.
double relaxed_optimum(const std::vector<double>& w, int64_t ranks) {
  std::vector<int32_t> count(w.size(), 1);
  double best = std::numeric_limits<double>::infinity();
  std::function<void(size_t, int64_t)> walk = [&](size_t e, int64_t extra) {
    if (e == w.size() - 1) {
      count[e] = static_cast<int32_t>(1 + extra);
      best = std::min(best, two_slots::pairing_top(w, count, ranks));
      return;
    }
    for (int64_t x = 0; x <= extra; ++x) {
      count[e] = static_cast<int32_t>(1 + x);
      walk(e + 1, extra - x);
    }
  };
  walk(0, 2 * ranks - static_cast<int64_t>(w.size()));
  return best;
}

TEST(TwoSlots, BoundAgainstEveryCountVector) {
  // Layers large enough that the pairing binds at several levels at once (the bound's second
  // stage): the bound never exceeds the least largest pair of any count vector, and on most
  // layers it comes within 2% of it.
  std::mt19937_64 rng(29);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  int cases = 0, close = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t ranks = 8 + static_cast<int64_t>(rng() % 5);
    const int64_t experts = 2 * ranks - 1 - static_cast<int64_t>(rng() % 4);
    std::vector<double> w(static_cast<size_t>(experts));
    for (double& v : w) v = std::round(dist(rng) * 100.0 * (trial % 3 == 0 ? 1 + dist(rng) : 1));
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(experts) +
                 " experts on " + std::to_string(ranks) + " ranks");
    const double best = relaxed_optimum(w, ranks);
    const double bound = two_slots::bound(w, ranks);
    EXPECT_LE(bound, best * (1 + 1e-9));
    ++cases;
    close += bound >= best * 0.98;
  }
  EXPECT_GE(close, cases * 8 / 10) << close << " of " << cases << " within 2%";
}

TEST(TwoSlots, LognormalAt144RanksIsCloseToTheBound) {
  // DeepSeek-V3 decode's shape: 256 experts on 144 ranks of two slots. The old bound sat 0.013
  // above balanced; the pairing bound (both stages) is within 0.001 of it, and balanced is at
  // least deepseek.
  std::mt19937_64 rng(4);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  LoadMatrix load(12, 256);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  Layout layout = two_slots(256, 144);
  layout.nodes = 18;
  layout.groups = 8;
  const PlacementMetrics ours = evaluate(load, balanced(load, layout, false), layout);
  const PlacementMetrics theirs = evaluate(load, deepseek(load, layout), layout);
  EXPECT_LE(ours.lower_bound_mean - ours.balancedness_mean, 0.001);
  EXPECT_GE(ours.balancedness_mean, theirs.balancedness_mean);
  for (int64_t l = 0; l < load.layers; ++l) {
    EXPECT_LE(ours.balancedness[l], ours.lower_bound_balancedness[l] + 1e-12) << "layer " << l;
  }
}

TEST(TwoSlots, ThoroughAt256RanksNearsTheMean) {
  // 512 slots for 256 experts: the move search stops 6-8% above the mean rank load; the level
  // sweep's counts come within 2% of it, on every layer at least the default, by the same rules,
  // the same on every call.
  std::mt19937_64 rng(4);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  LoadMatrix load(6, 256);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  Layout layout = two_slots(256, 256);
  layout.nodes = 32;
  layout.groups = 8;
  const Placement fast = balanced(load, layout, false);
  const Placement deep = balanced(load, layout, false, true);
  ASSERT_NO_THROW(deep.validate());
  EXPECT_EQ(duplicates(deep, layout), 0);
  EXPECT_EQ(deep.phy2log, balanced(load, layout, false, true).phy2log);
  const PlacementMetrics f = evaluate(load, fast, layout);
  const PlacementMetrics d = evaluate(load, deep, layout);
  for (int64_t l = 0; l < load.layers; ++l) {
    EXPECT_GE(d.balancedness[l], f.balancedness[l] - 1e-12) << "layer " << l;
    EXPECT_LE(d.balancedness[l], d.lower_bound_balancedness[l] + 1e-12) << "layer " << l;
  }
  EXPECT_GE(d.balancedness_mean, 0.975);
  EXPECT_GE(d.balancedness_mean, f.balancedness_mean + 0.03);
}

TEST(TwoSlots, DeepseekIsNeverBelowTheSortedPairingOfItsCounts) {
  // balanced skips deepseek on a layer where its own largest rank is below the sorted pairing
  // of deepseek's counts (deepseek_global_counts): that pairing is the least largest rank any
  // packing of those replicas has. Both claims, on global layouts, with ties (small integer
  // loads) and without.
  std::mt19937_64 rng(23);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  struct Shape {
    int64_t experts, ranks, nodes, groups;
    double scale;
  };
  for (const Shape& s : {Shape{256, 256, 32, 8, 1000}, Shape{256, 144, 18, 8, 1000},
                         Shape{64, 48, 1, 1, 1000}, Shape{16, 12, 3, 2, 3}, Shape{8, 4, 1, 1, 2}}) {
    SCOPED_TRACE(std::to_string(s.experts) + " experts on " + std::to_string(s.ranks) +
                 " ranks, scale " + std::to_string(s.scale));
    Layout layout = two_slots(s.experts, s.ranks);
    layout.nodes = s.nodes;
    layout.groups = s.groups;
    LoadMatrix load(6, s.experts);
    for (double& v : load.values) v = std::round(dist(rng) * s.scale);
    const Placement theirs = deepseek(load, layout);
    for (int64_t l = 0; l < load.layers; ++l) {
      const std::span<const double> w = load.row(l);
      const std::vector<int32_t> counts = deepseek_global_counts(w, layout.physical);
      ASSERT_EQ(counts, std::vector<int32_t>(theirs.replica_count.begin() + l * s.experts,
                                             theirs.replica_count.begin() + (l + 1) * s.experts))
          << "layer " << l;
      std::vector<double> replicas;
      for (int64_t e = 0; e < s.experts; ++e) {
        for (int32_t k = 0; k < counts[e]; ++k) replicas.push_back(w[e] / counts[e]);
      }
      std::sort(replicas.begin(), replicas.end());
      double sorted_top = 0;
      for (size_t k = 0; k < replicas.size() / 2; ++k) {
        sorted_top = std::max(sorted_top, replicas[k] + replicas[replicas.size() - 1 - k]);
      }
      const std::vector<double> ranks = rank_loads(w, theirs.layer_phy2log(l), layout);
      EXPECT_GE(*std::max_element(ranks.begin(), ranks.end()), sorted_top) << "layer " << l;
    }
  }
}

}  // namespace
}  // namespace eplb::placement
