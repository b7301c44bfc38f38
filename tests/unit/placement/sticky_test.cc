// Tests of the sticky policy: no moves when nothing changed, the drift scenario of the
// goal of the policy (few moved slots, balance within the tolerance), tolerance 0, repairs of
// previous placements that break the rules, and bad inputs. Fixed seeds, printed on failure.

#include "placement/sticky.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "placement/balanced.h"
#include "placement/deepseek.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"

namespace eplb::placement {
namespace {

Layout make_layout(int64_t experts, int64_t physical, int64_t ranks, int64_t nodes,
                   int64_t groups) {
  Layout layout;
  layout.experts = experts;
  layout.physical = physical;
  layout.ranks = ranks;
  layout.nodes = nodes;
  layout.groups = groups;
  return layout;
}

LoadMatrix lognormal_load(int64_t layers, int64_t experts, std::mt19937_64& rng) {
  std::lognormal_distribution<double> dist(0.0, 1.0);
  LoadMatrix load(layers, experts);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  return load;
}

// Multiplies every load by lognormal(0, sigma), rounded like integer token counts.
LoadMatrix drift(const LoadMatrix& load, std::mt19937_64& rng, double sigma = 0.2) {
  std::lognormal_distribution<double> dist(0.0, sigma);
  LoadMatrix out = load;
  for (double& v : out.values) v = std::round(v * dist(rng));
  return out;
}

int64_t duplicates_on_ranks(const Placement& placement, const Layout& layout) {
  const int64_t spr = layout.slots_per_rank();
  int64_t dups = 0;
  for (int64_t l = 0; l < placement.layers; ++l) {
    const auto slots = placement.layer_phy2log(l);
    for (int64_t r = 0; r < layout.ranks; ++r) {
      std::vector<int32_t> rank(slots.begin() + r * spr, slots.begin() + (r + 1) * spr);
      std::sort(rank.begin(), rank.end());
      dups += std::adjacent_find(rank.begin(), rank.end()) != rank.end();
    }
  }
  return dups;
}

// Every layer's balancedness is at least balanced's minus the tolerance.
void expect_within_tolerance(const LoadMatrix& load, const Layout& layout, const Placement& out,
                             double tolerance, bool hierarchical, bool thorough = false) {
  const Placement best = balanced(load, layout, hierarchical, thorough);
  for (int64_t l = 0; l < load.layers; ++l) {
    EXPECT_GE(layer_balancedness(load.row(l), out.layer_phy2log(l), layout),
              layer_balancedness(load.row(l), best.layer_phy2log(l), layout) - tolerance - 1e-12)
        << "layer " << l;
  }
}

// `steps` rebalances, each of a lognormal(0, 0.2) drift of `load`, placed by sticky from the
// previous one (non-hierarchical), each checked for the rules, the tolerance and identical
// repeats. Leaves `load` and `previous` at the last step; returns each step's moved fraction.
std::vector<double> sticky_under_drift(const Layout& layout, LoadMatrix& load, Placement& previous,
                                       std::mt19937_64& rng, int steps) {
  std::vector<double> moved;
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    load = drift(load, rng);
    const Placement out = sticky(load, layout, previous, 0.01, false);
    EXPECT_NO_THROW(out.validate());
    EXPECT_EQ(duplicates_on_ranks(out, layout), 0);
    expect_within_tolerance(load, layout, out, 0.01, false);
    EXPECT_EQ(sticky(load, layout, previous, 0.01, false).phy2log, out.phy2log);
    moved.push_back(static_cast<double>(moved_slots(previous, out)) /
                    static_cast<double>(load.layers * layout.physical));
    previous = out;
  }
  return moved;
}

const Layout kDeepseekV3 = make_layout(256, 288, 32, 4, 8);

TEST(Sticky, UnchangedLoadMovesNothing) {
  for (const bool hierarchical : {false, true}) {
    SCOPED_TRACE(hierarchical ? "hierarchical" : "global");
    std::mt19937_64 rng(3);
    const LoadMatrix load = lognormal_load(4, 256, rng);
    const Placement previous = balanced(load, kDeepseekV3, hierarchical);
    const Placement out = sticky(load, kDeepseekV3, previous, 0.01, hierarchical);
    EXPECT_EQ(moved_slots(previous, out), 0);
    EXPECT_EQ(out.phy2log, previous.phy2log);
  }
}

TEST(Sticky, DriftScenarioMovesFewSlots) {
  // The policy's goal: 16 layers, lognormal(0, 1) loads, five steps of lognormal(0, 0.2) drift,
  // each placed by sticky from the previous step's placement.
  const Layout layout = make_layout(256, 288, 32, 4, 1);
  std::mt19937_64 rng(11);
  LoadMatrix load = lognormal_load(16, 256, rng);
  Placement previous = balanced(load, layout, false);
  const std::vector<double> moved = sticky_under_drift(layout, load, previous, rng, 5);
  const double moved_fraction =
      std::accumulate(moved.begin(), moved.end(), 0.0) / static_cast<double>(moved.size());
  EXPECT_LE(moved_fraction, 0.15);
}

TEST(Sticky, OneSwapSettlesAnOverloadedRank) {
  // Rank 0 carries 12 against a mean of 9; swapping its 5 for rank 1's 2 (or its 4 for the 1)
  // brings both to 9, the fewest moves that can (the counts cannot change: no redundant slot).
  const Layout layout = make_layout(6, 6, 2, 1, 1);
  Placement previous(1, 6, 6);
  previous.phy2log = {0, 1, 2, 3, 4, 5};
  previous.derive_from_phy2log();
  LoadMatrix load(1, 6);
  load.values = {5, 4, 3, 3, 2, 1};
  const Placement out = sticky(load, layout, previous, 0.0, false);
  ASSERT_NO_THROW(out.validate());
  EXPECT_EQ(moved_slots(previous, out), 2);
  EXPECT_DOUBLE_EQ(layer_balancedness(load.row(0), out.layer_phy2log(0), layout), 1.0);
}

TEST(Sticky, TwoSwapsSettleARankNoSingleSwapCan) {
  // Rank 0 carries 18 against a mean of 10 and every other rank can take only 4 more, so it
  // needs two swaps of a 6 for a 2, one with each rank: 4 moved slots, the fewest that can.
  const Layout layout = make_layout(9, 9, 3, 1, 1);
  Placement previous(1, 9, 9);
  previous.phy2log = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  previous.derive_from_phy2log();
  LoadMatrix load(1, 9);
  load.values = {6, 6, 6, 2, 2, 2, 2, 2, 2};
  const Placement out = sticky(load, layout, previous, 0.0, false);
  ASSERT_NO_THROW(out.validate());
  EXPECT_EQ(moved_slots(previous, out), 4);
  EXPECT_DOUBLE_EQ(layer_balancedness(load.row(0), out.layer_phy2log(0), layout), 1.0);
}

TEST(Sticky, SevenSlotsPerRankDriftMovesFewSlots) {
  // A 384-expert model on 64 ranks (7 slots each), where the swaps that settle the overloaded
  // ranks do most of the work.
  const Layout layout = make_layout(384, 448, 64, 8, 1);
  std::mt19937_64 rng(17);
  LoadMatrix load = lognormal_load(8, 384, rng);
  Placement previous = balanced(load, layout, false);
  for (const double moved : sticky_under_drift(layout, load, previous, rng, 3)) {
    EXPECT_LE(moved, 0.15);
  }
}

TEST(Sticky, ManyRanksRelabelKeepsTheRules) {
  // Past 64 ranks the fallback's ranks are matched greedily: the result still follows every
  // rule, reaches the target, and an unchanged load still moves nothing.
  for (const bool hierarchical : {false, true}) {
    SCOPED_TRACE(hierarchical ? "hierarchical" : "global");
    const Layout layout = make_layout(256, 512, 256, 32, hierarchical ? 32 : 8);
    std::mt19937_64 rng(21);
    LoadMatrix load = lognormal_load(3, 256, rng);
    const Placement previous = balanced(load, layout, hierarchical);
    EXPECT_EQ(moved_slots(previous, sticky(load, layout, previous, 0.01, hierarchical)), 0);
    load = drift(load, rng);
    const Placement out = sticky(load, layout, previous, 0.01, hierarchical);
    ASSERT_NO_THROW(out.validate());
    EXPECT_EQ(duplicates_on_ranks(out, layout), 0);
    expect_within_tolerance(load, layout, out, 0.01, hierarchical);
  }
}

TEST(Sticky, TwoSlotsPerRankDriftMovesFewSlots) {
  // DeepSeek-V3 decode at 144 ranks: the previous pairs moved to balanced's counts keep most
  // slots (relabelling balanced's own pairs moved 38% here).
  const Layout layout = make_layout(256, 288, 144, 18, 8);
  std::mt19937_64 rng(13);
  LoadMatrix load = lognormal_load(8, 256, rng);
  Placement previous = balanced(load, layout, false);
  for (const double moved : sticky_under_drift(layout, load, previous, rng, 2)) {
    EXPECT_LE(moved, 0.15);
  }
  // From deepseek's placement, which may put two replicas of an expert on one rank: the result
  // never does.
  const Placement from_deepseek = sticky(load, layout, deepseek(load, layout), 0.01, false);
  ASSERT_NO_THROW(from_deepseek.validate());
  EXPECT_EQ(duplicates_on_ranks(from_deepseek, layout), 0);
  expect_within_tolerance(load, layout, from_deepseek, 0.01, false);
}

TEST(Sticky, TwoSlotsAt256RanksWithEqualLoadsKeepsTheRules) {
  // DeepSeek-V3 decode at 256 ranks, where the search runs tens of rounds per layer and the
  // repair trades: loads of a few tokens, so many replicas share a load per replica and the
  // ties in the search's give-up order and the repair's trade scan are all exercised.
  const Layout layout = make_layout(256, 512, 256, 32, 8);
  std::mt19937_64 rng(29);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  LoadMatrix load(3, 256);
  for (double& v : load.values) v = std::round(dist(rng) * 8.0);
  Placement previous = balanced(load, layout, false);
  for (const double moved : sticky_under_drift(layout, load, previous, rng, 2)) {
    EXPECT_LE(moved, 0.25);  // 18% and 12% here: past the search's first budget, so both run
  }
}

// Loads of a few tokens from a fixed generator (splitmix64, the same on every platform): most
// replicas tie with others on their load per replica, and many ranks on their load.
LoadMatrix few_token_load(int64_t layers, int64_t experts, uint64_t seed, uint64_t most) {
  LoadMatrix load(layers, experts);
  for (double& v : load.values) {
    uint64_t z = (seed += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    v = static_cast<double>((z ^ (z >> 31)) % (most + 1));
  }
  return load;
}

uint64_t fnv1a(std::span<const int32_t> values) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const int32_t v : values) {
    h ^= static_cast<uint32_t>(v);
    h *= 0x100000001b3ULL;
  }
  return h;
}

