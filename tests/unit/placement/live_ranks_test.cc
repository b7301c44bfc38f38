// Tests of placement on live ranks only (elastic serving): every policy puts every expert on the
// live ranks, the other ranks' slots keep the previous placement, the result validates, sticky
// keeps most live slots, a clear error when the live slots are too few, and every rank live is
// today's placement bit for bit. Fixed seeds, printed on failure.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "placement/balanced.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"
#include "placement/sticky.h"

namespace eplb::placement {
namespace {

Layout make_layout(int64_t experts, int64_t physical, int64_t ranks, int64_t nodes,
                   int64_t groups) {
  return Layout{
      .experts = experts, .physical = physical, .ranks = ranks, .nodes = nodes, .groups = groups};
}

// Lognormal loads, the last layer dense (no load: it keeps the previous placement).
LoadMatrix lognormal_load(int64_t layers, int64_t experts, std::mt19937_64& rng) {
  std::lognormal_distribution<double> dist(0.0, 1.0);
  LoadMatrix load(layers, experts);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  for (double& v : load.row(layers - 1)) v = 0;
  return load;
}

// Multiplies every load by lognormal(0, sigma), rounded like integer token counts.
LoadMatrix drift(const LoadMatrix& load, std::mt19937_64& rng, double sigma = 0.2) {
  std::lognormal_distribution<double> dist(0.0, sigma);
  LoadMatrix out = load;
  for (double& v : out.values) v = std::round(v * dist(rng));
  return out;
}

std::vector<int32_t> all_but(int64_t ranks, std::vector<int32_t> lost) {
  std::vector<int32_t> live;
  for (int32_t g = 0; g < ranks; ++g) {
    if (std::find(lost.begin(), lost.end(), g) == lost.end()) live.push_back(g);
  }
  return live;
}

struct Case {
  std::string name;
  Layout layout;
  std::vector<int32_t> lost;
  bool compact_hierarchical;  // whether the live ranks still form whole, equal nodes
};

std::vector<Case> cases() {
  const Layout wide = make_layout(256, 296, 8, 2, 8);
  const Layout wider = make_layout(256, 384, 8, 2, 8);
  const Layout nodes = make_layout(96, 128, 16, 4, 12);
  return {
      {"8 ranks, rank 2 lost", wide, {2}, false},
      {"8 ranks, ranks 0 and 7 lost", wider, {0, 7}, true},
      {"16 ranks, two ranks of node 1 lost", nodes, {5, 6}, false},
      {"16 ranks, one rank of every node lost", nodes, {3, 7, 11, 15}, true},
      {"16 ranks, node 1 lost", nodes, {4, 5, 6, 7}, true},
  };
}

struct Config {
  Policy policy;
  bool hierarchical;
};

constexpr Config kConfigs[] = {{Policy::kDeepseek, false}, {Policy::kBalanced, false},
                               {Policy::kBalanced, true},  {Policy::kSticky, false},
                               {Policy::kSticky, true}};

std::string describe(const Config& c) {
  return std::string(policy_name(c.policy)) + (c.hierarchical ? " hierarchical" : "");
}

// The slots of the live ranks, in order: the compact layer.
std::vector<int32_t> live_slots(std::span<const int32_t> slots, const Layout& layout,
                                std::span<const int32_t> live) {
  const int64_t spr = layout.slots_per_rank();
  std::vector<int32_t> out;
  for (const int32_t g : live) out.insert(out.end(), slots.begin() + g * spr, slots.begin() + (g + 1) * spr);
  return out;
}

// The invariants of a placement on live ranks.
void expect_on_live_ranks(const Placement& out, const Layout& layout,
                          std::span<const int32_t> live, const Placement* previous) {
  ASSERT_NO_THROW(out.validate());
  const int64_t spr = layout.slots_per_rank();
  std::vector<uint8_t> is_live(static_cast<size_t>(layout.ranks), 0);
  for (const int32_t g : live) is_live[g] = 1;
  for (int64_t l = 0; l < out.layers; ++l) {
    const auto slots = out.layer_phy2log(l);
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (is_live[p / spr]) continue;
      const int32_t kept = previous != nullptr ? previous->layer_phy2log(l)[p]
                                               : static_cast<int32_t>(p % layout.experts);
      ASSERT_EQ(slots[p], kept) << "layer " << l << " slot " << p << " of a rank not live";
    }
    for (int64_t e = 0; e < layout.experts; ++e) {
      // Live replicas first, then the others.
      bool seen_other = false;
      int64_t on_live = 0;
      for (const int32_t s : out.replicas(l, e)) {
        if (is_live[s / spr]) {
          ASSERT_FALSE(seen_other) << "layer " << l << " expert " << e
                                   << ": a live replica after one on a rank not live";
          ++on_live;
        } else {
          seen_other = true;
        }
      }
      ASSERT_GE(on_live, 1) << "layer " << l << " expert " << e << " has no replica on a live rank";
    }
  }
}

// In hierarchical mode, each group's live replicas sit on one node (layers with load only).
void expect_groups_on_one_node(const Placement& out, const LoadMatrix& load, const Layout& layout,
                               std::span<const int32_t> live) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<uint8_t> is_live(static_cast<size_t>(layout.ranks), 0);
  for (const int32_t g : live) is_live[g] = 1;
  for (int64_t l = 0; l + 1 < out.layers; ++l) {
    std::vector<std::set<int64_t>> nodes(static_cast<size_t>(layout.groups));
    const auto slots = out.layer_phy2log(l);
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (is_live[layout.rank_of_slot(p)]) nodes[slots[p] / per_group].insert(layout.node_of_slot(p));
    }
    for (int64_t k = 0; k < layout.groups; ++k) {
      EXPECT_EQ(nodes[k].size(), 1u) << "layer " << l << " group " << k;
    }
  }
  (void)load;
}

