// The elastic group state on its own: members and usable slots adopted from a reconfigure, the
// install bookkeeping, repairs owed and failed, what a plan is given, and whose window failed.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "runtime/group_state.h"
#include "runtime/weight_store.h"

namespace eplb::runtime {
namespace {

const Layout kLayout{.experts = 4, .physical = 8, .ranks = 4, .nodes = 1};
constexpr int64_t kLayers = 2;

TEST(GroupState, StartsWithEverySeatAndEverySlotOrNoneWhenJoining) {
  const GroupState served(kLayout, kLayers, false);
  EXPECT_EQ(served.members(), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(served.all_members());
  EXPECT_TRUE(served.all_usable());
  EXPECT_EQ(served.lost_slots(), 0);
  EXPECT_FALSE(served.repair_pending());
  EXPECT_EQ(served.installed_total(), 0);

  const GroupState joining(kLayout, kLayers, true);
  EXPECT_TRUE(joining.all_members());
  EXPECT_FALSE(joining.all_usable());
  EXPECT_EQ(joining.lost_slots(), kLayers * kLayout.physical);
  EXPECT_EQ(joining.usable_row(1).size(), static_cast<size_t>(kLayout.physical));
}

TEST(GroupState, AnInstalledLayerFillsEveryMemberSlotOfItAndNoOther) {
  GroupState g(kLayout, kLayers, false);
  std::vector<uint8_t> usable(static_cast<size_t>(kLayers * kLayout.physical), 1);
  for (int64_t p = 4; p < 6; ++p) usable[p] = usable[kLayout.physical + p] = 0;  // seat 2 lost
  g.adopt({0, 1, 3}, usable, true);
  EXPECT_FALSE(g.all_members());
  EXPECT_EQ(g.lost_slots(), 4);
  EXPECT_TRUE(g.repair_due());

  g.mark_installed(1, [](int seat) { return seat != 2; });
  EXPECT_EQ(g.installed_total(), 1);
  const std::span<const uint8_t> row = g.usable_row(1);
  for (int64_t p = 0; p < kLayout.physical; ++p) EXPECT_EQ(row[p], p / 2 != 2) << p;
  EXPECT_EQ(g.lost_slots(), 4);  // layer 0 untouched; layer 1's lost seat still holds nothing
  EXPECT_EQ(g.usable_row(0)[4], 0);
}

TEST(GroupState, ARepairIsOwedUntilOneCompletesAndWaitsForAnIntervalAfterAFailure) {
  GroupState g(kLayout, kLayers, false);
  g.adopt({0, 1, 2, 3}, std::vector<uint8_t>(kLayers * kLayout.physical, 1), true);
  EXPECT_TRUE(g.repair_due());
  g.repair_ended(Outcome::kCancelled);  // shutdown or reconfigure: still owed, still due
  EXPECT_TRUE(g.repair_due());
  g.repair_ended(Outcome::kFailed);
  EXPECT_TRUE(g.repair_pending());
  EXPECT_FALSE(g.repair_due());
  g.repair_ended(Outcome::kSkipped);  // a retry at an interval found nothing to do
  EXPECT_FALSE(g.repair_pending());

  // A new group clears the failure's mark.
  g.adopt({0, 1, 2, 3}, std::vector<uint8_t>(kLayers * kLayout.physical, 1), true);
  g.repair_ended(Outcome::kFailed);
  g.adopt({0, 1, 2, 3}, std::vector<uint8_t>(kLayers * kLayout.physical, 1), true);
  EXPECT_TRUE(g.repair_due());
  g.repair_ended(Outcome::kCompleted);
  EXPECT_FALSE(g.repair_pending());
}

TEST(GroupState, AdoptRefusesMembersOutOfOrderAndUsableOfAnotherShape) {
  GroupState g(kLayout, kLayers, false);
  EXPECT_THROW(g.adopt({1, 0}, std::vector<uint8_t>(kLayers * kLayout.physical, 1), false),
               InvalidArgument);
  EXPECT_THROW(g.adopt({0, 1}, std::vector<uint8_t>(3, 1), false), InvalidArgument);
  EXPECT_EQ(g.members().size(), 4u);  // nothing changed
}

TEST(GroupState, APlanIsToldOfTheGroupOnlyWhereASlotOrSeatIsLost) {
  Config config;
  config.layout = kLayout;
  WeightSpec spec;
  spec.layers = kLayers;
  spec.tensors = {{.name = "w", .expert_bytes = 8}};
  const WeightStore weights(config, spec, 0, nullptr);

  GroupState g(kLayout, kLayers, false);
  ElasticInputs in = g.inputs(weights, true);
  EXPECT_FALSE(in.any());
  EXPECT_FALSE(in.repair);

  std::vector<uint8_t> usable(static_cast<size_t>(kLayers * kLayout.physical), 1);
  usable[3] = 0;
  g.adopt({0, 1, 2, 3}, usable, true);
  in = g.inputs(weights, true);
  EXPECT_TRUE(in.any());
  EXPECT_TRUE(in.repair);
  EXPECT_TRUE(in.loader);
  EXPECT_EQ(in.usable, usable);
  EXPECT_EQ(in.members, g.members());
  EXPECT_EQ(in.backup_holders.size(), static_cast<size_t>(kLayout.experts));
}

TEST(GroupState, OnlyTheCurrentGroupsFailedWindowBreaksIt) {
  GroupState g(kLayout, kLayers, false);
  EXPECT_FALSE(g.window_broken());
  g.window_failed(g.group());
  EXPECT_TRUE(g.window_broken());
  g.next_group();
  EXPECT_FALSE(g.window_broken());
  // The monitor thread reports an old group's window late, then the current one's.
  std::thread monitor([&] {
    g.window_failed(0);
    g.window_failed(1);
  });
  monitor.join();
  EXPECT_EQ(g.group(), 1);
  EXPECT_TRUE(g.window_broken());
}

}  // namespace
}  // namespace eplb::runtime
