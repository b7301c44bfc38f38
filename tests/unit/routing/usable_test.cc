// Dispatch tables over the usable slots only (elastic serving: the slots of a lost rank): no
// policy routes to an unusable slot, an expert without a usable slot is routed to -1 under
// every policy, and "every slot usable" changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/routing/adaptive.h"
#include "eplb/routing/dispatch.h"
#include "unit/routing/random_placement.h"

namespace eplb::routing {
namespace {

constexpr DispatchPolicy kTablePolicies[] = {DispatchPolicy::kStatic, DispatchPolicy::kRandom,
                                             DispatchPolicy::kHash, DispatchPolicy::kWeighted,
                                             DispatchPolicy::kSplit};

// 8 experts on 12 slots, 4 ranks of 3 slots, 2 nodes (dispatch_test's example). Rank 3 holds
// experts 0, 1, 7; expert 7 lives nowhere else.
Placement example(Layout& layout) {
  layout = Layout{.experts = 8, .physical = 12, .ranks = 4, .nodes = 2, .groups = 1};
  Placement p(1, 8, 12);
  const int32_t phy2log[] = {0, 2, 3, /**/ 0, 2, 4, /**/ 1, 5, 6, /**/ 0, 1, 7};
  std::copy(std::begin(phy2log), std::end(phy2log), p.phy2log.begin());
  p.derive_from_phy2log();
  return p;
}

// Every slot of `rank` unusable.
std::vector<uint8_t> without_rank(const Layout& layout, int64_t rank) {
  std::vector<uint8_t> usable(static_cast<size_t>(layout.physical), 1);
  for (int64_t p = 0; p < layout.physical; ++p) {
    if (layout.rank_of_slot(p) == rank) usable[p] = 0;
  }
  return usable;
}

// A random placement of at most `experts` experts (random_placement.h), on two nodes where the
// ranks split evenly.
Placement usable_placement(std::mt19937& rng, int64_t experts, int64_t ranks, int64_t per_rank,
                           Layout& layout) {
  Placement p = random_placement(rng, std::min(experts, ranks * per_rank), ranks, per_rank,
                                 layout);
  if (ranks % 2 == 0) layout.nodes = 2;
  return p;
}

void expect_same_tables(const DispatchTables& a, const DispatchTables& b) {
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_EQ(a.ranks, b.ranks);
  EXPECT_EQ(a.max_replicas, b.max_replicas);
  EXPECT_EQ(a.slots_per_rank, b.slots_per_rank);
  EXPECT_EQ(a.log2phy, b.log2phy);
  EXPECT_EQ(a.replica_count, b.replica_count);
  EXPECT_EQ(a.static_slot, b.static_slot);
  EXPECT_EQ(a.cumulative_share, b.cumulative_share);
}

TEST(Usable, EverySlotUsableGivesTheSameTablesBitForBit) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    Layout layout;
    const Placement p = usable_placement(rng, 6 + seed % 5, 2 + seed % 4, 3, layout);
    std::vector<double> share(static_cast<size_t>(layout.physical));
    for (double& s : share) s = static_cast<double>(rng() % 100) / 10.0;
    const std::vector<uint8_t> all(static_cast<size_t>(layout.physical), 1);
    expect_same_tables(build_dispatch_tables(p, 0, layout),
                       build_dispatch_tables(p, 0, layout, {}, all));
    expect_same_tables(build_dispatch_tables(p, 0, layout, share),
                       build_dispatch_tables(p, 0, layout, share, all));
  }
}

TEST(Usable, AnExpertWithoutAUsableSlotHasNoReplica) {
  Layout layout;
  const Placement p = example(layout);
  const std::vector<uint8_t> usable = without_rank(layout, 3);
  const DispatchTables t = build_dispatch_tables(p, 0, layout, {}, usable);
  EXPECT_EQ(t.max_replicas, p.max_replicas);
  EXPECT_EQ(unavailable_experts(t), std::vector<int32_t>{7});
  EXPECT_EQ(t.replica_count[7], 0);
  for (int64_t i = 0; i < t.max_replicas; ++i) EXPECT_EQ(t.log2phy[7 * t.max_replicas + i], -1);
  for (int64_t g = 0; g < t.ranks; ++g) EXPECT_EQ(t.static_slot[g * t.experts + 7], -1);
  // Expert 0 keeps its replicas on ranks 0 and 1, in order; expert 1 the one on rank 2.
  ASSERT_EQ(t.replica_count[0], 2);
  EXPECT_EQ(t.replicas(0)[0], 0);
  EXPECT_EQ(t.replicas(0)[1], 3);
  EXPECT_EQ(t.log2phy[0 * t.max_replicas + 2], -1);
  ASSERT_EQ(t.replica_count[1], 1);
  EXPECT_EQ(t.replicas(1)[0], 6);
  // Rank 3's static choice for expert 0 is now a replica on another node, for expert 1 its node's
  // usable one.
  EXPECT_TRUE(t.static_slot[3 * 8 + 0] == 0 || t.static_slot[3 * 8 + 0] == 3);
  EXPECT_EQ(t.static_slot[3 * 8 + 1], 6);
  EXPECT_EQ(build_dispatch_tables(p, 0, layout).replica_count[7], 1);
  EXPECT_TRUE(unavailable_experts(build_dispatch_tables(p, 0, layout)).empty());
}