TEST(LiveRanks, EveryPolicyPlacesEveryExpertOnLiveRanks) {
  for (const Case& c : cases()) {
    for (const Config& config : kConfigs) {
      for (const bool with_previous : {true, false}) {
        if (config.policy == Policy::kSticky && !with_previous) continue;
        const uint64_t seed = 11;
        SCOPED_TRACE(c.name + ", " + describe(config) +
                     (with_previous ? ", previous" : ", no previous") + ", seed " +
                     std::to_string(seed));
        std::mt19937_64 rng(seed);
        const LoadMatrix before = lognormal_load(4, c.layout.experts, rng);
        const Placement previous = place(before, c.layout, {.policy = Policy::kBalanced});
        const LoadMatrix load = drift(before, rng);
        PolicyOptions options{.policy = config.policy, .hierarchical = config.hierarchical};
        options.previous = with_previous ? &previous : nullptr;
        options.live_ranks = all_but(c.layout.ranks, c.lost);
        const Placement out = place(load, c.layout, options);
        expect_on_live_ranks(out, c.layout, options.live_ranks, options.previous);
        if (config.hierarchical && c.compact_hierarchical) {
          expect_groups_on_one_node(out, load, c.layout, options.live_ranks);
        }
        // Deterministic: the same call gives the same placement.
        const Placement again = place(load, c.layout, options);
        EXPECT_EQ(again.phy2log, out.phy2log);
        EXPECT_EQ(again.log2phy, out.log2phy);
      }
    }
  }
}

// A previous placement whose lost rank held the only replica of many experts (a dense layer
// included): those experts need a slot on the live ranks, and a dense layer moves exactly
// that many slots.
TEST(LiveRanks, ExpertsThatLivedOnlyOnLostRanksGetALiveSlot) {
  const Layout layout = make_layout(16, 24, 4, 1, 1);
  std::mt19937_64 rng(5);
  const LoadMatrix load = lognormal_load(3, 16, rng);
  // The trivial placement: rank 1 holds experts 6-11 (slots 6-11); slots 16-23 repeat experts
  // 0-7, so experts 8-11 lived on rank 1 alone.
  const Placement previous = trivial_placement(3, 16, 24);
  const std::vector<int32_t> live = {0, 2, 3};
  for (const Config& config : kConfigs) {
    SCOPED_TRACE(describe(config));
    PolicyOptions options{.policy = config.policy, .hierarchical = config.hierarchical,
                          .previous = &previous};
    options.live_ranks = live;
    const Placement out = place(load, layout, options);
    expect_on_live_ranks(out, layout, live, &previous);
    if (config.policy == Policy::kDeepseek) continue;  // deepseek keeps no previous slot
    // The dense layer: experts 8-11 (slots 8-11 only) take four live slots, nothing else moves.
    const auto dense = out.layer_phy2log(2);
    const auto old = previous.layer_phy2log(2);
    int64_t moved = 0;
    for (int64_t p = 0; p < 24; ++p) moved += dense[p] != old[p];
    EXPECT_EQ(moved, 4);
  }
}