TEST(Sticky, TwoSlotsSearchPlacementsArePinned) {
  // The search's choices at two slots per rank on tie-heavy loads, pinned to the placements it
  // gave when its give-up slots were still walked rank by rank in load order (each candidate
  // tried in that order, stopping once nothing of cost 1 could win): weighing them all at once
  // must take the same action, ties and the walk's stop included. Redundant slots more than
  // half the slots (the walk over ranks) and at most half (the heap), tolerance 0.01 and 0. A
  // change meant to alter the search's choices updates these hashes (the two shapes of scarce
  // replicas changed with balanced's two-move leaps, which change the previous placement and
  // sticky's target).
  struct Case {
    int64_t experts, physical, ranks;
    uint64_t most, seed;
    double tolerance;
    uint64_t hash;
  };
  const Case cases[] = {
      {16, 32, 16, 9, 1, 0.01, 7469157885115782272ULL},
      {16, 32, 16, 3, 2, 0.0, 13200340704078833986ULL},
      {16, 18, 9, 9, 3, 0.01, 11138279788649962277ULL},
      {32, 36, 18, 4, 4, 0.0, 14307804359466703171ULL},
      {64, 128, 64, 6, 5, 0.01, 1927964424388303320ULL},
      {256, 512, 256, 8, 6, 0.01, 7883450559038726250ULL},
  };
  for (const Case& k : cases) {
    const Layout layout = make_layout(k.experts, k.physical, k.ranks, 1, 1);
    const LoadMatrix before = few_token_load(12, k.experts, k.seed, k.most);
    const LoadMatrix after = few_token_load(12, k.experts, k.seed + 100, k.most);
    const Placement previous = balanced(before, layout, false);
    const Placement placed = sticky(after, layout, previous, k.tolerance, false);
    EXPECT_EQ(fnv1a(placed.phy2log), k.hash)
        << k.experts << " experts, " << k.physical << " slots, " << k.ranks << " ranks, seed "
        << k.seed << ", tolerance " << k.tolerance;
  }
}