TEST(Usable, RejectsAMaskOfTheWrongSize) {
  Layout layout;
  const Placement p = example(layout);
  const std::vector<uint8_t> usable(11, 1);
  EXPECT_THROW(build_dispatch_tables(p, 0, layout, {}, usable), InvalidArgument);
}

// Every route of `experts` on every rank under every policy, adaptive included: the slot holds
// the expert and is usable, or is -1 exactly when the expert has no usable slot.
void expect_routes_usable(const Placement& p, const Layout& layout,
                          std::span<const uint8_t> usable, std::span<const double> share,
                          std::span<const int32_t> experts, int64_t top_k) {
  const DispatchTables t = build_dispatch_tables(p, 0, layout, share, usable);
  std::vector<char> unavailable(static_cast<size_t>(layout.experts), 0);
  for (const int32_t e : unavailable_experts(t)) unavailable[e] = 1;
  for (int64_t e = 0; e < layout.experts; ++e) {
    bool any = false;
    for (const int32_t s : p.replicas(0, e)) any = any || usable[s] != 0;
    ASSERT_EQ(unavailable[e] != 0, !any) << "expert " << e;
  }
  auto check = [&](std::span<const int32_t> slots, const char* what) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t e = experts[i];
      if (unavailable[e]) {
        ASSERT_EQ(slots[i], -1) << what << " entry " << i << " expert " << e;
        continue;
      }
      ASSERT_GE(slots[i], 0) << what << " entry " << i << " expert " << e;
      ASSERT_LT(slots[i], layout.physical) << what;
      ASSERT_NE(usable[slots[i]], 0) << what << " sent expert " << e << " to slot " << slots[i];
      ASSERT_EQ(p.phy2log[slots[i]], e) << what;
    }
  };
  std::vector<int32_t> slots(experts.size());
  for (const DispatchPolicy policy : kTablePolicies) {
    for (int64_t g = 0; g < layout.ranks; ++g) {
      uint64_t state = 1 + static_cast<uint64_t>(g);
      route(t, policy, experts, top_k, slots, 100, g, state);
      check(slots, dispatch_policy_name(policy).data());
      for (size_t i = 0; i < experts.size(); ++i) {
        const int32_t s = choose_slot(t, policy, experts[i], i, g, state);
        ASSERT_TRUE(unavailable[experts[i]] ? s == -1 : s >= 0 && usable[s] != 0);
      }
    }
  }
  // adaptive: every rank routes the same batch after the lower ranks' copies of it.
  std::vector<int64_t> global(static_cast<size_t>(layout.experts), 0), prefix(global.size(), 0);
  for (int64_t g = 0; g < layout.ranks; ++g) count_experts(experts, layout.experts, global);
  AdaptiveShares shares;
  adaptive_shares(t, global, shares);
  std::vector<int64_t> rank_load(static_cast<size_t>(layout.ranks), 0);
  int64_t routed = 0, dropped = 0;
  for (int64_t g = 0; g < layout.ranks; ++g) {
    route_adaptive(t, shares, prefix, experts, top_k, slots);
    check(slots, "adaptive");
    for (const int32_t s : slots) {
      if (s < 0) {
        ++dropped;
        continue;
      }
      ++rank_load[layout.rank_of_slot(s)];
      ++routed;
    }
    count_experts(experts, layout.experts, prefix);
  }
  // The shares leave out the dropped tokens, and the busiest rank is what they promise.
  int64_t shared = 0;
  for (const int64_t s : shares.share) shared += s;
  EXPECT_EQ(shared, routed);
  EXPECT_EQ(*std::max_element(rank_load.begin(), rank_load.end()), shares.max_rank_load);
  int64_t unavailable_tokens = 0;
  for (int64_t e = 0; e < layout.experts; ++e) unavailable_tokens += unavailable[e] ? global[e] : 0;
  EXPECT_EQ(dropped, unavailable_tokens);
}

