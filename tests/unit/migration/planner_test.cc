#include "eplb/migration/planner.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/migration/scheduler.h"

namespace eplb::migration {
namespace {

Layout layout_of(int64_t physical, int64_t ranks, int64_t nodes) {
  return {.experts = 1, .physical = physical, .ranks = ranks, .nodes = nodes};
}

std::vector<Action> actions_of(const LayerPlan& plan) {
  std::vector<Action> out;
  for (const SlotAction& a : plan.actions) out.push_back(a.action);
  return out;
}

std::string message_of(std::vector<int32_t> from, std::vector<int32_t> to, const Layout& layout,
                       int64_t bytes) {
  try {
    plan_layer(from, to, layout, bytes);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

using A = Action;

// Old [0,0,1,1,1] -> new [0,0,0,0,0] on 5 ranks of 1 slot: ranks 2, 3 and 4 must read expert 0
// from ranks 0 and 1, spread evenly (ties to the lowest rank): 0, 1, 0.
TEST(Planner, GoldenFiveRanksOneSlot) {
  const LayerPlan plan = plan_layer(std::vector<int32_t>{0, 0, 1, 1, 1},
                                    std::vector<int32_t>{0, 0, 0, 0, 0}, layout_of(5, 5, 1), 10);
  EXPECT_EQ(actions_of(plan), (std::vector<A>{A::kUnchanged, A::kUnchanged, A::kReadSameNode,
                                              A::kReadSameNode, A::kReadSameNode}));
  ASSERT_EQ(plan.reads.size(), 3u);
  EXPECT_EQ(plan.reads[0].src_rank, 0);
  EXPECT_EQ(plan.reads[1].src_rank, 1);
  EXPECT_EQ(plan.reads[2].src_rank, 0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(plan.reads[i].dst_rank, i + 2);
    EXPECT_EQ(plan.reads[i].dst_slot, i + 2);
    EXPECT_EQ(plan.reads[i].src_slot, plan.reads[i].src_rank);
    EXPECT_EQ(plan.reads[i].expert, 0);
  }
  EXPECT_EQ(plan.bytes_total, 30);
  EXPECT_EQ(plan.bytes_intra_node, 30);
  EXPECT_EQ(plan.bytes_inter_node, 0);
  EXPECT_EQ(plan.bytes_local_copy, 0);
  EXPECT_EQ(plan.max_rank_bytes_in, 10);
  EXPECT_EQ(plan.max_rank_bytes_out, 20);
  EXPECT_EQ(plan.rank_bytes_out, (std::vector<int64_t>{20, 10, 0, 0, 0}));
  EXPECT_EQ(plan.count(A::kUnchanged), 2);
  EXPECT_EQ(plan.count(A::kReadSameNode), 3);
  EXPECT_EQ(plan.staging_slots, 1);

  // Rank 0 serves two peers: two rounds at one peer per round, one at two.
  const Schedule one = schedule_reads(plan.reads, 5, {.peers_per_round = 1});
  EXPECT_EQ(one.rounds, 2);
  EXPECT_EQ(one.lower_bound, 2);
  EXPECT_NE(one.round_of_read[0], one.round_of_read[2]);
  EXPECT_EQ(schedule_reads(plan.reads, 5, {.peers_per_round = 2}).rounds, 1);
}

// The same on 5 nodes of one rank: every read crosses nodes.
TEST(Planner, GoldenFiveRanksFiveNodes) {
  const LayerPlan plan = plan_layer(std::vector<int32_t>{0, 0, 1, 1, 1},
                                    std::vector<int32_t>{0, 0, 0, 0, 0}, layout_of(5, 5, 5), 10);
  EXPECT_EQ(plan.count(A::kReadOtherNode), 3);
  EXPECT_EQ(plan.bytes_inter_node, 30);
  EXPECT_EQ(plan.bytes_intra_node, 0);
}

// A 4-rank cycle: rank g takes the expert of rank g + 1. One round in duplex (every rank reads
// one peer and serves one), two in half duplex (an even cycle).
TEST(Planner, GoldenFourRankCycle) {
  const LayerPlan plan = plan_layer(std::vector<int32_t>{0, 1, 2, 3},
                                    std::vector<int32_t>{1, 2, 3, 0}, layout_of(4, 4, 2), 7);
  ASSERT_EQ(plan.reads.size(), 4u);
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(plan.reads[g].dst_rank, g);
    EXPECT_EQ(plan.reads[g].src_rank, (g + 1) % 4);
    EXPECT_EQ(plan.reads[g].src_slot, (g + 1) % 4);
  }
  EXPECT_EQ(actions_of(plan), (std::vector<A>{A::kReadSameNode, A::kReadOtherNode, A::kReadSameNode,
                                              A::kReadOtherNode}));
  EXPECT_EQ(plan.bytes_intra_node, 14);
  EXPECT_EQ(plan.bytes_inter_node, 14);
  EXPECT_EQ(plan.max_rank_bytes_in, 7);
  EXPECT_EQ(plan.max_rank_bytes_out, 7);

  const Schedule duplex = schedule_reads(plan.reads, 4, {});
  EXPECT_EQ(duplex.rounds, 1);
  EXPECT_EQ(duplex.lower_bound, 1);
  const Schedule half = schedule_reads(plan.reads, 4, {.half_duplex = true});
  EXPECT_EQ(half.rounds, 2);
  EXPECT_EQ(half.lower_bound, 2);
}

// A swap inside one rank: both slots are local copies that read the slot the other overwrites.
TEST(Planner, LocalSwapReadsOldContent) {
  const LayerPlan plan =
      plan_layer(std::vector<int32_t>{0, 1}, std::vector<int32_t>{1, 0}, layout_of(2, 1, 1), 5);
  EXPECT_EQ(actions_of(plan), (std::vector<A>{A::kLocalCopy, A::kLocalCopy}));
  EXPECT_EQ(plan.actions[0].src_slot, 1);
  EXPECT_EQ(plan.actions[1].src_slot, 0);
  EXPECT_TRUE(plan.reads.empty());
  EXPECT_EQ(plan.bytes_total, 0);
  EXPECT_EQ(plan.bytes_local_copy, 10);
  EXPECT_EQ(plan.staging_slots, 2);
}

// Rank 1 needs expert 0 twice: the first slot reads it from rank 0, the second rides along.
// A local holder wins over a read even when the rank also reads the expert elsewhere.
TEST(Planner, FreeRideAndLocalCopy) {
  const LayerPlan plan = plan_layer(std::vector<int32_t>{0, 1, 2, 3, 3, 3},
                                    std::vector<int32_t>{0, 1, 2, 0, 0, 3}, layout_of(6, 2, 2), 4);
  EXPECT_EQ(actions_of(plan), (std::vector<A>{A::kUnchanged, A::kUnchanged, A::kUnchanged,
                                              A::kReadOtherNode, A::kFreeRide, A::kUnchanged}));
  EXPECT_EQ(plan.actions[4].src_slot, 3);
  EXPECT_EQ(plan.actions[4].src_rank, 1);
  ASSERT_EQ(plan.reads.size(), 1u);
  EXPECT_EQ(plan.bytes_total, 4);
  EXPECT_EQ(plan.bytes_local_copy, 4);

  const LayerPlan local = plan_layer(std::vector<int32_t>{0, 1, 2, 3, 0, 3},
                                     std::vector<int32_t>{0, 1, 2, 0, 0, 0}, layout_of(6, 2, 1), 4);
  EXPECT_EQ(actions_of(local), (std::vector<A>{A::kUnchanged, A::kUnchanged, A::kUnchanged,
                                               A::kLocalCopy, A::kUnchanged, A::kLocalCopy}));
  EXPECT_EQ(local.actions[3].src_slot, 4);
  EXPECT_EQ(local.actions[5].src_slot, 4);
}

// A same-node holder wins over a less loaded holder on another node.
TEST(Planner, PrefersSameNodeHolder) {
  // Ranks 0,1 on node 0; ranks 2,3 on node 1. Expert 0 is on ranks 0 and 2; rank 3 needs it.
  const LayerPlan plan = plan_layer(std::vector<int32_t>{0, 1, 0, 2},
                                    std::vector<int32_t>{0, 1, 0, 0}, layout_of(4, 4, 2), 1);
  ASSERT_EQ(plan.reads.size(), 1u);
  EXPECT_EQ(plan.reads[0].src_rank, 2);
  EXPECT_EQ(plan.actions[3].action, A::kReadSameNode);
}

// The most constrained demand is served first: expert 0 can only come from rank 0, so expert 1
// (on ranks 0 and 1) is read from rank 1 although its slot comes first.
TEST(Planner, MostConstrainedDemandFirst) {
  const LayerPlan plan =
      plan_layer(std::vector<int32_t>{0, 1, 1, 2, 2, 3, 3, 2},
                 std::vector<int32_t>{0, 1, 1, 2, 1, 3, 0, 2}, layout_of(8, 4, 1), 1);
  ASSERT_EQ(plan.reads.size(), 2u);
  EXPECT_EQ(plan.reads[0].dst_slot, 4);
  EXPECT_EQ(plan.reads[0].src_rank, 1);
  EXPECT_EQ(plan.reads[0].src_slot, 2);
  EXPECT_EQ(plan.reads[1].dst_slot, 6);
  EXPECT_EQ(plan.reads[1].src_rank, 0);
  EXPECT_EQ(plan.reads[1].src_slot, 0);
  EXPECT_EQ(plan.max_rank_bytes_out, 1);
}

TEST(Planner, IdenticalPlacementsMoveNothing) {
  const std::vector<int32_t> same{3, 1, 2, 0, 1, 3};
  const LayerPlan plan = plan_layer(same, same, layout_of(6, 3, 1), 100);
  EXPECT_EQ(plan.count(A::kUnchanged), 6);
  EXPECT_TRUE(plan.reads.empty());
  EXPECT_EQ(plan.bytes_total, 0);
  EXPECT_EQ(plan.staging_slots, 0);
  EXPECT_EQ(schedule_reads(plan.reads, 3, {}).rounds, 0);
}

TEST(Planner, ErrorsNameTheValue) {
  EXPECT_NE(message_of({0, 1}, {1, 0}, layout_of(2, 1, 1), 0).find("expert bytes 0"),
            std::string::npos);
  EXPECT_NE(message_of({0, 1}, {1, 0, 1}, layout_of(2, 1, 1), 1).find("new placement 3"),
            std::string::npos);
  EXPECT_NE(message_of({0, 1, 2}, {1, 0, 2}, layout_of(3, 2, 1), 1)
                .find("physical 3 is not a "
                      "multiple of ranks 2"),
            std::string::npos);
  EXPECT_NE(message_of({0, 1, 2, 3}, {1, 0, 2, 3}, layout_of(4, 4, 3), 1)
                .find("ranks 4 is not a multiple of nodes 3"),
            std::string::npos);
  EXPECT_NE(message_of({0, 0}, {0, 1}, layout_of(2, 2, 1), 1).find("expert 1"), std::string::npos);
  EXPECT_NE(message_of({0, -1}, {0, 0}, layout_of(2, 2, 1), 1).find("slot 1 holds expert -1"),
            std::string::npos);
}

TEST(Planner, ActionNames) {
  EXPECT_EQ(action_name(A::kUnchanged), "unchanged");
  EXPECT_EQ(action_name(A::kLocalCopy), "local_copy");
  EXPECT_EQ(action_name(A::kFreeRide), "free_ride");
  EXPECT_EQ(action_name(A::kReadSameNode), "read_same_node");
  EXPECT_EQ(action_name(A::kReadOtherNode), "read_other_node");
  EXPECT_EQ(action_name(A::kRestore), "restore");
  EXPECT_TRUE(is_staged(A::kRestore));
  EXPECT_FALSE(is_remote(A::kRestore));
}

}  // namespace
}  // namespace eplb::migration
