#pragma once
// A rebalance only when it pays, the runtime's half (placement/gain.h has the decision;
// docs/runtime.md, "A rebalance only when it pays"). Every rank must decide alike, so nothing a
// rank measured alone decides: at a trigger each rank appends to its window, before the window
// all-reduce (a sum), what it knows that the decision needs (the steps its window holds, the
// bytes it read in the last completed rebalance and the time those reads took, that rebalance's
// stall, and its cost model), and every rank decides from the sums: the same figures everywhere.
//
//   GainBook      what this rank appends (the forward thread's: it keeps the last completed
//                 rebalance's figures as records are published, and writes the tail at a trigger)
//   GainFigures   what the all-reduced tail says, the same on every rank
//   check_gain    the decision on a plan (make_plan, on the worker or in sync mode the forward
//                 thread): pure
//
// The tail holds kGainTail int64 values after the window's [layers][experts] loads.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/gain.h"
#include "eplb/runtime/config.h"
#include "eplb/runtime/record.h"

namespace eplb::runtime {

// [0] 1 per rank, [1] steps in the window, [2] bytes read, [3] their ns, [4] stall ns,
// [5] 1 with a model, [6..11] the model's rank_us, slot_us, token_us, knee_tokens,
// token_us_above and noise, in fixed point (kGainUnit per us, per token, per unit of noise).
inline constexpr int64_t kGainTail = 12;
inline constexpr double kGainUnit = 1 << 20;

// What the all-reduced tail says: the same on every rank.
struct GainFigures {
  int64_t ranks = 0;          // ranks that contributed
  double window_steps = 0;    // the mean of the ranks' steps in the window
  double bytes_per_s = 0;     // bytes read by all ranks over the mean rank's read time; 0: none
  double stall_us = 0;        // the mean rank's stall
  std::optional<placement::CostModel> model;  // the mean of the ranks' models; none: no rank had one
};

// The forward thread's: what this rank appends to its window at a trigger.
class GainBook {
 public:
  explicit GainBook(std::optional<placement::CostModel> model) : model_(std::move(model)) {}
  // The model the next trigger decides with (validated by the caller).
  void set_model(placement::CostModel model) { model_ = std::move(model); }
  const std::optional<placement::CostModel>& model() const { return model_; }
  // A record just published: a completed rebalance that read bytes becomes the one whose
  // bandwidth and stall price the next (in sync mode its stall less its reads, which it made on
  // the forward thread).
  void on_record(const RebalanceRecord& record, Mode mode);
  // Appends this rank's tail (kGainTail values) to `window`.
  void append(std::vector<int64_t>& window, int64_t window_steps) const;

 private:
  std::optional<placement::CostModel> model_;
  int64_t bytes_read_ = 0;
  int64_t read_ns_ = 0;
  int64_t stall_ns_ = 0;
};

// Splits an all-reduced window of `loads` values plus the tail into the loads (the window,
// resized) and what the tail says. A window without the tail (exactly `loads` values) gives
// figures of no rank.
GainFigures take_gain_figures(std::vector<int64_t>& window, int64_t loads);

// The decision on a rebalance from the placement in force to `after` (placement/gain.h):
// per-step loads are the window's over its steps, the model the figures' (else the tokens
// preset), the price the plan's `bytes` at the figures' bandwidth plus their stall, the gain
// counted over `config.interval` steps. `usable_before` / `usable_after` ([layers][physical],
// empty: every slot) are the slots that serve under each placement. None when min_gain is 0.
std::optional<placement::GainDecision> check_gain(const LoadMatrix& window, const Placement& before,
                                                  const Placement& after,
                                                  std::span<const uint8_t> usable_before,
                                                  std::span<const uint8_t> usable_after,
                                                  int64_t bytes, const GainFigures& figures,
                                                  const Config& config);

}  // namespace eplb::runtime
