#include "eplb/migration/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/migration/scheduler.h"
#include "unit/migration/plan_testing.h"

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

// The least peak of reads in plus out that any choice of holders reaches, found apart from the
// planner: the smallest T for which a flow sends every read demand to a holder rank g with room
// T - (reads into g) (augmenting paths, one demand at a time).
int64_t least_peak(const std::vector<std::vector<int32_t>>& candidates,
                   const std::vector<int64_t>& reads_in) {
  const int64_t ranks = static_cast<int64_t>(reads_in.size());
  for (int64_t t = *std::max_element(reads_in.begin(), reads_in.end());; ++t) {
    std::vector<std::vector<int32_t>> served(ranks);  // demands served by each rank
    std::vector<int32_t> seen;
    std::function<bool(int32_t)> place = [&](int32_t d) {
      for (const int32_t g : candidates[d]) {
        if (std::find(seen.begin(), seen.end(), g) != seen.end()) continue;
        seen.push_back(g);
        if (reads_in[g] + static_cast<int64_t>(served[g].size()) < t) {
          served[g].push_back(d);
          return true;
        }
        for (int32_t& other : served[g]) {
          if (place(other)) {
            other = d;
            return true;
          }
        }
      }
      return false;
    };
    bool all = true;
    for (size_t d = 0; d < candidates.size() && all; ++d) {
      seen.clear();
      all = place(static_cast<int32_t>(d));
    }
    if (all) return t;
  }
}

// SourceChoice::kLowestPeakDegree on random placements (seeds printed on failure): the same
// reads as kSpreadServed (one per expert a rank gains), each from a rank that holds the expert,
// the action naming whether it is on the reader's node, and the busiest rank's reads in plus out
// the least that any choice of holders reaches.
TEST(Planner, LowestPeakDegreeReachesTheLeastPeak) {
  constexpr uint32_t kSeed = 100;
  for (uint32_t seed = kSeed; seed < kSeed + 400; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const Layout layout = testing::random_layout(rng, 24, 6, false);
    const std::vector<int32_t> from =
        testing::random_phy2log(rng, layout.experts, layout.physical);
    const std::vector<int32_t> to = seed % 2 ? testing::perturb(rng, from, layout.experts)
                                             : testing::random_phy2log(rng, layout.experts,
                                                                       layout.physical);
    const LayerPlan spread = plan_layer(from, to, layout, 1);
    const LayerPlan peak = plan_layer(from, to, layout, 1, {}, SourceChoice::kLowestPeakDegree);
    ASSERT_EQ(spread.reads.size(), peak.reads.size());
    std::vector<int64_t> reads_in(layout.ranks, 0), load(layout.ranks, 0);
    std::vector<std::vector<int32_t>> candidates;
    for (size_t i = 0; i < peak.reads.size(); ++i) {
      const RemoteRead& r = peak.reads[i];
      ASSERT_EQ(r.dst_slot, spread.reads[i].dst_slot);
      ASSERT_EQ(r.expert, spread.reads[i].expert);
      ASSERT_EQ(from[r.src_slot], r.expert);
      ASSERT_EQ(layout.rank_of_slot(r.src_slot), r.src_rank);
      const bool near = layout.node_of_rank(r.src_rank) == layout.node_of_rank(r.dst_rank);
      ASSERT_EQ(peak.actions[r.dst_slot].action,
                near ? Action::kReadSameNode : Action::kReadOtherNode);
      ++reads_in[r.dst_rank];
      ++load[r.dst_rank];
      ++load[r.src_rank];
      std::set<int32_t> holders;
      for (int64_t q = 0; q < layout.physical; ++q) {
        if (from[q] == r.expert) holders.insert(static_cast<int32_t>(layout.rank_of_slot(q)));
      }
      candidates.emplace_back(holders.begin(), holders.end());
    }
    // Everything else as kSpreadServed plans it.
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (!is_remote(spread.actions[p].action)) {
        ASSERT_EQ(peak.actions[p], spread.actions[p]);
      }
    }
    if (peak.reads.empty()) continue;
    ASSERT_EQ(*std::max_element(load.begin(), load.end()), least_peak(candidates, reads_in));
  }
}

// Rank 3 (node 1) gains expert 0, which ranks 1 (node 0) and 2 (node 1) hold, both idle: the
// tie goes to the reader's node, not to the lower rank.
TEST(Planner, LowestPeakDegreeBreaksTiesOnTheReadersNode) {
  const LayerPlan plan = plan_layer(std::vector<int32_t>{5, 6, 0, 1, 0, 1, 7, 8},
                                    std::vector<int32_t>{5, 6, 0, 1, 0, 1, 0, 8},
                                    layout_of(8, 4, 2), 1, {}, SourceChoice::kLowestPeakDegree);
  ASSERT_EQ(plan.reads.size(), 1u);
  EXPECT_EQ(plan.reads[0].src_rank, 2);
  EXPECT_EQ(plan.reads[0].src_slot, 4);
  EXPECT_EQ(plan.actions[6].action, Action::kReadSameNode);
}

}  // namespace
}  // namespace eplb::migration
