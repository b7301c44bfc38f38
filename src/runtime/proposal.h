#pragma once
// A placement computed elsewhere (Rebalancer::propose): the engine's own policy, or one planned
// offline. It is checked when proposed, waits on the forward thread, and is taken where the
// trigger starts a rebalance: that rebalance skips the placement computation and plans, stages,
// agrees and installs the proposal exactly as the runtime's own placements.
//
// Every rank proposes the same placement at the same step. The trigger proves it with one
// all-reduce (max) of this rank's agreement_values(), beside the window's, on the control
// thread; check_agreed() then finds, from the result alone and so alike on every rank, the step
// or the first layer and slot where two ranks differ, and the rebalance fails on every rank
// naming them.
//
// Threads: a Proposals object is the forward thread's (propose(), step_end(), reconfigure()).
// The functions below are pure.

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "eplb/core/types.h"
#include "runtime/compact_slots.h"
#include "runtime/failure.h"

namespace eplb::runtime {

// A proposal on the layout: `phy2log` [layers][width], width the layout's physical slots or the
// members' (`compact`, the engine's numbering above). Member slots take the proposal; the slots
// of seats that are no member keep `current` ([layers][physical]): nothing is placed there.
// InvalidArgument naming the value for a wrong shape, an expert outside [0, experts), or an
// expert of a layer that no member slot holds.
Placement checked_proposal(std::span<const int32_t> phy2log, int64_t layers, int64_t width,
                           const Layout& layout, const CompactSlots& compact,
                           std::span<const int32_t> current);

// What this rank contributes to the proposal check at the trigger (an all-reduce, max): every
// slot's expert, then its negation, then the step the proposal was made at and its negation:
// 2 * layers * physical + 2 values.
std::vector<int64_t> agreement_values(const Placement& proposal, int64_t step);
// After that all-reduce: InvalidArgument naming the steps, or the first layer and slot whose
// expert differs between ranks (the maximum and minimum proposed there).
void check_agreed(std::span<const int64_t> reduced, const Placement& proposal);

struct Active;
// The forward thread's own reading of a rebalance's proposal check, once the agreement says a
// rank failed: the refusal check_agreed() gives (the same on every rank, whether or not this
// rank's worker got to it), or none (no proposal, a check that passed or failed to run).
std::optional<Failure> proposal_refused(const Active& active);

// The proposal waiting for the next step_end() (forward thread).
class Proposals {
 public:
  struct Queued {
    Placement placement;  // on the layout, derived fields filled
    int64_t step = 0;     // step() when proposed
  };

  // Replaces any proposal not yet taken.
  void queue(Placement placement, int64_t step) { queued_ = Queued{std::move(placement), step}; }
  bool pending() const { return queued_.has_value(); }
  std::optional<Queued> take() { return std::exchange(queued_, std::nullopt); }

 private:
  std::optional<Queued> queued_;
};

}  // namespace eplb::runtime
