#pragma once
// The public DeepSeek EPLB algorithm (deepseek-ai/EPLB `rebalance_experts`), restated.
// Same outputs as the reference for inputs without ties: the arithmetic is float32 like the
// reference's (loads, per-replica loads, pack sums), and log2phy orders replicas by creation.

#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::placement {

// Hierarchical when layout.groups % layout.nodes == 0, global (one group, one node) otherwise.
Placement deepseek(const LoadMatrix& load, const Layout& layout);

// The replica counts deepseek gives one layer's loads `w` [experts] over `slots` slots when it
// is global (layout.groups % layout.nodes != 0, or one group on one node): its Step 2, in its
// float32 arithmetic (each further replica to the largest w / count, lowest expert on a tie).
// [experts]
std::vector<int32_t> deepseek_global_counts(std::span<const double> w, int64_t slots);

}  // namespace eplb::placement
