// The async protocol on the forward thread: once per step this rank's progress goes into the
// agreement, and the agreed value of step s - lag decides, on every rank alike, whether to wait,
// install the next layer, end the rebalance or abandon it (Rebalancer::Impl; docs/runtime.md,
// "The async protocol").

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "eplb/core/error.h"
#include "runtime/compute.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/impl.h"
#include "runtime/stage.h"

namespace eplb::runtime {

// The longest the forward thread waits for a collective's result: each queued collective
// (at most lag + 1 agreements, a window, a proposal's check behind it, and a balancedness
// window before it) is bounded by the timeout itself.
std::chrono::milliseconds Rebalancer::Impl::result_bound() const {
  // A balancedness window only runs while no rebalance does: at most one ahead of a window.
  return config_.timeout * (config_.lag + 5);
}

int64_t Rebalancer::Impl::agreement_contribution() const {
  return contribution_.load(std::memory_order_acquire);
}

void Rebalancer::Impl::agreement_result(int64_t step, int64_t min_value) {
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

// -------------------------------------------------------------- async protocol
void Rebalancer::Impl::step_end_async() {
  if (active_) advance_async();
  if (!active_ && should_trigger()) trigger_async();
  if (active_) {
    submit_agreement();
  } else {
    contribution_.store(kNoAgreement, std::memory_order_release);
  }
}

void Rebalancer::Impl::submit_agreement() {
  const int64_t progress = active_->progress.load(std::memory_order_acquire);
  PendingAgreement pending;
  pending.step = step_;
  pending.mine = progress;
  if (config_.agreement == Agreement::kInternal) {
    pending.result = control_->all_reduce({progress}, control::ReduceOp::kMin, config_.timeout);
  }
  agreements_.push_back(std::move(pending));
  contribution_.store(progress, std::memory_order_release);
}

// The agreed value of `pending`, waiting for it within its bound. When there is none (a
// failed or late collective, a missing or impossible external result) the rebalance is
// abandoned here and nothing is returned: the agreement can no longer be trusted to be the
// same on every rank, so no rebalance triggers again.
std::optional<int64_t> Rebalancer::Impl::take_agreement(PendingAgreement pending) {
  const auto broken = [&](std::string message, std::optional<Failure> error) {
    control_broken_.store(true, std::memory_order_release);
    end_active(std::move(message), std::move(error));
    return std::nullopt;
  };
  if (config_.agreement == Agreement::kExternal) {
    const std::optional<int64_t> taken = external_.take(pending.step, config_.timeout);
    if (!taken) {
      return broken(detail::concat("the agreement result of step ", pending.step,
                                   " was not handed in (agreement_result) within ",
                                   config_.timeout.count(), " ms"),
                    std::nullopt);
    }
    const int64_t value = *taken;
    if (value > pending.mine) {
      return broken(detail::concat("agreement_result(", pending.step, ", ", value,
                                   ") is above this rank's contribution ", pending.mine,
                                   ": it must be the minimum over all ranks of "
                                   "agreement_contribution()"),
                    std::nullopt);
    }
    return value;
  }
  if (pending.result.wait_for(result_bound()) != std::future_status::ready) {
    return broken(detail::concat("the agreement of step ", pending.step,
                                 " gave no result within ", result_bound().count(), " ms"),
                  std::nullopt);
  }
  CollectiveResult result = pending.result.get();
  if (result.failure) {
    std::string message = detail::concat("the agreement of step ", pending.step, " failed: ",
                                         result.failure->message);
    return broken(std::move(message), std::move(result.failure));
  }
  return result.values.at(0);
}

void Rebalancer::Impl::advance_async() {
  Active& a = *active_;
  if (agreements_.empty() || agreements_.front().step != step_ - config_.lag) return;
  PendingAgreement pending = std::move(agreements_.front());
  agreements_.pop_front();
  const std::optional<int64_t> result = take_agreement(std::move(pending));
  if (!result) return;
  const int64_t agreed = *result;
  if (agreed < 0) {
    const int64_t failed_rank = -1 - agreed;
    if (a.progress.load(std::memory_order_acquire) < 0) {
      end_active(detail::concat("rank ", seat_, ": ", a.failure.message), a.failure);
    } else if (std::optional<Failure> refused = proposal_refused(a)) {
      // A rank whose worker has not read the check yet says the same as the ones that have.
      // The message first: the two arguments are built in no set order.
      std::string message = detail::concat("rank ", seat_, ": ", refused->message);
      end_active(std::move(message), std::move(refused));
    } else {
      end_active(detail::concat("rank ", failed_rank, " failed (its log has the error)"),
                 std::nullopt);
    }
    return;
  }
  if (agreed == 0) return;  // some rank is still placing
  // Every rank has the (same) plan: this rank's own contribution was >= 1, loaded with
  // acquire after the worker wrote the plan.
  RebalancePlan& plan = a.plan;
  if (!a.figures_filled) {
    fill_plan_figures(plan);
    a.figures_filled = true;
  }
  if (plan.skipped) {
    records_.open->outcome = Outcome::kSkipped;
    records_.open->error = plan.skip_reason;
    close_open(std::nullopt);
    finish_active();
    return;
  }
  const int64_t moved = static_cast<int64_t>(plan.moved_layers.size());
  if (a.installed_fwd < agreed - 1 && a.installed_fwd < moved) {
    install(plan, a.installed_fwd);
    ++a.installed_fwd;
    {
      std::lock_guard<std::mutex> lock(a.mu);
      a.installed = a.installed_fwd;
    }
    a.cv.notify_one();
  }
  if (a.installed_fwd == moved) {
    records_.open->bytes_read = a.bytes_read.load(std::memory_order_relaxed);
    records_.open->read_ms = static_cast<double>(a.read_ns.load(std::memory_order_relaxed)) / 1e6;
    records_.open->outcome = Outcome::kCompleted;
    close_open(std::nullopt);
    finish_active();
  }
}

// Abandons the running rebalance at this step: layers installed so far stay (they are
// complete on every rank), the others keep their old buffers and tables.
//
// The record keeps the plan's figures only if an agreement proved every rank had the plan
// (figures_filled): filling them from this rank's own plan would make the records of ranks
// whose workers were at different points differ.
void Rebalancer::Impl::end_active(std::string message, std::optional<Failure> error) {
  fail_open(std::move(message), std::move(error));
  cancel_worker(*active_);
  finish_active();
}

void Rebalancer::Impl::finish_active() {
  active_.reset();
  // Agreements still queued run on every rank alike; their results are not needed.
  agreements_.clear();
}

void Rebalancer::Impl::cancel_worker(Active& a) {
  {
    std::lock_guard<std::mutex> lock(a.mu);
    a.cancel.store(true, std::memory_order_release);
  }
  a.cv.notify_one();
}

}  // namespace eplb::runtime
