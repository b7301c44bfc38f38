#include "runtime/impl.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/plan.h"

// Rebalancer::Impl's async protocol (the forward thread's side of a rebalance that runs over
// the steps) and its worker thread (placement and staging off the forward thread).

namespace eplb::runtime {
namespace {

// What a worker that failed leaves for the forward thread: its failure first, then (release)
// the failure in the progress value.
void worker_failed(Active& a, int rank, Failure failure) {
  a.failure = std::move(failure);
  a.progress.store(-1 - rank, std::memory_order_release);
}

}  // namespace

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

std::function<void()> Rebalancer::Impl::installs_done() {
  if (!config_.installer) return {};
  return [installer = config_.installer, timeout = config_.timeout] {
    installer->wait_marked(timeout);
  };
}

void Rebalancer::Impl::trigger_async() {
  open_record();
  auto a = std::make_shared<Active>();
  a->index = open_->index;
  std::vector<int64_t> window(static_cast<size_t>(layers_ * config_.layout.experts));
  recorder_.snapshot_window(window);
  a->window = control_->all_reduce(std::move(window), control::ReduceOp::kSum,
                                   config_.timeout, installs_done())
                  .share();
  a->current_phy2log = phy2log_;
  a->map = map_;
  a->elastic = elastic_inputs();
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    worker_queue_.push_back(a);
  }
  worker_cv_.notify_one();
  active_ = std::move(a);
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

std::optional<int64_t> Rebalancer::Impl::take_agreement(PendingAgreement pending) {
  const auto broken = [&](std::string message, std::optional<Failure> error) {
    control_broken_.store(true, std::memory_order_release);
    end_active(std::move(message), std::move(error));
    return std::nullopt;
  };
  if (config_.agreement == Agreement::kExternal) {
    int64_t value = 0;
    {
      std::unique_lock<std::mutex> lock(external_mu_);
      ExternalResult& slot = external_[static_cast<size_t>(pending.step) % external_.size()];
      if (!external_cv_.wait_for(lock, config_.timeout,
                                 [&] { return slot.step == pending.step; })) {
        lock.unlock();
        return broken(detail::concat("the agreement result of step ", pending.step,
                                     " was not handed in (agreement_result) within ",
                                     config_.timeout.count(), " ms"),
                      std::nullopt);
      }
      value = slot.value;
    }
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
      end_active(detail::concat("rank ", rank_, ": ", a.failure.message), a.failure);
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
    open_->outcome = Outcome::kSkipped;
    open_->error = plan.skip_reason;
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
    open_->outcome = Outcome::kCompleted;
    close_open(std::nullopt);
    finish_active();
  }
}

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

StageContext Rebalancer::Impl::stage_context(const std::atomic<bool>* cancel, int64_t index) {
  StageContext context;
  context.transport = transport_;
  context.arena = &arena_;
  context.base = region_.data;
  context.peer_region = &peer_region_;
  context.peer_of_seat = &peer_of_seat_;
  context.self_peer = transport_->rank();
  context.backup_base = backup_region_.data;
  context.backup = &backup_;
  context.peer_backup_region = &peer_backup_region_;
  context.loader = &config_.backup.loader;
  context.layout = &config_.layout;
  context.rank = rank_;
  context.timeout = config_.timeout;
  context.delay_hook = &delay_hook_;
  context.cancel = cancel;
  context.installer = config_.installer.get();
  context.device_memory = transport_->capabilities().device_memory;
  context.own_region = region_.id;
  context.engine = spec_.engine_weights() ? &engine_ : nullptr;
  context.progress = &progress_;
  context.rebalance = index;
  return context;
}

// -------------------------------------------------------------- worker thread
void Rebalancer::Impl::worker_loop() {
  for (;;) {
    std::shared_ptr<Active> job;
    {
      std::unique_lock<std::mutex> lock(worker_mu_);
      worker_cv_.wait(lock, [&] { return worker_stop_ || !worker_queue_.empty(); });
      if (worker_stop_) return;
      job = std::move(worker_queue_.front());
      worker_queue_.pop_front();
      worker_busy_ = true;
    }
    run_job(*job);
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      worker_busy_ = false;
    }
    worker_idle_cv_.notify_all();
  }
}

void Rebalancer::Impl::run_job(Active& a) {
  const auto cancelled = [&] { return a.cancel.load(std::memory_order_acquire); };
  try {
    while (a.window.wait_for(std::chrono::milliseconds(2)) != std::future_status::ready) {
      if (cancelled()) return;
    }
    CollectiveResult result = a.window.get();  // a copy: the monitor may read it too
    const std::vector<int64_t> window = std::move(result).take();
    if (cancelled()) return;
    progress_.note(a.index, Phase::kPlacement);
    if (delay_hook_) delay_hook_(DelayPoint::kPlacement);
    a.plan = make_plan(window, a.current_phy2log, config_, spec_.expert_bytes(), a.elastic);
    progress_.note(a.index, Phase::kAgreeing);
    a.progress.store(1, std::memory_order_release);
    if (a.plan.skipped) return;
    BufferMap map = a.map;
    const StageContext context = stage_context(&a.cancel, a.index);
    for (size_t k = 0; k < a.plan.moved_layers.size(); ++k) {
      const int64_t layer = a.plan.moved_layers[k];
      progress_.note(a.index, Phase::kReading, layer);
      if (!stage_layer(context, map, layer, a.plan.migrations[k])) return;
      progress_.note(a.index, Phase::kAgreeing, layer);
      a.progress.store(2 + static_cast<int64_t>(k), std::memory_order_release);
      // One layer of staging: the next layer waits until this one is installed everywhere.
      std::unique_lock<std::mutex> lock(a.mu);
      a.cv.wait(lock, [&] { return a.installed > static_cast<int64_t>(k) || cancelled(); });
      if (cancelled()) return;
      if (swaps()) map.install(layer);
    }
  } catch (...) {
    worker_failed(a, rank_, Failure::current());
  }
}

}  // namespace eplb::runtime
