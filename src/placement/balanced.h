#pragma once
// `balanced`: replica counts that minimise the largest per-replica load, packing with never two
// replicas of one expert on a rank, then local search (moves and swaps off the most loaded rank)
// until it stops helping. With `hierarchical`, groups are packed to nodes first, as deepseek does.

#include <cstdint>
#include <span>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/cost.h"

namespace eplb::placement {

// `thorough`: at two slots per rank, also build the replica counts level by level (see
// PolicyOptions::thorough).
Placement balanced(const LoadMatrix& load, const Layout& layout, bool hierarchical,
                   bool thorough = false);

// balanced's placement of one layer `w` [experts]: phy2log [physical], the same as layer 0 of
// balanced() on a one-layer load. The inputs are not checked (check_balanced_inputs): sticky
// checks them once for all its layers and asks for balanced's layers one at a time.
std::vector<int32_t> balanced_layer(std::span<const double> w, const Layout& layout,
                                    bool hierarchical, bool thorough = false);

// The checks balanced makes of its inputs (InvalidArgument naming the value and the rule): the
// layout, the load, and that a rank never needs two replicas of one expert.
void check_balanced_inputs(const LoadMatrix& load, const Layout& layout, bool hierarchical);

// `balanced` under a cost model (cost_placement.cc): replica counts that add a replica only
// where it lowers the estimated busiest rank time (each replica pays the model's fixed part when
// a step activates it), spares for the rest, packed by modeled time. `load` sums `steps` steps
// (its per-step tokens are what the model prices). Not hierarchical. InvalidArgument for a bad
// model or steps < 1, and balanced's checks.
Placement balanced_cost(const LoadMatrix& load, const Layout& layout, const CostModel& model,
                        int64_t steps);

}  // namespace eplb::placement
