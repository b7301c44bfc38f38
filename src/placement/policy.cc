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
    case Policy::kBalanced: return balanced(load, layout, options.hierarchical);
    case Policy::kSticky:
      if (options.previous == nullptr) {
        fail("policy sticky needs the previous placement (--previous FILE)");
      }
      return sticky(load, layout, *options.previous, options.tolerance, options.hierarchical);
  }
  fail("unknown policy");
}

}  // namespace eplb::placement