TEST(Sticky, ThoroughIsHeldToThoroughBalanced) {
  // With `thorough`, the balance sticky keeps within its tolerance is thorough balanced's (at
  // 256 ranks 5-6% above the default's): the rules hold and every layer is within it.
  const Layout layout = make_layout(256, 512, 256, 32, 8);
  std::mt19937_64 rng(31);
  LoadMatrix load = lognormal_load(3, 256, rng);
  const Placement previous = balanced(load, layout, false, true);
  std::lognormal_distribution<double> drift(0.0, 0.2);
  for (double& v : load.values) v = std::round(v * drift(rng));
  const Placement out = sticky(load, layout, previous, 0.01, false, true);
  ASSERT_NO_THROW(out.validate());
  EXPECT_EQ(duplicates_on_ranks(out, layout), 0);
  expect_within_tolerance(load, layout, out, 0.01, false, true);
  EXPECT_EQ(out.phy2log, sticky(load, layout, previous, 0.01, false, true).phy2log);
}

TEST(Sticky, OneSlotPerRankMovesTheFewestSlots) {
  // 256 experts on 320 ranks of one slot: a placement is good exactly when every expert e has
  // at least need_e replicas (the fewest with w_e / need_e <= cap), so the fewest moves any
  // good placement has are the sum of need_e - (slots e held before) over the experts short.
  const Layout layout = make_layout(256, 320, 320, 40, 8);
  std::mt19937_64 rng(29);
  LoadMatrix load = lognormal_load(6, 256, rng);
  Placement previous = balanced(load, layout, false);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    load = drift(load, rng, step == 2 ? 1.0 : 0.2);
    const Placement out = sticky(load, layout, previous, 0.01, false);
    ASSERT_NO_THROW(out.validate());
    expect_within_tolerance(load, layout, out, 0.01, false);
    const Placement fresh = balanced(load, layout, false);
    for (int64_t l = 0; l < load.layers; ++l) {
      const std::span<const double> w = load.row(l);
      double total = 0;
      for (const double v : w) total += v;
      const double cap = total / static_cast<double>(layout.ranks) /
                         (layer_balancedness(w, fresh.layer_phy2log(l), layout) - 0.01);
      std::vector<int64_t> had(256, 0);
      for (const int32_t e : previous.layer_phy2log(l)) ++had[e];
      int64_t fewest = 0;
      for (int64_t e = 0; e < 256; ++e) {
        int64_t need = 1;
        while (w[e] / static_cast<double>(need) > cap) ++need;
        fewest += std::max<int64_t>(0, need - had[e]);
      }
      int64_t moved = 0;
      for (int64_t p = 0; p < layout.physical; ++p) {
        moved += previous.layer_phy2log(l)[p] != out.layer_phy2log(l)[p];
      }
      EXPECT_EQ(moved, fewest) << "layer " << l;
    }
    previous = out;
  }
}

