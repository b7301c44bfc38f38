#pragma once
// `sticky`: migration-aware placement. Finds a placement whose balancedness is within
// `tolerance` of balanced's on the same load while keeping as many slots as possible holding
// the expert they hold in `previous`. `previous` must have every slot hold an expert in
// [0, experts); an expert may have no slot in it (it lived on ranks that are gone): it gets one.

#include "eplb/core/types.h"

namespace eplb::placement {

// `thorough`: the balanced placement it is held to is balanced's with `thorough`.
Placement sticky(const LoadMatrix& load, const Layout& layout, const Placement& previous,
                 double tolerance, bool hierarchical, bool thorough = false);

// The checks sticky makes of `previous` (InvalidArgument naming the value and the rule): the
// shape of `load` on `layout`, and every slot of its phy2log holding an expert in
// [0, experts). Only phy2log is read, so replica_count and log2phy are not checked.
void check_previous(const Placement& previous, const LoadMatrix& load, const Layout& layout);

}  // namespace eplb::placement
