// The planner in elastic serving: lost ranks (not members, their slots unusable), ranks that
// joined with empty weights (members, every slot unusable), and restores of experts no valid
// slot holds from host backups or the loader.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/migration/migration.h"
#include "eplb/migration/planner.h"
#include "unit/migration/plan_testing.h"

namespace eplb::migration {
namespace {

using testing::execute;
using testing::initial_memory;
using testing::placement_of;
using testing::Weights;
using testing::World;
using A = Action;

Layout layout_of(int64_t physical, int64_t ranks, int64_t nodes) {
  return {.experts = 1, .physical = physical, .ranks = ranks, .nodes = nodes};
}

std::vector<Action> actions_of(const LayerPlan& plan) {
  std::vector<Action> out;
  for (const SlotAction& a : plan.actions) out.push_back(a.action);
  return out;
}

// Plans one layer in `world`, executes it and checks that every member slot ends with its new
// expert and every slot of a rank that is gone is untouched.
LayerPlan plan_and_run(const std::vector<int32_t>& from, const std::vector<int32_t>& to,
                       const Layout& layout, const World& world, int64_t bytes = 1) {
  LayerPlan plan = plan_layer(from, to, layout, bytes, world.sources());
  std::vector<Weights> live = initial_memory(from, layout, 0, world);
  const std::vector<Weights> before = live;
  execute(plan, layout, 0, live, world);
  for (size_t p = 0; p < to.size(); ++p) {
    if (world.member(layout.rank_of_slot(static_cast<int64_t>(p)))) {
      EXPECT_EQ(live[p], (Weights{0, to[p]})) << "slot " << p;
    } else {
      EXPECT_EQ(live[p], before[p]) << "slot " << p << " of a rank that is gone";
    }
  }
  return plan;
}

std::string message_of(const std::vector<int32_t>& from, const std::vector<int32_t>& to,
                       const Layout& layout, const World& world) {
  try {
    plan_layer(from, to, layout, 1, world.sources());
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// 4 ranks of 2 slots on 2 nodes; rank 1 is lost with experts 2 and 3, which were only there.
// Rank 0 restores 2 from its own copy; rank 2 restores 3 from rank 3 (same node) although rank
// 0, on the other node, has a copy too. Rank 1's slots get no action whatever the placement says.
TEST(Elastic, LostRankRestoresFromOwnCopyThenSameNode) {
  const std::vector<int32_t> from{0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> to{0, 2, 1, 3, 4, 3, 6, 7};
  World world;
  world.members = {1, 0, 1, 1};
  world.usable = {1, 1, 0, 0, 1, 1, 1, 1};
  world.backup_holders = {{}, {}, {3, 0}, {0, 3}};
  const LayerPlan plan = plan_and_run(from, to, layout_of(8, 4, 2), world, 10);
  EXPECT_EQ(actions_of(plan),
            (std::vector<A>{A::kUnchanged, A::kRestore, A::kUnchanged, A::kUnchanged, A::kUnchanged,
                            A::kRestore, A::kUnchanged, A::kUnchanged}));
  EXPECT_EQ(plan.actions[1].src_rank, 0);
  EXPECT_EQ(plan.actions[1].src_slot, -1);
  EXPECT_EQ(plan.actions[5].src_rank, 3);
  ASSERT_EQ(plan.restores.size(), 2u);
  EXPECT_EQ(plan.restores[0], (Restore{.src_rank = 0, .dst_rank = 0, .dst_slot = 1, .expert = 2}));
  EXPECT_EQ(plan.restores[1], (Restore{.src_rank = 3, .dst_rank = 2, .dst_slot = 5, .expert = 3}));
  EXPECT_TRUE(plan.reads.empty());
  EXPECT_EQ(plan.count(A::kRestore), 2);
  EXPECT_EQ(plan.bytes_restored, 20);
  EXPECT_EQ(plan.bytes_restored_remote, 10);
  EXPECT_EQ(plan.bytes_total, 0);
  EXPECT_EQ(plan.rank_bytes_in, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(plan.rank_bytes_out, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(plan.staging_slots, 1);
}

// Expert 1 is valid on rank 0 (node 0) only; rank 3 (node 1) needs it. A read across nodes,
// unless rank 3 holds a host copy itself (the "own cost"); a copy on rank 2, same node but not
// its own, does not beat the read.
TEST(Elastic, OwnCopyBeatsAReadAcrossNodes) {
  const std::vector<int32_t> from{0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> to{0, 1, 2, 3, 4, 5, 6, 1};
  World world;
  world.backup_holders = {{}, {2}};
  LayerPlan plan = plan_and_run(from, to, layout_of(8, 4, 2), world);
  EXPECT_EQ(plan.actions[7].action, A::kReadOtherNode);
  EXPECT_EQ(plan.actions[7].src_slot, 1);
  EXPECT_TRUE(plan.restores.empty());

  world.backup_holders = {{}, {2, 3}};
  plan = plan_and_run(from, to, layout_of(8, 4, 2), world);
  EXPECT_EQ(plan.actions[7], (SlotAction{A::kRestore, 1, 3, -1}));
  EXPECT_TRUE(plan.reads.empty());
  EXPECT_EQ(plan.bytes_restored, 1);
  EXPECT_EQ(plan.bytes_restored_remote, 0);

  // A holder on the same node is read, own copy or not.
  world.backup_holders = {{}, {3}};
  plan = plan_and_run(from, to, layout_of(8, 4, 1), world);
  EXPECT_EQ(plan.actions[7].action, A::kReadSameNode);
}

// Restores from peers' copies spread like reads: the most constrained demand first. Rank 3's
// expert 1 can only come from rank 2, so rank 1's expert 0 (copies on ranks 2 and 3) comes
// from rank 3 although its slot is first.
TEST(Elastic, RestoresSpreadOverHolders) {
  const std::vector<int32_t> from{0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> to{0, 1, 0, 3, 4, 5, 1, 7};
  World world;
  world.members = {0, 1, 1, 1};
  world.backup_holders = {{2, 3}, {2}};
  const LayerPlan plan = plan_and_run(from, to, layout_of(8, 4, 1), world);
  ASSERT_EQ(plan.restores.size(), 2u);
  EXPECT_EQ(plan.restores[0].dst_slot, 2);
  EXPECT_EQ(plan.restores[0].src_rank, 3);
  EXPECT_EQ(plan.restores[1].dst_slot, 6);
  EXPECT_EQ(plan.restores[1].src_rank, 2);
  EXPECT_EQ(plan.bytes_restored_remote, 2);

  // Five ranks restore expert 0 from copies on ranks 4 and 5: 4, 5, 4 (ties to the lowest).
  const std::vector<int32_t> six{0, 1, 2, 3, 4, 5};
  World lost_zero;
  lost_zero.members = {0, 1, 1, 1, 1, 1};
  lost_zero.backup_holders = {{5, 4}};
  const LayerPlan spread = plan_and_run(six, {0, 0, 0, 0, 4, 5}, layout_of(6, 6, 1), lost_zero);
  ASSERT_EQ(spread.restores.size(), 3u);
  EXPECT_EQ(spread.restores[0].src_rank, 4);
  EXPECT_EQ(spread.restores[1].src_rank, 5);
  EXPECT_EQ(spread.restores[2].src_rank, 4);
}

// Without a copy on a member, the loader (src_rank -1); without a loader, an error. A copy on
// the lost rank itself is no source.
TEST(Elastic, LoaderFallbackAndTheErrorWithoutIt) {
  const std::vector<int32_t> from{0, 1};
  const std::vector<int32_t> to{1, 0};
  World world;
  world.members = {1, 0};
  world.backup_holders = {{}, {1}};
  const std::string message = message_of(from, to, layout_of(2, 2, 1), world);
  EXPECT_EQ(message,
            "expert 1 has no replica on a live rank and no backup (register a host backup or "
            "a loader)");

  world.loader = true;
  const LayerPlan plan = plan_and_run(from, to, layout_of(2, 2, 1), world, 3);
  EXPECT_EQ(plan.actions[0], (SlotAction{A::kRestore, 1, -1, -1}));
  EXPECT_EQ(plan.actions[1].action, A::kUnchanged);
  ASSERT_EQ(plan.restores.size(), 1u);
  EXPECT_EQ(plan.restores[0], (Restore{.src_rank = -1, .dst_rank = 0, .dst_slot = 0, .expert = 1}));
  EXPECT_EQ(plan.bytes_restored, 3);
  EXPECT_EQ(plan.bytes_restored_remote, 0);

  // Through plan_migration the message names the layer.
  const Placement before = placement_of({{0, 1}, {0, 1}}, 2);
  const Placement after = placement_of({{0, 1}, {1, 0}}, 2);
  MigrationOptions options;
  options.expert_bytes = 1;
  options.members = {1, 0};
  try {
    plan_migration(before, after, layout_of(2, 2, 1), options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "layer 1: expert 1 has no replica on a live rank and no backup (register a host "
              "backup or a loader)");
  }
  options.loader = true;
  const MigrationPlan loaded = plan_migration(before, after, layout_of(2, 2, 1), options);
  EXPECT_EQ(loaded.totals.count(A::kRestore), 1);
  EXPECT_EQ(loaded.totals.bytes_restored, 1);
  EXPECT_EQ(loaded.layers[1].plan.restores.size(), 1u);
  EXPECT_EQ(loaded.layers[1].schedule.rounds, 0);
}

// With nothing lost, an expert the old placement never had is restored when a copy or the
// loader provides it, and otherwise named as absent from the old placement.
TEST(Elastic, ExpertNewToThePlacement) {
  const std::vector<int32_t> from{0, 0, 1, 1};
  const std::vector<int32_t> to{0, 2, 1, 1};
  World world;
  EXPECT_EQ(message_of(from, to, layout_of(4, 2, 1), world),
            "expert 2 (new slot 1) is in no slot of the old placement: there is nothing to read "
            "it from");
  world.backup_holders = {{}, {}, {1}};
  const LayerPlan plan = plan_and_run(from, to, layout_of(4, 2, 1), world);
  EXPECT_EQ(plan.actions[1], (SlotAction{A::kRestore, 2, 1, -1}));
  EXPECT_EQ(plan.bytes_restored_remote, 1);
}

// An unusable slot of a member whose expert stays the same is filled, never left unchanged:
// from a valid slot of its rank, by a read, or by a restore (a rank that joined empty).
TEST(Elastic, UnusableSlotWithTheSameExpertIsFilled) {
  World world;
  world.usable = {1, 1, 0, 1};
  LayerPlan plan = plan_and_run({0, 1, 2, 2}, {0, 1, 2, 2}, layout_of(4, 2, 1), world);
  EXPECT_EQ(plan.actions[2], (SlotAction{A::kLocalCopy, 2, 1, 3}));
  EXPECT_EQ(plan.actions[3].action, A::kUnchanged);

  plan = plan_and_run({0, 2, 2, 3}, {0, 2, 2, 3}, layout_of(4, 2, 1), world);
  EXPECT_EQ(plan.actions[2], (SlotAction{A::kReadSameNode, 2, 0, 1}));
  EXPECT_EQ(plan.actions[3].action, A::kUnchanged);

  // Rank 1 joined with empty weights: expert 2 from rank 0's copy, expert 3 from the loader.
  world.usable = {1, 1, 0, 0};
  world.backup_holders = {{}, {}, {0}, {}};
  world.loader = true;
  plan = plan_and_run({0, 1, 2, 3}, {0, 1, 2, 3}, layout_of(4, 2, 1), world);
  EXPECT_EQ(actions_of(plan),
            (std::vector<A>{A::kUnchanged, A::kUnchanged, A::kRestore, A::kRestore}));
  EXPECT_EQ(plan.actions[2].src_rank, 0);
  EXPECT_EQ(plan.actions[3].src_rank, -1);
  EXPECT_EQ(plan.bytes_restored_remote, 1);
}

// Two slots of a rank that need the same restored expert: one restore, one free ride.
TEST(Elastic, FreeRidesOffRestoredSlots) {
  World world;
  world.members = {1, 0};
  world.backup_holders = {{}, {}, {}, {}, {0}};
  world.loader = true;
  const LayerPlan plan =
      plan_and_run({0, 1, 2, 3, 4, 5, 6, 7}, {4, 4, 5, 5, 0, 1, 2, 3}, layout_of(8, 2, 1), world);
  EXPECT_EQ(actions_of(plan),
            (std::vector<A>{A::kRestore, A::kFreeRide, A::kRestore, A::kFreeRide, A::kUnchanged,
                            A::kUnchanged, A::kUnchanged, A::kUnchanged}));
  EXPECT_EQ(plan.actions[0].src_rank, 0);
  EXPECT_EQ(plan.actions[1].src_slot, 0);
  EXPECT_EQ(plan.actions[2].src_rank, -1);
  EXPECT_EQ(plan.actions[3].src_slot, 2);
  EXPECT_EQ(plan.restores.size(), 2u);
  EXPECT_EQ(plan.bytes_local_copy, 2);
  EXPECT_EQ(plan.staging_slots, 2);
}

TEST(Elastic, SourcesOfTheWrongShapeAreNamed) {
  World world;
  world.usable = {1, 1, 1};
  EXPECT_NE(message_of({0, 1}, {1, 0}, layout_of(2, 2, 1), world).find("usable has 3 slots"),
            std::string::npos);
  world.usable.clear();
  world.members = {1};
  EXPECT_NE(message_of({0, 1}, {1, 0}, layout_of(2, 2, 1), world).find("members has 1 ranks"),
            std::string::npos);
  world.members.clear();
  world.backup_holders = {{0, 2}};
  EXPECT_NE(message_of({0, 1}, {1, 0}, layout_of(2, 2, 1), world)
                .find("backup holders of expert 0: rank 2 is outside ranks [0, 2)"),
            std::string::npos);

  const Placement one = placement_of({{0, 1}}, 2);
  const auto migration_message = [&](const MigrationOptions& options) -> std::string {
    try {
      plan_migration(one, one, layout_of(2, 2, 1), options);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  MigrationOptions options;
  options.expert_bytes = 1;
  options.usable = {1, 1, 1, 1};
  EXPECT_NE(migration_message(options).find("usable has 4 entries, expected layers x physical"),
            std::string::npos);
  options.usable.clear();
  options.members = {1, 1, 1};
  EXPECT_NE(migration_message(options).find("members has 3 entries, expected ranks 2"),
            std::string::npos);
  options.members.clear();
  options.backup_holders = {{-1}, {}};
  EXPECT_NE(migration_message(options).find("backup holders of expert 0: rank -1"),
            std::string::npos);
  options.backup_holders = {{0}};
  EXPECT_NE(migration_message(options).find("backup holders has 1 entries, the new placement "
                                            "has 2 experts"),
            std::string::npos);
}

// The action planner.h's rules give slot p of `to`, from the world alone (a second, naive
// reading of the rules, slot by slot): the action, and the candidate source ranks of a restore.
struct Expected {
  Action action = Action::kUnchanged;
  std::vector<int32_t> restore_from;  // kRestore: the ranks src_rank may be ({-1}: the loader)
};

Expected expected_action(const std::vector<int32_t>& from, const std::vector<int32_t>& to,
                         const Layout& layout, const World& world, const LayerPlan& plan,
                         int64_t p) {
  const int64_t per_rank = layout.slots_per_rank();
  const int64_t g = layout.rank_of_slot(p);
  const int32_t e = to[p];
  const auto valid = [&](int64_t q) {
    return world.member(layout.rank_of_slot(q)) && world.usable_slot(q);
  };
  if (!world.member(g) || (valid(p) && from[p] == e)) return {};
  for (int64_t q = g * per_rank; q < (g + 1) * per_rank; ++q) {
    if (valid(q) && from[q] == e) return {Action::kLocalCopy, {}};
  }
  for (int64_t q = g * per_rank; q < p; ++q) {
    const Action a = plan.actions[q].action;
    if (to[q] == e && (is_remote(a) || a == Action::kRestore)) return {Action::kFreeRide, {}};
  }
  bool held = false, held_same_node = false;
  for (int64_t q = 0; q < layout.physical; ++q) {
    if (!valid(q) || from[q] != e) continue;
    held = true;
    held_same_node = held_same_node || layout.node_of_slot(q) == layout.node_of_rank(g);
  }
  const bool own = world.holds_backup(g, e);
  if (held_same_node) return {Action::kReadSameNode, {}};
  if (held && !own) return {Action::kReadOtherNode, {}};
  if (own) return {Action::kRestore, {static_cast<int32_t>(g)}};
  std::vector<int32_t> same_node, all;
  for (int32_t r = 0; r < layout.ranks; ++r) {
    if (!world.member(r) || !world.holds_backup(r, e)) continue;
    all.push_back(r);
    if (layout.node_of_rank(r) == layout.node_of_rank(g)) same_node.push_back(r);
  }
  if (!same_node.empty()) return {Action::kRestore, same_node};
  if (!all.empty()) return {Action::kRestore, all};
  return {Action::kRestore, {-1}};
}

// The first (layer, expert) that a member slot needs and nothing provides, in planning order;
// -1 when every slot can be filled.
std::pair<int32_t, int32_t> first_unprovided(const std::vector<std::vector<int32_t>>& from,
                                             const std::vector<std::vector<int32_t>>& to,
                                             const Layout& layout,
                                             const std::vector<World>& worlds) {
  for (size_t l = 0; l < from.size(); ++l) {
    const World& w = worlds[l];
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (!w.member(layout.rank_of_slot(p))) continue;
      const int32_t e = to[l][p];
      bool provided = w.loader;
      for (int32_t r = 0; r < layout.ranks; ++r)
        provided = provided || (w.member(r) && w.holds_backup(r, e));
      for (int64_t q = 0; q < layout.physical; ++q) {
        provided =
            provided || (w.member(layout.rank_of_slot(q)) && w.usable_slot(q) && from[l][q] == e);
      }
      if (!provided) return {static_cast<int32_t>(l), e};
    }
  }
  return {-1, -1};
}

// Random worlds: lost ranks, ranks that joined empty, scattered unusable slots, backup copies
// on random ranks (lost ones included, which must be ignored), a loader or not. Executing a plan
// fills every member slot with its new expert; no source is ever an unusable slot or a rank
// that is gone; each slot's action follows the rules; the plan is deterministic.
TEST(Elastic, RandomWorldsEndWithTheRightExperts) {
  int64_t planned = 0, refused = 0, restored = 0;
  for (uint32_t seed = 0; seed < 500; ++seed) {
    std::mt19937 rng(seed);
    const Layout layout = testing::random_layout(rng, 24, 6, false);
    const int64_t per_rank = layout.slots_per_rank();
    const auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
    std::vector<uint8_t> members(layout.ranks, 1), joined(layout.ranks, 0);
    for (int64_t g = 0; g < layout.ranks; ++g) {
      members[g] = chance(75) ? 1 : 0;
      joined[g] = members[g] && chance(15);
    }
    std::vector<std::vector<int32_t>> backups(layout.experts);
    for (auto& holders : backups) {
      if (!chance(50)) continue;
      for (int i = 1 + static_cast<int>(rng() % 3); i > 0; --i) {
        holders.push_back(static_cast<int32_t>(rng() % layout.ranks));
      }
    }
    const bool loader = seed % 3 == 0;
    const int layers = 2;
    std::vector<std::vector<int32_t>> from, to;
    std::vector<uint8_t> usable;
    std::vector<World> worlds;
    for (int l = 0; l < layers; ++l) {
      from.push_back(testing::random_phy2log(rng, layout.experts, layout.physical));
      to.push_back(seed % 4 == 0   ? from.back()
                   : seed % 4 == 1 ? testing::perturb(rng, from.back(), layout.experts)
                                   : testing::random_phy2log(rng, layout.experts, layout.physical));
      World w{.usable = {}, .members = members, .backup_holders = backups, .loader = loader};
      for (int64_t p = 0; p < layout.physical; ++p) {
        const int64_t g = p / per_rank;
        // A lost rank's entries are noise: it is never a source whatever they say.
        w.usable.push_back(members[g] ? (joined[g] || chance(10) ? 0 : 1 + rng() % 255)
                                      : rng() % 2);
      }
      usable.insert(usable.end(), w.usable.begin(), w.usable.end());
      worlds.push_back(std::move(w));
    }
    const int64_t bytes = std::uniform_int_distribution<int64_t>(1, 1 << 20)(rng);
    MigrationOptions options;
    options.expert_bytes = bytes;
    options.schedule.peers_per_round = 1 + static_cast<int64_t>(rng() % 3);
    options.usable = usable;
    options.members = members;
    options.backup_holders = backups;
    options.loader = loader;
    const std::string label = "seed " + std::to_string(seed) + " " + layout.describe();
    SCOPED_TRACE(label);
    const Placement before = placement_of(from, layout.experts);
    const Placement after = placement_of(to, layout.experts);

    const auto [bad_layer, bad_expert] = first_unprovided(from, to, layout, worlds);
    if (bad_layer >= 0) {
      ++refused;
      try {
        plan_migration(before, after, layout, options);
        ADD_FAILURE() << "no error, but layer " << bad_layer << " expert " << bad_expert
                      << " has no source";
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(std::string(e.what()),
                  "layer " + std::to_string(bad_layer) + ": expert " + std::to_string(bad_expert) +
                      " has no replica on a live rank and no backup (register a host backup "
                      "or a loader)");
      }
      continue;
    }
    ++planned;
    const MigrationPlan plan = plan_migration(before, after, layout, options);
    const MigrationPlan again = plan_migration(before, after, layout, options);
    int64_t restores = 0, bytes_restored = 0;
    for (int l = 0; l < layers; ++l) {
      const LayerPlan& lp = plan.layers[l].plan;
      ASSERT_EQ(lp, again.layers[l].plan) << "layer " << l << " differs between two runs";
      ASSERT_EQ(plan.layers[l].schedule.round_of_read, again.layers[l].schedule.round_of_read);
      std::vector<Weights> live = initial_memory(from[l], layout, l, worlds[l]);
      const std::vector<Weights> initial = live;
      execute(lp, layout, l, live, worlds[l]);
      if (::testing::Test::HasFatalFailure()) return;
      std::vector<Restore> listed;
      for (int64_t p = 0; p < layout.physical; ++p) {
        const int64_t g = layout.rank_of_slot(p);
        if (worlds[l].member(g)) {
          ASSERT_EQ(live[p], (Weights{l, to[l][p]})) << "layer " << l << " slot " << p;
        } else {
          ASSERT_EQ(live[p], initial[p]) << "layer " << l << " slot " << p;
        }
        const SlotAction& a = lp.actions[p];
        ASSERT_EQ(a.expert, to[l][p]);
        const Expected expected = expected_action(from[l], to[l], layout, worlds[l], lp, p);
        ASSERT_EQ(a.action, expected.action) << "layer " << l << " slot " << p;
        if (a.action != Action::kRestore) continue;
        ASSERT_NE(std::find(expected.restore_from.begin(), expected.restore_from.end(), a.src_rank),
                  expected.restore_from.end())
            << "layer " << l << " slot " << p << " restores from rank " << a.src_rank;
        listed.push_back({a.src_rank, static_cast<int32_t>(g), static_cast<int32_t>(p), a.expert});
      }
      ASSERT_EQ(lp.restores, listed);
      int64_t remote = 0;
      for (const Restore& r : lp.restores) remote += r.src_rank >= 0 && r.src_rank != r.dst_rank;
      ASSERT_EQ(lp.bytes_restored, static_cast<int64_t>(listed.size()) * bytes);
      ASSERT_EQ(lp.bytes_restored_remote, remote * bytes);
      ASSERT_EQ(lp.count(Action::kRestore), static_cast<int64_t>(listed.size()));
      for (const RemoteRead& r : lp.reads) {
        ASSERT_TRUE(worlds[l].member(r.src_rank) && worlds[l].usable_slot(r.src_slot));
      }
      ASSERT_EQ(plan.layers[l].schedule.round_of_read.size(), lp.reads.size());
      restores += static_cast<int64_t>(listed.size());
      bytes_restored += lp.bytes_restored;
    }
    EXPECT_EQ(plan.totals.count(Action::kRestore), restores);
    EXPECT_EQ(plan.totals.bytes_restored, bytes_restored);
    restored += restores;
  }
  // Both outcomes, and restores, were exercised.
  EXPECT_GT(planned, 100);
  EXPECT_GT(refused, 50);
  EXPECT_GT(restored, 200);
}

// With every slot valid and every rank a member (all-nonzero vectors, a loader that nothing
// needs), plans are exactly those of a plain rebalance, layer by layer and in total.
TEST(Elastic, EveryoneLiveGivesThePlainPlan) {
  for (uint32_t seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed);
    const Layout layout = testing::random_layout(rng, 48, 8, seed % 4 == 0);
    std::vector<std::vector<int32_t>> from, to;
    for (int l = 0; l < 3; ++l) {
      from.push_back(testing::random_phy2log(rng, layout.experts, layout.physical));
      to.push_back(seed % 2 ? testing::perturb(rng, from.back(), layout.experts)
                            : testing::random_phy2log(rng, layout.experts, layout.physical));
    }
    const Placement before = placement_of(from, layout.experts);
    const Placement after = placement_of(to, layout.experts);
    MigrationOptions plain;
    plain.expert_bytes = std::uniform_int_distribution<int64_t>(1, 1 << 20)(rng);
    plain.schedule.peers_per_round = 1 + static_cast<int64_t>(rng() % 3);
    plain.schedule.half_duplex = seed % 5 == 0;
    MigrationOptions live = plain;
    for (int64_t i = 0; i < 3 * layout.physical; ++i) live.usable.push_back(1 + rng() % 255);
    for (int64_t g = 0; g < layout.ranks; ++g) live.members.push_back(1 + rng() % 255);
    live.loader = true;
    const MigrationPlan a = plan_migration(before, after, layout, plain);
    const MigrationPlan b = plan_migration(before, after, layout, live);
    SCOPED_TRACE("seed " + std::to_string(seed) + " " + layout.describe());
    for (int l = 0; l < 3; ++l) {
      ASSERT_EQ(a.layers[l].plan, b.layers[l].plan) << "layer " << l;
      ASSERT_TRUE(a.layers[l].plan.restores.empty());
      ASSERT_EQ(a.layers[l].plan, plan_layer(from[l], to[l], layout, plain.expert_bytes, {},
                                             source_choice(plain.schedule)));
      ASSERT_EQ(a.layers[l].schedule.round_of_read, b.layers[l].schedule.round_of_read);
      ASSERT_EQ(a.layers[l].schedule.rounds, b.layers[l].schedule.rounds);
    }
    ASSERT_EQ(a.totals.slots, b.totals.slots);
    ASSERT_EQ(a.totals.bytes_total, b.totals.bytes_total);
    ASSERT_EQ(a.totals.bytes_restored, 0);
    ASSERT_EQ(a.totals.max_rank_bytes_in, b.totals.max_rank_bytes_in);
    ASSERT_EQ(a.totals.max_rank_bytes_out, b.totals.max_rank_bytes_out);
    ASSERT_EQ(a.totals.rounds, b.totals.rounds);
  }
}

}  // namespace
}  // namespace eplb::migration