TEST(Sticky, HierarchicalDriftKeepsGroupsOnOneNode) {
  std::mt19937_64 rng(12);
  LoadMatrix load = lognormal_load(6, 256, rng);
  Placement previous = balanced(load, kDeepseekV3, true);
  const int64_t per_group = kDeepseekV3.experts / kDeepseekV3.groups;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    load = drift(load, rng);
    const Placement out = sticky(load, kDeepseekV3, previous, 0.01, true);
    ASSERT_NO_THROW(out.validate());
    EXPECT_EQ(duplicates_on_ranks(out, kDeepseekV3), 0);
    expect_within_tolerance(load, kDeepseekV3, out, 0.01, true);
    for (int64_t l = 0; l < load.layers; ++l) {
      std::vector<int64_t> node_of_group(static_cast<size_t>(kDeepseekV3.groups), -1);
      const auto slots = out.layer_phy2log(l);
      for (int64_t p = 0; p < kDeepseekV3.physical; ++p) {
        const int64_t k = slots[p] / per_group;
        if (node_of_group[k] < 0) node_of_group[k] = kDeepseekV3.node_of_slot(p);
        EXPECT_EQ(node_of_group[k], kDeepseekV3.node_of_slot(p)) << "layer " << l;
      }
    }
    previous = out;
  }
}