// sticky itself takes a previous placement that lacks experts (what place() hands it on live
// ranks) and gives each one a slot.
TEST(LiveRanks, StickyTakesAPreviousPlacementThatLacksExperts) {
  const Layout layout = make_layout(8, 12, 4, 1, 1);
  Placement previous(1, 8, 12);
  const int32_t phy2log[] = {0, 1, 2, /**/ 3, 4, 5, /**/ 0, 1, 2, /**/ 3, 4, 0};  // no 6, 7
  std::copy(std::begin(phy2log), std::end(phy2log), previous.phy2log.begin());
  previous.derive_from_phy2log();
  EXPECT_THROW(previous.validate(), InvalidArgument);
  LoadMatrix load(1, 8);
  load.values = {500, 80, 60, 300, 20, 10, 900, 40};
  const Placement out = sticky(load, layout, previous, 0.01, false);
  ASSERT_NO_THROW(out.validate());
  // Through place() too, with every rank live: the same placement, each expert given a slot.
  const PolicyOptions options{.policy = Policy::kSticky, .tolerance = 0.01,
                              .previous = &previous};
  const Placement placed = place(load, layout, options);
  EXPECT_EQ(placed.phy2log, out.phy2log);
  for (int32_t e = 0; e < 8; ++e) EXPECT_GE(placed.replica_count[e], 1) << "expert " << e;
  Placement broken = previous;
  broken.phy2log[5] = 8;
  EXPECT_THROW(sticky(load, layout, broken, 0.01, false), InvalidArgument);
  PolicyOptions bad = options;
  bad.previous = &broken;
  try {
    place(load, layout, bad);
    ADD_FAILURE() << "place() took a previous slot holding expert 8 of 8";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("slot 5 of layer 0 holds expert 8, outside [0, 8)"),
              std::string::npos)
        << e.what();
  }
}

TEST(LiveRanks, EveryRankLiveIsTodaysPlacementBitForBit) {
  for (const Case& c : cases()) {
    for (const Config& config : kConfigs) {
      SCOPED_TRACE(c.name + ", " + describe(config));
      std::mt19937_64 rng(3);
      const LoadMatrix before = lognormal_load(3, c.layout.experts, rng);
      const Placement previous = place(before, c.layout, {.policy = Policy::kBalanced});
      const LoadMatrix load = drift(before, rng);
      PolicyOptions options{.policy = config.policy, .hierarchical = config.hierarchical,
                            .previous = &previous};
      const Placement today = place(load, c.layout, options);
      std::vector<int32_t> every(static_cast<size_t>(c.layout.ranks));
      std::iota(every.begin(), every.end(), 0);
      options.live_ranks = every;
      const Placement listed = place(load, c.layout, options);
      EXPECT_EQ(listed.max_replicas, today.max_replicas);
      EXPECT_EQ(listed.phy2log, today.phy2log);
      EXPECT_EQ(listed.replica_count, today.replica_count);
      EXPECT_EQ(listed.log2phy, today.log2phy);
    }
  }
}

