// The async step protocol (async_protocol.h).

#include "runtime/async_protocol.h"

#include <future>
#include <mutex>
#include <utility>

#include "eplb/core/error.h"
#include "runtime/proposal.h"

namespace eplb::runtime {

AsyncProtocol::AsyncProtocol(const Config& config) : config_(config), external_(config.lag) {}

void AsyncProtocol::hand_over(Active& active, int64_t installed) {
  {
    std::lock_guard<std::mutex> lock(active.mu);
    active.installed = installed;
  }
  active.cv.notify_one();
}

void AsyncProtocol::cancel_worker(Active& active) {
  {
    std::lock_guard<std::mutex> lock(active.mu);
    active.cancel.store(true, std::memory_order_release);
  }
  active.cv.notify_one();
}

void AsyncProtocol::finish(bool cancel) {
  if (cancel && active_) cancel_worker(*active_);
  active_.reset();
  agreements_.clear();
}

void AsyncProtocol::contribute(int64_t step, ControlThread* control) {
  if (!active_) {
    contribution_.store(kNoAgreement, std::memory_order_release);
    return;
  }
  const int64_t progress = active_->progress.load(std::memory_order_acquire);
  PendingAgreement pending;
  pending.step = step;
  pending.mine = progress;
  if (config_.agreement == Agreement::kInternal) {
    pending.result = control->all_reduce({progress}, control::ReduceOp::kMin, config_.timeout);
  }
  agreements_.push_back(std::move(pending));
  contribution_.store(progress, std::memory_order_release);
}

void AsyncProtocol::drop_agreements() {
  agreements_.clear();
  contribution_.store(kNoAgreement, std::memory_order_release);
}

std::chrono::milliseconds AsyncProtocol::result_bound() const {
  // A balancedness window only runs while no rebalance does: at most one ahead of a window.
  return config_.timeout * (config_.lag + 5);
}

AsyncProtocol::Agreed AsyncProtocol::take_due(int64_t step, int seat) {
  Agreed agreed;
  if (agreements_.empty() || agreements_.front().step != step - config_.lag) return agreed;
  agreed.due = true;
  PendingAgreement pending = std::move(agreements_.front());
  agreements_.pop_front();
  const std::optional<int64_t> result = take(std::move(pending), agreed.message, agreed.error);
  if (!result) {
    control_broken_.store(true, std::memory_order_release);
    agreed.failed = true;
    return agreed;
  }
  agreed.value = *result;
  if (agreed.value >= 0) return agreed;
  agreed.failed = true;
  const Active& a = *active_;
  if (a.progress.load(std::memory_order_acquire) < 0) {
    agreed.message = detail::concat("rank ", seat, ": ", a.failure.message);
    agreed.error = a.failure;
  } else if (std::optional<Failure> refused = proposal_refused(a)) {
    // A rank whose worker has not read the check yet says the same as the ones that have.
    agreed.message = detail::concat("rank ", seat, ": ", refused->message);
    agreed.error = std::move(refused);
  } else {
    agreed.message = detail::concat("rank ", -1 - agreed.value, " failed (its log has the error)");
  }
  return agreed;
}

std::optional<int64_t> AsyncProtocol::take(PendingAgreement pending, std::string& message,
                                           std::optional<Failure>& error) {
  if (config_.agreement == Agreement::kExternal) {
    const std::optional<int64_t> taken = external_.take(pending.step, config_.timeout);
    if (!taken) {
      message = detail::concat("the agreement result of step ", pending.step,
                               " was not handed in (agreement_result) within ",
                               config_.timeout.count(), " ms");
      return std::nullopt;
    }
    if (*taken > pending.mine) {
      message = detail::concat("agreement_result(", pending.step, ", ", *taken,
                               ") is above this rank's contribution ", pending.mine,
                               ": it must be the minimum over all ranks of "
                               "agreement_contribution()");
      return std::nullopt;
    }
    return *taken;
  }
  if (pending.result.wait_for(result_bound()) != std::future_status::ready) {
    message = detail::concat("the agreement of step ", pending.step, " gave no result within ",
                             result_bound().count(), " ms");
    return std::nullopt;
  }
  CollectiveResult result = pending.result.get();
  if (result.failure) {
    message = detail::concat("the agreement of step ", pending.step, " failed: ",
                             result.failure->message);
    error = std::move(result.failure);
    return std::nullopt;
  }
  return result.values.at(0);
}

void AsyncProtocol::hand_in(int64_t step, int64_t min_value) {
  if (config_.agreement != Agreement::kExternal) {
    fail("agreement_result(): this runtime's agreement is internal (it runs on the control "
         "plane); set Config::agreement = external to hand results in");
  }
  const int64_t now = published_step_.load(std::memory_order_acquire);
  if (step < 0 || step > now) {
    fail("agreement_result(step ", step, "): step() is ", now, "; hand in the result of a "
         "step after the step_end() that ended it");
  }
  external_.hand_in(step, min_value);
}

}  // namespace eplb::runtime