TEST(Sticky, ToleranceZeroReachesBalancedBalance) {
  std::mt19937_64 rng(5);
  LoadMatrix load = lognormal_load(6, 256, rng);
  const Placement previous = balanced(load, kDeepseekV3, false);
  load = drift(load, rng);
  const Placement out = sticky(load, kDeepseekV3, previous, 0.0, false);
  ASSERT_NO_THROW(out.validate());
  EXPECT_EQ(duplicates_on_ranks(out, kDeepseekV3), 0);
  expect_within_tolerance(load, kDeepseekV3, out, 0.0, false);
}

TEST(Sticky, RepairsPreviousPlacementsThatBreakTheRules) {
  // The trivial placement, and deepseek's (which may put two replicas of an expert on a rank).
  std::mt19937_64 rng(6);
  const Layout layout = make_layout(64, 80, 16, 2, 4);
  const LoadMatrix load = lognormal_load(4, 64, rng);
  for (const bool hierarchical : {false, true}) {
    SCOPED_TRACE(hierarchical ? "hierarchical" : "global");
    for (const Placement& previous :
         {trivial_placement(4, 64, 80), deepseek(load, layout), deepseek(drift(load, rng), layout)}) {
      const Placement out = sticky(load, layout, previous, 0.01, hierarchical);
      ASSERT_NO_THROW(out.validate());
      EXPECT_EQ(duplicates_on_ranks(out, layout), 0);
      expect_within_tolerance(load, layout, out, 0.01, hierarchical);
      EXPECT_EQ(sticky(load, layout, previous, 0.01, hierarchical).phy2log, out.phy2log);
    }
  }
}

TEST(Sticky, TrivialPreviousAtDeepseekShape) {
  // Where engines start: slot p holds expert p mod E. The incremental search has many rounds to
  // run here; it must still end valid, within the tolerance, the same twice, and keep far more
  // slots than a fresh packing would.
  std::mt19937_64 rng(8);
  const LoadMatrix load = lognormal_load(4, 256, rng);
  const Placement previous = trivial_placement(4, 256, 288);
  for (const bool hierarchical : {false, true}) {
    SCOPED_TRACE(hierarchical ? "hierarchical" : "global");
    const Placement out = sticky(load, kDeepseekV3, previous, 0.01, hierarchical);
    ASSERT_NO_THROW(out.validate());
    EXPECT_EQ(duplicates_on_ranks(out, kDeepseekV3), 0);
    expect_within_tolerance(load, kDeepseekV3, out, 0.01, hierarchical);
    EXPECT_EQ(sticky(load, kDeepseekV3, previous, 0.01, hierarchical).phy2log, out.phy2log);
    EXPECT_LT(moved_slots(previous, out),
              moved_slots(previous, balanced(load, kDeepseekV3, hierarchical)));
  }
}

TEST(Sticky, StrongDriftAtDeepseekShapeStaysValid) {
  // lognormal(0, 0.5) drift makes the search replicate and replace as well as swap, so every
  // index it keeps between rounds is exercised; each step starts from the one before.
  for (const bool hierarchical : {false, true}) {
    SCOPED_TRACE(hierarchical ? "hierarchical" : "global");
    std::mt19937_64 rng(9);
    LoadMatrix load = lognormal_load(4, 256, rng);
    Placement previous = balanced(load, kDeepseekV3, hierarchical);
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      load = drift(load, rng, 0.5);
      const Placement out = sticky(load, kDeepseekV3, previous, 0.01, hierarchical);
      ASSERT_NO_THROW(out.validate());
      EXPECT_EQ(duplicates_on_ranks(out, kDeepseekV3), 0);
      expect_within_tolerance(load, kDeepseekV3, out, 0.01, hierarchical);
      EXPECT_EQ(sticky(load, kDeepseekV3, previous, 0.01, hierarchical).phy2log, out.phy2log);
      previous = out;
    }
  }
}

TEST(Sticky, SmallShapesStayValid) {
  const std::vector<Layout> layouts = {make_layout(16, 32, 8, 2, 4), make_layout(12, 16, 8, 2, 4),
                                       make_layout(6, 8, 4, 1, 1), make_layout(64, 64, 16, 2, 4)};
  for (const Layout& layout : layouts) {
    for (uint64_t seed : {21u, 22u}) {
      SCOPED_TRACE(layout.describe() + " seed " + std::to_string(seed));
      std::mt19937_64 rng(seed);
      LoadMatrix load = lognormal_load(4, layout.experts, rng);
      Placement previous = balanced(load, layout, false);
      for (int step = 0; step < 3; ++step) {
        load = drift(load, rng, 0.5);
        const Placement out = sticky(load, layout, previous, 0.01, false);
        ASSERT_NO_THROW(out.validate());
        EXPECT_EQ(duplicates_on_ranks(out, layout), 0);
        expect_within_tolerance(load, layout, out, 0.01, false);
        previous = out;
      }
    }
  }
}

