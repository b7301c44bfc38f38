#pragma once
// `balanced`: replica counts that minimise the largest per-replica load, packing with never two
// replicas of one expert on a rank, then local search (moves and swaps off the most loaded rank)
// until it stops helping. With `hierarchical`, groups are packed to nodes first, as deepseek does.

#include "eplb/core/types.h"

namespace eplb::placement {

Placement balanced(const LoadMatrix& load, const Layout& layout, bool hierarchical);

}  // namespace eplb::placement
