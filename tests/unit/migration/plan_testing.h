#pragma once
// What the migration tests share: a simulator that executes a layer plan on simulated memory
// (the order planner.h documents, which the runtime follows), and random placements.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/migration/planner.h"

namespace eplb::migration::testing {

// What a slot of the simulated memory holds: an expert's weights of one layer. {-1, -1}: no
// valid weights (a slot of a lost rank, or of a rank that joined empty).
struct Weights {
  int32_t layer = -1;
  int32_t expert = -1;
  bool operator==(const Weights&) const = default;
};

// The simulated world beyond the slots (planner.h's PlanSources for one layer), owned.
struct World {
  std::vector<uint8_t> usable;                       // [physical]; empty: all valid
  std::vector<uint8_t> members;                      // [ranks]; empty: all
  std::vector<std::vector<int32_t>> backup_holders;  // [experts] ranks with a host copy
  bool loader = false;

  bool member(int64_t rank) const { return members.empty() || members[rank] != 0; }
  bool usable_slot(int64_t slot) const { return usable.empty() || usable[slot] != 0; }
  bool holds_backup(int64_t rank, int32_t expert) const {
    if (static_cast<size_t>(expert) >= backup_holders.size()) return false;
    const std::vector<int32_t>& h = backup_holders[expert];
    return std::find(h.begin(), h.end(), rank) != h.end();
  }
  PlanSources sources() const { return {usable, members, backup_holders, loader}; }
};

// The memory of one layer before the plan runs: every valid slot of a member holds its old
// expert, every other slot garbage, so that reading one shows in the result.
inline std::vector<Weights> initial_memory(const std::vector<int32_t>& from, const Layout& layout,
                                           int32_t layer, const World& world) {
  std::vector<Weights> live(from.size());
  for (size_t p = 0; p < from.size(); ++p) {
    if (world.member(layout.rank_of_slot(static_cast<int64_t>(p))) &&
        world.usable_slot(static_cast<int64_t>(p))) {
      live[p] = {layer, from[p]};
    }
  }
  return live;
}

// Executes one layer's plan: 1. every member rank stages its restores (from a host backup,
// the expert's weights of `layer`, or the loader), reads and local copies (from OLD live
// content, only valid slots of members); 2. each rank installs its staging; 3. each rank copies
// its free rides in slot order. A rank may only touch its own slots and its own staging; a rank
// that is not a member touches nothing.
inline void execute(const LayerPlan& plan, const Layout& layout, int32_t layer,
                    std::vector<Weights>& live, const World& world = {}) {
  const int64_t per_rank = layout.slots_per_rank();
  std::vector<std::vector<std::pair<int64_t, Weights>>> staging(layout.ranks);
  // Phase 1: no live slot changes on any rank.
  const std::vector<Weights> before = live;
  for (int64_t g = 0; g < layout.ranks; ++g) {
    for (int64_t p = g * per_rank; p < (g + 1) * per_rank; ++p) {
      const SlotAction& a = plan.actions[p];
      if (!world.member(g)) {
        ASSERT_EQ(a.action, Action::kUnchanged) << "slot " << p << " of a rank that is gone";
        continue;
      }
      if (a.action == Action::kUnchanged) {
        ASSERT_EQ(a.src_slot, p);
        ASSERT_TRUE(world.usable_slot(p)) << "unusable slot " << p << " left unchanged";
      }
      if (!is_staged(a.action)) continue;
      if (a.action == Action::kRestore) {
        ASSERT_EQ(a.src_slot, -1) << "slot " << p;
        if (a.src_rank < 0) {
          ASSERT_TRUE(world.loader) << "slot " << p << " restored by a loader there is not";
        } else {
          ASSERT_TRUE(world.member(a.src_rank))
              << "slot " << p << " restored from lost rank " << a.src_rank;
          ASSERT_TRUE(world.holds_backup(a.src_rank, a.expert))
              << "slot " << p << " restored from rank " << a.src_rank << ", which has no copy";
        }
        staging[g].emplace_back(p, Weights{layer, a.expert});
        continue;
      }
      ASSERT_EQ(layout.rank_of_slot(a.src_slot), a.src_rank) << "slot " << p;
      ASSERT_TRUE(world.member(a.src_rank)) << "slot " << p << " reads lost rank " << a.src_rank;
      ASSERT_TRUE(world.usable_slot(a.src_slot))
          << "slot " << p << " reads unusable slot " << a.src_slot;
      if (a.action == Action::kLocalCopy) {
        ASSERT_EQ(a.src_rank, g) << "slot " << p;
      }
      if (is_remote(a.action)) {
        ASSERT_NE(a.src_rank, g) << "slot " << p;
      }
      staging[g].emplace_back(p, live[a.src_slot]);
    }
    ASSERT_LE(static_cast<int64_t>(staging[g].size()), plan.staging_slots);
  }
  ASSERT_EQ(live, before);
  // Phases 2 and 3, rank by rank (after the agreement every rank installs independently).
  for (int64_t g = layout.ranks - 1; g >= 0; --g) {
    for (const auto& [slot, weights] : staging[g]) live[slot] = weights;
    for (int64_t p = g * per_rank; p < (g + 1) * per_rank; ++p) {
      const SlotAction& a = plan.actions[p];
      if (a.action != Action::kFreeRide) continue;
      ASSERT_EQ(a.src_rank, g);
      ASSERT_GE(a.src_slot, g * per_rank);
      ASSERT_LT(a.src_slot, p);
      const Action source = plan.actions[a.src_slot].action;
      ASSERT_TRUE(is_remote(source) || source == Action::kRestore) << "free ride on slot " << p;
      live[p] = live[a.src_slot];
    }
  }
}

// A random placement of `experts` experts over `physical` slots: every expert at least once,
// the redundant slots drawn at random (duplicates), then shuffled.
inline std::vector<int32_t> random_phy2log(std::mt19937& rng, int64_t experts, int64_t physical) {
  std::vector<int32_t> slots(physical);
  std::iota(slots.begin(), slots.begin() + experts, 0);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(experts - 1));
  for (int64_t p = experts; p < physical; ++p) slots[p] = pick(rng);
  std::shuffle(slots.begin(), slots.end(), rng);
  return slots;
}

