#pragma once
// What a rebalance buys and what it costs (docs/dispatch.md, "A rebalance only when it pays"):
// the modeled MoE time per step of a placement on a window's loads, the price of moving to a new
// placement, and whether the gain over the next interval pays for it. The runtime's trigger,
// `eplb simulate --min-gain` and Python's `eplb.should_rebalance` all decide with these. Pure: no
// I/O, no threads.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "eplb/core/types.h"
#include "eplb/placement/cost.h"

namespace eplb::placement {

// The modeled MoE time of one step, in us, of `placement` serving `load` under `model`.
// `load` is [layers][experts]: each expert's tokens in one step, all ranks' together (a window's
// sums over its steps). Per layer: each expert's tokens split evenly over its replicas (a slot
// with none is idle), each rank's time (rank_us plus its activated slots' times), the layer
// time of those (CostModel::layer_time_us: the largest, or with noise the expected largest),
// summed over the layers; a layer with no load is dense and left out. `usable`
// ([layers][physical], nonzero: the slot serves; empty: every slot) leaves out the slots that do
// not serve: an expert's tokens go to its usable replicas (an expert with none drops them), and
// a rank with no usable slot in a layer takes no part in it. The split is what static, hash,
// split and weighted dispatch approach; adaptive dispatch does better on the placement in
// force, so the gain this predicts is the most a rebalance can buy under it.
// InvalidArgument where the shapes disagree.
double modeled_step_us(const CostModel& model, const LoadMatrix& load, const Placement& placement,
                       const Layout& layout, std::span<const uint8_t> usable = {});

// The price of a rebalance, in us of the serving loop's time: its bytes moved at the pull
// bandwidth, plus the stall it costs the serving loop.
struct RebalancePrice {
  double bytes = 0;        // bytes to move: remote reads, all ranks together
  double bytes_per_s = 0;  // the group's pull bandwidth (all ranks' reads together); 0: not known
  double stall_us = 0;     // the serving loop's stall
  // Known unless there are bytes to move and no bandwidth to move them at.
  bool known() const { return bytes_per_s > 0 || bytes == 0; }
  double us() const { return (bytes > 0 ? bytes / bytes_per_s * 1e6 : 0.0) + stall_us; }
  // InvalidArgument naming a figure that is negative, NaN or infinite.
  void validate() const;
};

// Whether a rebalance pays, and the figures it was decided on.
struct GainDecision {
  bool rebalance = true;
  double current_us = 0;   // modeled MoE time per step, the placement in force
  double proposed_us = 0;  // the same, the new placement
  int64_t steps = 0;       // the steps the gain is counted over (the interval)
  double gain_us = 0;      // (current_us - proposed_us) * steps
  double price_us = 0;     // RebalancePrice::us(); 0 when not known (priced is false)
  bool priced = false;     // the price was known
  double min_gain = 0;
  std::string reason;      // why it skips; empty when it rebalances
};

// Skips the rebalance when gain_us < min_gain * price_us. min_gain 0 never skips (what a
// rebalance did before it was priced); nor does a price not known yet (bytes to move and no
// bandwidth measured: the first rebalance of a runtime). InvalidArgument for a min_gain that is
// negative, NaN or infinite, steps < 1, times that are negative, NaN or infinite, or a bad price.
GainDecision decide_rebalance(double current_us, double proposed_us, int64_t steps,
                              const RebalancePrice& price, double min_gain);

// InvalidArgument naming `what` and the value unless min_gain is a finite number >= 0.
void check_min_gain(double min_gain, std::string_view what = "min_gain");

}  // namespace eplb::placement