// The drift scenario with ranks lost: sticky keeps most live slots (balanced, placing afresh,
// keeps few) and stays within the tolerance of balanced on the live ranks.
TEST(LiveRanks, StickyKeepsMostLiveSlots) {
  struct Scenario {
    std::string name;
    Layout layout;
    std::vector<int32_t> lost;
    Layout compact;  // the live ranks' layout
    bool hierarchical;
  };
  const Scenario scenarios[] = {
      {"8 ranks, rank 2 lost", make_layout(256, 296, 8, 1, 8), {2},
       make_layout(256, 259, 7, 1, 8), false},
      {"16 ranks, one rank of every node lost, hierarchical", make_layout(96, 192, 16, 4, 12),
       {3, 7, 11, 15}, make_layout(96, 144, 12, 4, 12), true},
  };
  for (const Scenario& sc : scenarios) {
    for (const uint64_t seed : {1u, 2u}) {
      SCOPED_TRACE(sc.name + ", seed " + std::to_string(seed));
      std::mt19937_64 rng(seed);
      const int64_t E = sc.layout.experts;
      const LoadMatrix before = lognormal_load(4, E, rng);
      PolicyOptions options{.policy = Policy::kBalanced, .hierarchical = sc.hierarchical};
      const Placement previous = place(before, sc.layout, options);
      const LoadMatrix load = drift(before, rng, 0.1);
      const std::vector<int32_t> live = all_but(sc.layout.ranks, sc.lost);
      options.previous = &previous;
      options.live_ranks = live;
      const Placement fresh = place(load, sc.layout, options);
      options.policy = Policy::kSticky;
      const Placement sticky = place(load, sc.layout, options);
      const Placement compact_best = balanced(load, sc.compact, sc.hierarchical);
      for (int64_t l = 0; l < load.layers; ++l) {
        const auto old = live_slots(previous.layer_phy2log(l), sc.layout, live);
        const auto kept = live_slots(sticky.layer_phy2log(l), sc.layout, live);
        const auto afresh = live_slots(fresh.layer_phy2log(l), sc.layout, live);
        int64_t same = 0, same_fresh = 0;
        for (size_t p = 0; p < old.size(); ++p) {
          same += kept[p] == old[p];
          same_fresh += afresh[p] == old[p];
        }
        const bool dense = l + 1 == load.layers;
        if (!dense) {
          EXPECT_GE(layer_balancedness(load.row(l), kept, sc.compact),
                    layer_balancedness(load.row(l), compact_best.layer_phy2log(l), sc.compact) -
                        0.01 - 1e-12)
              << "layer " << l;
        }
        // Each expert the lost ranks held alone takes a live slot; sticky moves few more (a
        // dense layer none), balanced places afresh. Hierarchical sticky has less room (each
        // group's experts stay on its node's ranks, which lost a quarter of their slots): it
        // moves more, as it does with every rank live, but still keeps far more than balanced.
        const int64_t missing =
            E - static_cast<int64_t>(std::set<int32_t>(old.begin(), old.end()).size());
        const auto live_count = static_cast<int64_t>(old.size());
        const int64_t least = dense              ? live_count - missing
                              : sc.hierarchical ? live_count * 2 / 5
                                                : live_count - missing - live_count / 16;
        EXPECT_GE(same, least) << "layer " << l << ": sticky kept " << same << " of "
                               << live_count << " live slots with " << missing
                               << " experts to restore; balanced kept " << same_fresh;
        if (!dense) {
          EXPECT_GT(same, 2 * same_fresh) << "layer " << l;
        }
      }
    }
  }
}

TEST(LiveRanks, TooFewLiveSlotsIsAClearError) {
  const Layout layout = make_layout(256, 264, 8, 1, 8);
  std::mt19937_64 rng(1);
  const LoadMatrix load = lognormal_load(2, 256, rng);
  for (const Config& config : kConfigs) {
    const Placement previous = trivial_placement(2, 256, 264);
    PolicyOptions options{.policy = config.policy, .previous = &previous};
    options.live_ranks = all_but(8, {5});
    try {
      place(load, layout, options);
      FAIL() << describe(config) << " placed 256 experts on 231 slots";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "the 7 live ranks hold 231 slots per layer, fewer than the 256 experts: every "
                    "expert needs a slot on a live rank"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(LiveRanks, RejectsLiveRanksOutOfOrderOrRange) {
  const Layout layout = make_layout(16, 24, 4, 1, 1);
  std::mt19937_64 rng(1);
  const LoadMatrix load = lognormal_load(1, 16, rng);
  for (const std::vector<int32_t>& bad :
       {std::vector<int32_t>{2, 1, 3}, std::vector<int32_t>{0, 0, 1}, std::vector<int32_t>{0, 1, 4},
        std::vector<int32_t>{-1, 0, 1}, std::vector<int32_t>{0, 1, 2, 3, 3}}) {
    PolicyOptions options;
    options.live_ranks = bad;
    EXPECT_THROW(place(load, layout, options), InvalidArgument);
  }
}

}  // namespace
}  // namespace eplb::placement