// `old` with a few slots changed, keeping every expert present (what a sticky policy makes).
inline std::vector<int32_t> perturb(std::mt19937& rng, std::vector<int32_t> phy2log,
                                    int64_t experts) {
  std::uniform_int_distribution<size_t> slot(0, phy2log.size() - 1);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(experts - 1));
  const size_t changes = phy2log.size() / 4 + 1;
  for (size_t i = 0; i < changes; ++i) {
    if (i % 2 == 0) {
      std::swap(phy2log[slot(rng)], phy2log[slot(rng)]);
    } else {
      const size_t s = slot(rng);
      const int32_t previous = phy2log[s];
      phy2log[s] = pick(rng);
      if (std::count(phy2log.begin(), phy2log.end(), previous) == 0) phy2log[s] = previous;
    }
  }
  return phy2log;
}

inline Placement placement_of(const std::vector<std::vector<int32_t>>& layers, int64_t experts) {
  Placement p(static_cast<int64_t>(layers.size()), experts,
              static_cast<int64_t>(layers.front().size()));
  for (size_t l = 0; l < layers.size(); ++l) {
    std::copy(layers[l].begin(), layers[l].end(), p.phy2log.begin() + l * p.physical);
  }
  p.derive_from_phy2log();
  return p;
}

// A random layout: 1 to max_ranks ranks of 1 to max_per_rank slots, on a divisor of the ranks
// (at most 8) as nodes, with 1 to physical experts (all of them when `permutation`).
inline Layout random_layout(std::mt19937& rng, int64_t max_ranks, int64_t max_per_rank,
                            bool permutation) {
  const int64_t ranks = std::uniform_int_distribution<int64_t>(1, max_ranks)(rng);
  std::vector<int64_t> node_counts;
  for (int64_t n = 1; n <= 8; ++n) {
    if (ranks % n == 0) node_counts.push_back(n);
  }
  const int64_t nodes = node_counts[rng() % node_counts.size()];
  const int64_t per_rank = std::uniform_int_distribution<int64_t>(1, max_per_rank)(rng);
  const int64_t physical = ranks * per_rank;
  const int64_t experts =
      permutation ? physical : std::uniform_int_distribution<int64_t>(1, physical)(rng);
  return {.experts = experts, .physical = physical, .ranks = ranks, .nodes = nodes};
}

}  // namespace eplb::migration::testing
