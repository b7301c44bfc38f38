#pragma once
// The public DeepSeek EPLB algorithm (deepseek-ai/EPLB `rebalance_experts`), restated.
// Same outputs as the reference for inputs without ties: the arithmetic is float32 like the
// reference's (loads, per-replica loads, pack sums), and log2phy orders replicas by creation.

#include "eplb/core/types.h"

namespace eplb::placement {

// Hierarchical when layout.groups % layout.nodes == 0, global (one group, one node) otherwise.
Placement deepseek(const LoadMatrix& load, const Layout& layout);

}  // namespace eplb::placement
