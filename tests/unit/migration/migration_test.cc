#include "eplb/migration/migration.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "unit/migration/plan_testing.h"

namespace eplb::migration {
namespace {

using testing::execute;
using testing::perturb;
using testing::placement_of;
using testing::random_phy2log;
using testing::Weights;

// Checks every invariant of a plan and its execution; `label` names the case on failure.
// `choice`: the planner's rule for sources (kSpreadServed: a holder on the reader's node when
// there is one; kLowestPeakDegree: any holder, the action naming where it is).
void check_layer(const std::vector<int32_t>& from, const std::vector<int32_t>& to,
                 const Layout& layout, int32_t layer, const LayerMigration& m, int64_t bytes,
                 const std::string& label, SourceChoice choice) {
  SCOPED_TRACE(label);
  const LayerPlan& plan = m.plan;
  const int64_t per_rank = layout.slots_per_rank();
  // The right expert in every slot after execution.
  std::vector<Weights> live(from.size());
  for (size_t p = 0; p < from.size(); ++p) live[p] = {layer, from[p]};
  execute(plan, layout, layer, live);
  for (size_t p = 0; p < to.size(); ++p) {
    ASSERT_EQ(live[p], (Weights{layer, to[p]})) << "slot " << p;
  }
  // Actions in priority order.
  for (int64_t p = 0; p < layout.physical; ++p) {
    const SlotAction& a = plan.actions[p];
    const int64_t g = layout.rank_of_slot(p);
    ASSERT_EQ(a.expert, to[p]);
    const bool held_locally =
        std::find(from.begin() + g * per_rank, from.begin() + (g + 1) * per_rank, to[p]) !=
        from.begin() + (g + 1) * per_rank;
    bool earlier_read = false;
    for (int64_t q = g * per_rank; q < p; ++q) {
      earlier_read = earlier_read || (to[q] == to[p] && is_remote(plan.actions[q].action));
    }
    bool same_node_holder = false;
    for (int64_t q = 0; q < layout.physical; ++q) {
      same_node_holder = same_node_holder ||
                         (from[q] == to[p] && layout.node_of_slot(q) == layout.node_of_rank(g));
    }
    Action expected = Action::kReadOtherNode;
    if (from[p] == to[p]) {
      expected = Action::kUnchanged;
    } else if (held_locally) {
      expected = Action::kLocalCopy;
    } else if (earlier_read) {
      expected = Action::kFreeRide;
    } else if (choice == SourceChoice::kLowestPeakDegree) {
      expected = layout.node_of_rank(a.src_rank) == layout.node_of_rank(g) ? Action::kReadSameNode
                                                                         : Action::kReadOtherNode;
    } else if (same_node_holder) {
      expected = Action::kReadSameNode;
    }
    ASSERT_EQ(a.action, expected) << "slot " << p;
  }
  // Reads: only from old holders; each (rank, expert) read at most once; accounting adds up.
  std::set<std::pair<int32_t, int32_t>> read_once;
  int64_t intra = 0, inter = 0;
  std::vector<int64_t> in(layout.ranks, 0), out(layout.ranks, 0);
  for (const RemoteRead& r : plan.reads) {
    ASSERT_EQ(from[r.src_slot], r.expert) << "read targets slot " << r.src_slot;
    ASSERT_EQ(to[r.dst_slot], r.expert);
    ASSERT_EQ(layout.rank_of_slot(r.src_slot), r.src_rank);
    ASSERT_EQ(layout.rank_of_slot(r.dst_slot), r.dst_rank);
    ASSERT_NE(r.src_rank, r.dst_rank);
    ASSERT_TRUE(read_once.emplace(r.dst_rank, r.expert).second)
        << "rank " << r.dst_rank << " reads expert " << r.expert << " twice";
    (layout.node_of_rank(r.src_rank) == layout.node_of_rank(r.dst_rank) ? intra : inter) += bytes;
    in[r.dst_rank] += bytes;
    out[r.src_rank] += bytes;
  }
  ASSERT_EQ(plan.bytes_intra_node, intra);
  ASSERT_EQ(plan.bytes_inter_node, inter);
  ASSERT_EQ(plan.bytes_total, intra + inter);
  ASSERT_EQ(plan.rank_bytes_in, in);
  ASSERT_EQ(plan.rank_bytes_out, out);
  ASSERT_EQ(plan.max_rank_bytes_in, *std::max_element(in.begin(), in.end()));
  ASSERT_EQ(plan.max_rank_bytes_out, *std::max_element(out.begin(), out.end()));
  // Every read scheduled once, in a round within range.
  ASSERT_EQ(m.schedule.round_of_read.size(), plan.reads.size());
  for (const int32_t round : m.schedule.round_of_read) {
    ASSERT_GE(round, 0);
    ASSERT_LT(round, m.schedule.rounds);
  }
}

enum class Kind { kRandom, kIdentical, kPermutation, kPerturbed };

TEST(Migration, ExecutingAPlanAlwaysEndsWithTheRightExperts) {
  const Kind kinds[] = {Kind::kRandom, Kind::kIdentical, Kind::kPermutation, Kind::kPerturbed};
  for (uint32_t seed = 0; seed < 600; ++seed) {
    std::mt19937 rng(seed);
    const Kind kind = kinds[seed % 4];
    const Layout layout = testing::random_layout(rng, 64, 9, kind == Kind::kPermutation);
    const int64_t physical = layout.physical;
    const int64_t experts = layout.experts;
    const int64_t k = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    const bool half_duplex = seed % 5 == 0;
    const int64_t bytes = std::uniform_int_distribution<int64_t>(1, 1 << 20)(rng);

    std::vector<std::vector<int32_t>> from, to;
    for (int layer = 0; layer < 3; ++layer) {
      from.push_back(random_phy2log(rng, experts, physical));
      switch (kind) {
        case Kind::kIdentical: to.push_back(from.back()); break;
        case Kind::kPerturbed: to.push_back(perturb(rng, from.back(), experts)); break;
        default: to.push_back(random_phy2log(rng, experts, physical)); break;
      }
    }
    const MigrationPlan plan = plan_migration(
        placement_of(from, experts), placement_of(to, experts), layout,
        {.expert_bytes = bytes, .schedule = {.peers_per_round = k, .half_duplex = half_duplex}});
    ASSERT_EQ(plan.layers.size(), 3u);
    const std::string label = "seed " + std::to_string(seed) + " " + layout.describe() +
                              " k=" + std::to_string(k) + (half_duplex ? " half duplex" : "");
    int64_t total = 0, rounds = 0;
    for (int32_t l = 0; l < 3; ++l) {
      check_layer(from[l], to[l], layout, l, plan.layers[l], bytes, label,
                  half_duplex ? SourceChoice::kLowestPeakDegree : SourceChoice::kSpreadServed);
      if (::testing::Test::HasFatalFailure()) return;
      total += plan.layers[l].plan.bytes_total;
      rounds += plan.layers[l].schedule.rounds;
      if (!half_duplex) {
        EXPECT_EQ(plan.layers[l].schedule.rounds, plan.layers[l].schedule.lower_bound) << label;
      }
    }
    EXPECT_EQ(plan.totals.bytes_total, total) << label;
    EXPECT_EQ(plan.totals.rounds, rounds) << label;
    if (kind == Kind::kIdentical) {
      EXPECT_EQ(plan.totals.count(Action::kUnchanged), 3 * physical) << label;
      EXPECT_EQ(plan.totals.rounds, 0) << label;
    }
  }
}

// Holders serve evenly: one expert on two ranks, read by five ranks: three and two reads.
TEST(Migration, SpreadsReadsOverHolders) {
  const std::vector<int32_t> from{0, 0, 1, 1, 1, 1, 1, 1};
  const std::vector<int32_t> to{0, 0, 0, 0, 0, 0, 0, 1};
  const Layout layout{.experts = 2, .physical = 8, .ranks = 8, .nodes = 1};
  const MigrationPlan plan = plan_migration(placement_of({from}, 2), placement_of({to}, 2), layout,
                                            {.expert_bytes = 3, .schedule = {}});
  EXPECT_EQ(plan.layers[0].plan.rank_bytes_out[0], 9);
  EXPECT_EQ(plan.layers[0].plan.rank_bytes_out[1], 6);
  EXPECT_EQ(plan.totals.max_rank_bytes_out, 9);
  EXPECT_EQ(plan.totals.rounds, 3);
  EXPECT_EQ(plan.totals.rounds_lower_bound, 3);
}

TEST(Migration, Deterministic) {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> from, to;
  for (int l = 0; l < 4; ++l) {
    from.push_back(random_phy2log(rng, 256, 288));
    to.push_back(random_phy2log(rng, 256, 288));
  }
  const Layout layout{.experts = 256, .physical = 288, .ranks = 32, .nodes = 4};
  const MigrationOptions options{.expert_bytes = 1 << 20, .schedule = {}};
  const MigrationPlan a =
      plan_migration(placement_of(from, 256), placement_of(to, 256), layout, options);
  const MigrationPlan b =
      plan_migration(placement_of(from, 256), placement_of(to, 256), layout, options);
  for (size_t l = 0; l < a.layers.size(); ++l) {
    for (size_t i = 0; i < a.layers[l].plan.reads.size(); ++i) {
      EXPECT_EQ(a.layers[l].plan.reads[i].src_slot, b.layers[l].plan.reads[i].src_slot);
    }
    EXPECT_EQ(a.layers[l].schedule.round_of_read, b.layers[l].schedule.round_of_read);
  }
}

std::string message_of(const Placement& from, const Placement& to, const Layout& layout,
                       const MigrationOptions& options) {
  try {
    plan_migration(from, to, layout, options);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Migration, ErrorsNameTheMismatch) {
  const Layout layout{.experts = 2, .physical = 4, .ranks = 2, .nodes = 1};
  const Placement two = placement_of({{0, 1, 0, 1}, {1, 0, 1, 0}}, 2);
  const Placement one = placement_of({{0, 1, 0, 1}}, 2);
  const Placement wide = placement_of({{0, 1, 0, 1, 0, 1}}, 2);
  EXPECT_NE(message_of(two, one, layout, {.expert_bytes = 1, .schedule = {}})
                .find("2 layers and new placement 1"),
            std::string::npos);
  EXPECT_NE(
      message_of(one, wide, layout, {.expert_bytes = 1, .schedule = {}}).find("4 physical slots"),
      std::string::npos);
  EXPECT_NE(
      message_of(one, one, layout, {.expert_bytes = -5, .schedule = {}}).find("expert bytes -5"),
      std::string::npos);
  EXPECT_NE(message_of(one, one, layout, {.expert_bytes = 1, .schedule = {.peers_per_round = 0}})
                .find("peers per round 0"),
            std::string::npos);
  const Placement missing = placement_of({{0, 0, 0, 0}}, 1);
  EXPECT_NE(message_of(missing, one, layout, {.expert_bytes = 1, .schedule = {}})
                .find("layer 0: expert 1"),
            std::string::npos);
}

}  // namespace
}  // namespace eplb::migration