TEST(Usable, NoPolicyRoutesToAnUnusableSlot) {
  Layout layout;
  const Placement p = example(layout);
  std::mt19937 rng(3);
  std::vector<int32_t> experts(96 * 2);
  for (auto& e : experts) e = static_cast<int32_t>(rng() % 8);
  std::vector<double> share(12, 1.0);
  share[0] = 3.0;
  for (int64_t lost = 0; lost < layout.ranks; ++lost) {
    SCOPED_TRACE(testing::Message() << "rank " << lost << " lost");
    const std::vector<uint8_t> usable = without_rank(layout, lost);
    expect_routes_usable(p, layout, usable, {}, experts, 2);
    expect_routes_usable(p, layout, usable, share, experts, 2);
  }
}

TEST(Usable, RandomMasksNeverRouteToUnusableSlots) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    Layout layout;
    const Placement p = usable_placement(rng, 5 + seed % 7, 2 + seed % 5, 2 + seed % 3, layout);
    std::vector<uint8_t> usable(static_cast<size_t>(layout.physical));
    for (auto& u : usable) u = rng() % 3 != 0;
    std::vector<int32_t> experts(40 * 2);
    for (auto& e : experts) e = static_cast<int32_t>(rng() % layout.experts);
    expect_routes_usable(p, layout, usable, {}, experts, 2);
  }
}

TEST(Usable, NothingUsableRoutesEveryTokenToMinusOne) {
  Layout layout;
  const Placement p = example(layout);
  const std::vector<uint8_t> none(12, 0);
  const DispatchTables t = build_dispatch_tables(p, 0, layout, {}, none);
  EXPECT_EQ(unavailable_experts(t).size(), 8u);
  std::vector<int32_t> experts = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> slots(experts.size(), 0);
  for (const DispatchPolicy policy : kTablePolicies) {
    uint64_t state = 5;
    route(t, policy, experts, 1, slots, 0, 1, state);
    for (const int32_t s : slots) EXPECT_EQ(s, -1) << dispatch_policy_name(policy);
  }
  const std::vector<int64_t> global(8, 3), prefix(8, 0);
  AdaptiveShares shares;
  adaptive_shares(t, global, shares);
  EXPECT_EQ(shares.max_rank_load, 0);
  route_adaptive(t, shares, prefix, experts, 1, slots);
  for (const int32_t s : slots) EXPECT_EQ(s, -1);
}

// The least largest rank load of any split of the routed tokens over the usable replicas, by
// enumeration (tiny cases).
int64_t exhaustive_optimum(const DispatchTables& t, const std::vector<int64_t>& counts) {
  std::vector<int64_t> load(static_cast<size_t>(t.ranks), 0);
  int64_t best = std::numeric_limits<int64_t>::max();
  std::function<void(int64_t)> expert = [&](int64_t e) {
    if (e == t.experts) {
      best = std::min(best, *std::max_element(load.begin(), load.end()));
      return;
    }
    const auto reps = t.replicas(e);
    if (reps.empty()) return expert(e + 1);
    std::function<void(size_t, int64_t)> give = [&](size_t i, int64_t left) {
      const int64_t g = reps[i] / t.slots_per_rank;
      if (i + 1 == reps.size()) {
        load[g] += left;
        expert(e + 1);
        load[g] -= left;
        return;
      }
      for (int64_t x = 0; x <= left; ++x) {
        load[g] += x;
        give(i + 1, left - x);
        load[g] -= x;
      }
    };
    give(0, counts[e]);
  };
  expert(0);
  return best;
}

TEST(Usable, AdaptiveIsOptimalOverTheUsableReplicas) {
  for (uint32_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    Layout layout;
    const Placement p = usable_placement(rng, 4, 3, 2, layout);
    std::vector<uint8_t> usable(static_cast<size_t>(layout.physical));
    for (auto& u : usable) u = rng() % 3 != 0;
    const DispatchTables t = build_dispatch_tables(p, 0, layout, {}, usable);
    std::vector<int64_t> counts(4);
    for (auto& c : counts) c = static_cast<int64_t>(rng() % 6);
    AdaptiveShares shares;
    adaptive_shares(t, counts, shares);
    EXPECT_EQ(shares.max_rank_load, exhaustive_optimum(t, counts));
    for (const int32_t e : unavailable_experts(t)) {
      for (int64_t i = 0; i < t.max_replicas; ++i) EXPECT_EQ(shares.share[e * t.max_replicas + i], 0);
    }
  }
}

TEST(Usable, ReplicaHelpersHaveNoReplicaToGiveForACountOfZero) {
  const int64_t share[1] = {0};
  EXPECT_EQ(adaptive_replica(share, 0, 5), -1);
  EXPECT_EQ(split_replica(3, 1, 2, 0), -1);
}

}  // namespace
}  // namespace eplb::routing
