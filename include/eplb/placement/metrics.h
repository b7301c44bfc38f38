#pragma once
// Metrics of a placement under a load (docs/design.md): rank loads, balancedness, the lower bound,
// moved slots. Replicas share their expert's load equally.
//
// A layer with no load at all is a dense layer (DeepSeek-V3's first three, which SGLang's
// statistics list as all-zero rows): it has nothing to balance, so it is left out of every mean
// over layers rather than counted as perfectly balanced. Its own per-layer figures are 1.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::placement {

// Load of each rank of one layer: sum over its slots of w[e] / replica_count[e]. [ranks]
std::vector<double> rank_loads(std::span<const double> load, std::span<const int32_t> phy2log,
                               const Layout& layout);

// Mean rank load / max rank load of one layer, in (0, 1]; 1 for an all-zero layer.
double layer_balancedness(std::span<const double> load, std::span<const int32_t> phy2log,
                          const Layout& layout);

// A lower bound on the max rank load any placement can reach on one layer:
// max(total / G, min over replica counts summing to P of max_e w_e / r_e), the optimum itself
// with one slot per rank; with two, also what pairing the replicas costs (every replica needs a
// partner: placement/two_slots.h), within 0.3% of balanced on lognormal loads at 144 ranks.
double layer_lower_bound(std::span<const double> load, const Layout& layout);

// Slots whose expert differs between two placements of the same shape (all layers).
int64_t moved_slots(const Placement& before, const Placement& after);

struct PlacementMetrics {
  std::vector<double> balancedness;        // [layers]
  std::vector<double> lower_bound_balancedness;  // [layers]: mean rank load / lower bound
  std::vector<double> mean_rank_load;      // [layers]
  std::vector<double> max_rank_load;       // [layers]
  std::vector<char> dense;                 // [layers]: 1 where the layer has no load
  int64_t moe_layers = 0;                  // layers with load (the means' denominator)
  double balancedness_mean = 1;            // mean over layers with load (1 when none has)
  double balancedness_step = 1;            // sum_l mean_l / sum_l max_l
  double lower_bound_mean = 1;             // mean of lower_bound_balancedness, layers with load
  int64_t moved = -1;                      // vs previous, -1 when none given
  std::vector<int64_t> moved_per_layer;    // [layers], empty when no previous
};

// `with_bound` false leaves the lower-bound figures at 1 without computing them: at two slots
// per rank the bound is a bisection with a subgradient ascent per step (up to 10-30 ms per
// layer), which callers after balancedness alone (the runtime's plans and monitor) should not
// pay.
PlacementMetrics evaluate(const LoadMatrix& load, const Placement& placement, const Layout& layout,
                          const Placement* previous = nullptr, bool with_bound = true);

// The metrics of `placement` on `load` over the slots that serve (elastic serving): the seats
// in `members` (ascending; empty: every rank) as a layout of their own, the other seats serving
// no token. Empty when some expert has no `usable` slot ([layers][physical], nonzero: valid
// weights; empty: all) on a member: the placement cannot serve every token. The runtime's plans
// predict, and its monitor measures, the balancedness this way (without the lower bound).
std::optional<PlacementMetrics> served_metrics(const LoadMatrix& load, const Placement& placement,
                                               const Layout& layout,
                                               std::span<const int32_t> members,
                                               std::span<const uint8_t> usable);

}  // namespace eplb::placement
