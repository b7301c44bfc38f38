#pragma once
// Placement policies: pure functions from loads (and optionally the previous placement) to a
// placement. One layer at a time, deterministic (ties broken by index), no threads, no I/O.
//
//   deepseek  the public DeepSeek EPLB algorithm, identical outputs for tie-free inputs
//             (hierarchical when groups % nodes == 0, global otherwise)
//   balanced  the best balance we can get fast: optimal replica counts, packing with no two
//             replicas of an expert on one rank, then local search off the most loaded rank
//   sticky    migration-aware: within `tolerance` of balanced's balancedness, keep as many slots
//             as possible holding what they hold in `previous`
//
// Live ranks (elastic serving: a rank is lost, the survivors keep serving, later it rejoins):
// the layout stays the same, and place() puts every expert on the live ranks only. It does so
// once for every policy: the live ranks form a compact layout (ranks = the live ones, in
// order; physical = their slots; experts and groups as before; nodes = the nodes that have
// live ranks when each has the same number of them and groups % nodes == 0, else 1) and the
// previous placement shrinks to their slots, in which an expert that lived only on the ranks
// that are gone has no slot (each policy gives it one). The policy places on the compact
// layout, and the result is expanded back: live rank i is live_ranks[i]; the slots of the other
// ranks keep the expert they hold in `previous` (slot p mod experts without one). Hierarchical
// placement asked for on live ranks that cannot form such nodes (a node that lost some of its
// ranks but not all) is placed non-hierarchically instead of failing: serving goes on, with
// groups spread over nodes until the lost ranks rejoin. In the expanded placement's log2phy
// each expert's replicas on live ranks come first, in the policy's order, then the kept slots
// of the other ranks, by slot; routing must not send anything to those (routing's `usable`).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/cost.h"

namespace eplb::placement {

enum class Policy { kDeepseek, kBalanced, kSticky };

// "deepseek" | "balanced" | "sticky"; anything else throws InvalidArgument listing the choices.
Policy parse_policy(std::string_view name);
std::string_view policy_name(Policy policy);

struct PolicyOptions {
  Policy policy = Policy::kBalanced;
  // balanced / sticky: pack groups to nodes first, like deepseek's hierarchical policy.
  bool hierarchical = false;
  // sticky: accepted loss of balancedness against balanced on the same load.
  double tolerance = 0.01;
  // balanced / sticky at two slots per rank (DeepSeek-V3 decode): also build the replica counts
  // level by level and keep the better. At 512 slots for 256 experts (256 ranks) balanced then
  // reaches 0.98-0.99 instead of 0.93 on lognormal(0, 1) loads, in about 2-3x the time; sticky,
  // held to that balance, moves about three times the slots (48% instead of 16% under
  // lognormal(0, 0.2) drift) and takes several times longer. Other shapes: no effect.
  // With deepseek: an error (its counts are the reference's).
  bool thorough = false;
  // sticky: required, the placement in force now (same layers, experts, physical). balanced
  // reads it only for its dense layers (no load), which keep it. Only its phy2log is read and
  // checked (every slot an expert in range); an expert without a slot there gets one.
  const Placement* previous = nullptr;
  // Ranks that may hold experts, ascending, each in [0, layout.ranks); empty: every rank. The
  // placement puts every expert on these ranks only (each expert gets at least one replica on
  // one of them); the slots of the other ranks keep the expert they have in `previous` (slot p
  // mod experts without one), and nothing should be routed to them (routing's `usable`).
  std::vector<int32_t> live_ranks = {};
  // balanced: place under this cost model (balanced_cost, balanced.h) instead of by tokens,
  // from loads that sum `cost_steps` steps. Not hierarchical; an error with deepseek or sticky.
  std::optional<CostModel> cost = std::nullopt;
  int64_t cost_steps = 1;
};

// Places every layer of `load` on `layout`. Validates layout, load and options first
// (InvalidArgument naming the bad value; for live_ranks also when their slots are fewer than
// the experts). Every rank live, listed or not, gives the same placement as no list.
Placement place(const LoadMatrix& load, const Layout& layout, const PolicyOptions& options);

}  // namespace eplb::placement
