#include "eplb/placement/policy.h"

#include "eplb/core/error.h"
#include "eplb/placement/balanced.h"
#include "eplb/placement/deepseek.h"
#include "eplb/placement/sticky.h"

namespace eplb::placement {

Policy parse_policy(std::string_view name) {
  if (name == "deepseek") return Policy::kDeepseek;
  if (name == "balanced") return Policy::kBalanced;
  if (name == "sticky") return Policy::kSticky;
  fail("unknown policy '", name, "' (expected deepseek, balanced or sticky)");
}

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kDeepseek: return "deepseek";
    case Policy::kBalanced: return "balanced";
    case Policy::kSticky: return "sticky";
  }
  return "?";
}

namespace {

// A layer without load is a dense layer (metrics.h): any placement balances it, so it gets the
// one that costs nothing, the previous placement where one is given (no slot moves; balanced
// takes one too, if only for this), else the trivial one. deepseek is left as the reference
// computes it (identical outputs).
Placement place_dense_layers(const LoadMatrix& load, Placement placement,
                             const Placement* previous) {
  bool changed = false;
  for (int64_t l = 0; l < load.layers; ++l) {
    double total = 0;
    for (const double w : load.row(l)) total += w;
    if (total > 0) continue;
    int32_t* slots = placement.phy2log.data() + l * placement.physical;
    for (int64_t p = 0; p < placement.physical; ++p) {
      slots[p] = previous != nullptr ? previous->layer_phy2log(l)[static_cast<size_t>(p)]
                                     : static_cast<int32_t>(p % placement.experts);
    }
    changed = true;
  }
  if (changed) placement.derive_from_phy2log();
  return placement;
}

}  // namespace

Placement place(const LoadMatrix& load, const Layout& layout, const PolicyOptions& options) {
  layout.validate();
  load.validate();
  if (load.experts != layout.experts) {
    fail("the load has ", load.experts, " experts per layer but the layout has ", layout.experts);
  }
  if (!(options.tolerance >= 0 && options.tolerance < 1)) {
    fail("tolerance ", options.tolerance, " must be in [0, 1) (a loss of balancedness)");
  }
  if (options.previous != nullptr) {
    const Placement& prev = *options.previous;
    if (prev.layers != load.layers || prev.experts != layout.experts ||
        prev.physical != layout.physical) {
      fail("the previous placement has ", prev.layers, " layers, ", prev.experts, " experts, ",
           prev.physical, " physical slots; the new one needs ", load.layers, ", ",
           layout.experts, ", ", layout.physical);
    }
    prev.validate();
  }
  switch (options.policy) {
    case Policy::kDeepseek: return deepseek(load, layout);
    case Policy::kBalanced:
      return place_dense_layers(load, balanced(load, layout, options.hierarchical),
                                options.previous);
    case Policy::kSticky:
      if (options.previous == nullptr) {
        fail("policy sticky needs the previous placement (--previous FILE)");
      }
      return place_dense_layers(
          load, sticky(load, layout, *options.previous, options.tolerance, options.hierarchical),
          options.previous);
  }
  fail("unknown policy");
}

}  // namespace eplb::placement
