#pragma once
// sticky's Step 2 (sticky.cc): a fresh placement of one layer relabelled onto the previous one.
// Its ranks are matched to the previous ranks so that most experts stay on their rank
// (Hungarian assignment up to 32 ranks, greedy by overlap past that), and each expert that
// stays keeps its old slot. Hierarchical: nodes are matched first (whole nodes keep their
// groups together), then ranks within each matched pair of nodes.

#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::placement {

// fresh, prev: [physical] of one layer on `layout`. Returns [physical]: fresh's ranks, each
// written into the previous rank it is matched with. An expert may have no slot in `prev`.
std::vector<int32_t> relabel(std::span<const int32_t> fresh, std::span<const int32_t> prev,
                             const Layout& layout, bool hierarchical);

}  // namespace eplb::placement
