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

#include <string>
#include <string_view>

#include "eplb/core/types.h"

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
  // sticky: required, the placement in force now (same layers, experts, physical). balanced
  // reads it only for its dense layers (no load), which keep it.
  const Placement* previous = nullptr;
};

// Places every layer of `load` on `layout`. Validates layout, load and options first
// (InvalidArgument naming the bad value).
Placement place(const LoadMatrix& load, const Layout& layout, const PolicyOptions& options);

}  // namespace eplb::placement
