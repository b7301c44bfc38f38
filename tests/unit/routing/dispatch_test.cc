#include "eplb/routing/dispatch.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "eplb/core/error.h"

namespace eplb::routing {
namespace {

// 8 experts on 12 slots, 4 ranks of 3 slots, 2 nodes. Expert 0 has 3 replicas (ranks 0, 1, 3),
// expert 1 has 2 (ranks 2, 3), expert 2 has 2 (both on node 0: ranks 0, 1).
Placement example(Layout& layout) {
  layout = Layout{.experts = 8, .physical = 12, .ranks = 4, .nodes = 2, .groups = 1};
  Placement p(1, 8, 12);
  const int32_t phy2log[] = {0, 2, 3, /**/ 0, 2, 4, /**/ 1, 5, 6, /**/ 0, 1, 7};
  std::copy(std::begin(phy2log), std::end(phy2log), p.phy2log.begin());
  p.derive_from_phy2log();
  return p;
}

TEST(Dispatch, ParsesPolicyNames) {
  EXPECT_EQ(parse_dispatch_policy("hash"), DispatchPolicy::kHash);
  EXPECT_EQ(dispatch_policy_name(DispatchPolicy::kWeighted), "weighted");
  try {
    parse_dispatch_policy("roundrobin");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'roundrobin'"), std::string::npos);
  }
}

TEST(Dispatch, StaticPrefersOwnRankThenNodeThenSpreads) {
  Layout layout;
  const Placement p = example(layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  auto slot = [&](int64_t rank, int64_t expert) { return t.static_slot[rank * 8 + expert]; };
  // Expert 0: ranks 0, 1, 3 hold it; rank 2 (node 1) uses rank 3's replica on its node.
  EXPECT_EQ(slot(0, 0), 0);
  EXPECT_EQ(slot(1, 0), 3);
  EXPECT_EQ(slot(3, 0), 9);
  EXPECT_EQ(slot(2, 0), 9);
  // Expert 2 lives on node 0 only: ranks 2 and 3 are spread over its two replicas.
  EXPECT_EQ(slot(0, 2), 1);
  EXPECT_EQ(slot(1, 2), 4);
  EXPECT_NE(slot(2, 2), slot(3, 2));
  // Expert 1 lives on node 1 only (ranks 2, 3): node 0's ranks are spread over both.
  EXPECT_NE(slot(0, 1), slot(1, 1));
  for (int64_t g = 0; g < 4; ++g) {
    for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(p.phy2log[slot(g, e)], e);
  }
}

// Long-run share of each replica: uniform for random and hash, the planned share for weighted.
void expect_shares(DispatchPolicy policy, std::span<const double> share, int64_t rank) {
  Layout layout;
  const Placement p = example(layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout, share);
  constexpr int kTokens = 200000;
  std::map<int32_t, int> hits;
  uint64_t state = 42;
  for (int i = 0; i < kTokens; ++i) {
    const int32_t slot = choose_slot(t, policy, 0, static_cast<uint64_t>(i), rank, state);
    ASSERT_EQ(p.phy2log[slot], 0);
    ++hits[slot];
  }
  const int32_t replicas[] = {0, 3, 9};
  double total = 0;
  for (int32_t s : replicas) total += share.empty() ? 1.0 : share[s];
  for (int32_t s : replicas) {
    const double target = (share.empty() ? 1.0 : share[s]) / total;
    EXPECT_NEAR(hits[s] / static_cast<double>(kTokens), target, 0.01)
        << dispatch_policy_name(policy) << " slot " << s;
  }
}

TEST(Dispatch, RandomIsUniform) { expect_shares(DispatchPolicy::kRandom, {}, 1); }
TEST(Dispatch, HashIsUniformOnEveryRank) {
  for (int64_t rank = 0; rank < 4; ++rank) expect_shares(DispatchPolicy::kHash, {}, rank);
}
TEST(Dispatch, WeightedFollowsPlannedShares) {
  std::vector<double> share(12, 1.0);
  share[0] = 0.5;
  share[3] = 0.3;
  share[9] = 0.2;
  expect_shares(DispatchPolicy::kWeighted, share, 2);
  expect_shares(DispatchPolicy::kWeighted, {}, 2);
}

TEST(Dispatch, HashDiffersAcrossRanksForTheSameToken) {
  int same = 0;
  for (uint64_t token = 0; token < 1000; ++token) {
    same += dispatch_hash(token, 0) == dispatch_hash(token, 1);
  }
  EXPECT_EQ(same, 0);
}

TEST(Dispatch, RouteMapsEveryTokenToAReplicaAndRejectsBadIds) {
  Layout layout;
  const Placement p = example(layout);
  const DispatchTables t = build_dispatch_tables(p, 0, layout);
  std::mt19937 rng(7);
  std::vector<int32_t> experts(64 * 2);
  for (auto& e : experts) e = static_cast<int32_t>(rng() % 8);
  std::vector<int32_t> slots(experts.size());
  uint64_t state = 1;
  for (DispatchPolicy policy : {DispatchPolicy::kStatic, DispatchPolicy::kRandom,
                                DispatchPolicy::kHash, DispatchPolicy::kWeighted}) {
    route(t, policy, experts, 2, slots, 1000, 3, state);
    for (size_t i = 0; i < experts.size(); ++i) EXPECT_EQ(p.phy2log[slots[i]], experts[i]);
  }
  // Hash is reproducible and keyed by the token (row), not the position in the row.
  route(t, DispatchPolicy::kHash, experts, 2, slots, 1000, 3, state);
  EXPECT_EQ(slots[2], choose_slot(t, DispatchPolicy::kHash, experts[2], 1001, 3, state));
  experts[5] = 8;
  EXPECT_THROW(route(t, DispatchPolicy::kHash, experts, 2, slots, 0, 0, state), InvalidArgument);
  EXPECT_THROW(route(t, DispatchPolicy::kHash, experts, 3, slots, 0, 0, state), InvalidArgument);
}

}  // namespace
}  // namespace eplb::routing