TEST(Sticky, BadInputsAreInvalidArguments) {
  std::mt19937_64 rng(7);
  const LoadMatrix load = lognormal_load(2, 12, rng);
  const Layout layout = make_layout(12, 16, 8, 4, 6);
  const Placement previous = trivial_placement(2, 12, 16);
  // groups % nodes != 0 with hierarchical.
  EXPECT_THROW(sticky(load, layout, previous, 0.01, true), InvalidArgument);
  EXPECT_NO_THROW(sticky(load, layout, previous, 0.01, false));
  // A previous placement of another shape.
  EXPECT_THROW(sticky(load, layout, trivial_placement(3, 12, 16), 0.01, false), InvalidArgument);
  EXPECT_THROW(sticky(load, layout, trivial_placement(2, 12, 24), 0.01, false), InvalidArgument);
  // A tolerance outside [0, 1).
  EXPECT_THROW(sticky(load, layout, previous, -0.1, false), InvalidArgument);
  EXPECT_THROW(sticky(load, layout, previous, 1.0, false), InvalidArgument);
  // Through the policy entry, which checks the previous placement's shape first.
  PolicyOptions options;
  options.policy = Policy::kSticky;
  const Placement wrong = trivial_placement(3, 12, 16);
  options.previous = &wrong;
  EXPECT_THROW(place(load, layout, options), InvalidArgument);
  options.previous = nullptr;
  EXPECT_THROW(place(load, layout, options), InvalidArgument);
}

// A layer without load is dense: balanced gives it the trivial placement, sticky keeps the
// previous one (no slot moves), and the means leave it out.
TEST(DenseLayers, PlacedTriviallyAndLeftOutOfTheMeans) {
  const Layout layout = make_layout(8, 12, 4, 1, 1);
  LoadMatrix load(3, 8);
  std::mt19937 rng(11);
  std::lognormal_distribution<double> dist(0, 1);
  for (int64_t e = 0; e < 8; ++e) load.values[static_cast<size_t>(8 + e)] = dist(rng);  // layer 1
  PolicyOptions options;
  options.policy = Policy::kBalanced;
  const Placement fresh = place(load, layout, options);
  const Placement trivial = trivial_placement(3, 8, 12);
  for (const int64_t l : {0, 2}) {
    EXPECT_TRUE(std::ranges::equal(fresh.layer_phy2log(l), trivial.layer_phy2log(l))) << l;
  }
  fresh.validate();

  Placement previous = fresh;
  std::swap(previous.phy2log[0], previous.phy2log[5]);  // any valid placement of layer 0
  previous.derive_from_phy2log();
  options.policy = Policy::kSticky;
  options.previous = &previous;
  const Placement kept = place(load, layout, options);
  EXPECT_TRUE(std::ranges::equal(kept.layer_phy2log(0), previous.layer_phy2log(0)));
  EXPECT_TRUE(std::ranges::equal(kept.layer_phy2log(2), previous.layer_phy2log(2)));
  kept.validate();

  const PlacementMetrics m = evaluate(load, fresh, layout);
  EXPECT_EQ(m.moe_layers, 1);
  EXPECT_EQ(m.dense, (std::vector<char>{1, 0, 1}));
  EXPECT_DOUBLE_EQ(m.balancedness_mean, m.balancedness[1]);
  EXPECT_DOUBLE_EQ(m.lower_bound_mean, m.lower_bound_balancedness[1]);

  const PlacementMetrics none = evaluate(LoadMatrix(3, 8), fresh, layout);  // all dense
  EXPECT_EQ(none.moe_layers, 0);
  EXPECT_EQ(none.balancedness_mean, 1.0);
  EXPECT_EQ(none.balancedness_step, 1.0);
  EXPECT_EQ(none.lower_bound_mean, 1.0);
}

}  // namespace
}  // namespace eplb::placement
