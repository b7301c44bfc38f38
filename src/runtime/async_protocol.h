#pragma once
// The async step protocol (docs/runtime.md, "The async protocol"): the rebalance in flight, the
// agreements this rank contributed and has not yet acted on, the contribution an external
// agreement reads, the results handed in for it, whether the control plane broke, and the step
// a result may be handed in for. Once per step the forward thread contributes the rebalance's
// progress (contribute()); the agreed minimum of step s comes back at step s + lag (take_due())
// and says, the same on every rank, whether to wait, install the next layer, end the rebalance
// or abandon it. Rebalancer::Impl's step driver (agree.cc) acts on it: records and installs.
//
// Threads. The forward thread owns the rebalance in flight and the queue of agreements
// (start(), contribute(), take_due(), hand_over(), finish(), drop_agreements()). The worker
// shares the Active itself (in_flight.h says how). contribution(), hand_in() and
// control_broken() are for any thread (atomics, and ExternalAgreement's mutex).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "eplb/runtime/config.h"
#include "runtime/control_thread.h"
#include "runtime/external_agreement.h"
#include "runtime/failure.h"
#include "runtime/in_flight.h"

namespace eplb::runtime {

class AsyncProtocol {
 public:
  // Config's lag, timeout and agreement (internal or external) are read; `config` must outlive
  // the protocol.
  explicit AsyncProtocol(const Config& config);

  // ---- The rebalance in flight (forward thread).
  Active* active() const { return active_.get(); }
  // Hands `active` to the protocol; the worker has it already.
  void start(std::shared_ptr<Active> active) { active_ = std::move(active); }
  // Tells the worker that layer `installed` - 1 is installed everywhere (it stages the next).
  static void hand_over(Active& active, int64_t installed);
  // Tells the worker to stop; it lets go of the rebalance at its next check.
  static void cancel_worker(Active& active);
  // The rebalance is over: forgotten, and the agreements still queued (they run on every rank
  // alike; their results are not needed). finish(true) cancels the worker first.
  void finish(bool cancel);

  // ---- Agreements (forward thread).
  // At the end of step `step`: the progress of the rebalance in flight goes into the agreement
  // (an all-reduce, min, on `control`; or, external, the engine's collective), or, with no
  // rebalance in flight, no agreement is contributed (`control` may then be null).
  void contribute(int64_t step, ControlThread* control);
  // What the agreement of step `step` - lag says, if it is due now.
  struct Agreed {
    bool due = false;     // an agreement of that step was contributed
    bool failed = false;  // a rank failed, or the agreement could not be had: abandon
    int64_t value = 0;    // due and not failed: the agreed minimum (0: still placing)
    std::string message;  // failed: for the record
    std::optional<Failure> error;  // failed: what step_end raises (none: an IoError)
  };
  // `seat`: this rank, named in the record when its own worker failed. When the agreement
  // cannot be had (a failed or late collective, a missing or impossible external result) the
  // control plane is marked broken: no rank can trust it to be the same everywhere any more.
  Agreed take_due(int64_t step, int seat);
  // Nothing queued and no contribution (reconfigure(): the old group's agreements).
  void drop_agreements();
  // The longest the forward thread waits for a collective's result: each queued collective (at
  // most lag + 1 agreements, a window, a proposal's check behind it, and a balancedness window
  // before it) is bounded by the timeout itself.
  std::chrono::milliseconds result_bound() const;

  // ---- Any thread.
  // This rank's contribution to the agreement of the last step (kNoAgreement: none).
  int64_t contribution() const { return contribution_.load(std::memory_order_acquire); }
  // agreement_result(): InvalidArgument unless the agreement is external and `step` ended.
  void hand_in(int64_t step, int64_t min_value);
  // The step a result may be handed in for, at most (forward thread, at each step's end).
  void publish_step(int64_t step) { published_step_.store(step, std::memory_order_release); }
  bool control_broken() const { return control_broken_.load(std::memory_order_acquire); }
  void set_control_broken(bool broken) {
    control_broken_.store(broken, std::memory_order_release);
  }

 private:
  // The agreed value of `pending`, waiting for it within its bound; none when the agreement
  // cannot be had (`message` and `error` then say why).
  std::optional<int64_t> take(PendingAgreement pending, std::string& message,
                              std::optional<Failure>& error);

  const Config& config_;
  std::shared_ptr<Active> active_;           // the rebalance in flight (in_flight.h)
  std::deque<PendingAgreement> agreements_;  // by step
  std::atomic<int64_t> contribution_{kNoAgreement};
  std::atomic<int64_t> published_step_{0};  // step(), for hand_in's check
  std::atomic<bool> control_broken_{false};
  ExternalAgreement external_;  // results of an external agreement, handed in by any thread
};

}  // namespace eplb::runtime
