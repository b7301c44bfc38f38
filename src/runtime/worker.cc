// The worker thread: for each rebalance, waits for the window, computes the placement and plan
// (compute.h), then stages the moved layers one by one (stage.h), each after the previous one
// was installed everywhere (Rebalancer::Impl).

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
#include "runtime/worker.h"
#include "runtime/cpu_wait.h"
#include "runtime/stage.h"

namespace eplb::runtime {
namespace {

// What a worker that failed leaves for the forward thread: its failure first, then (release)
// the failure in the progress value.
void worker_failed(Active& a, int rank, Failure failure) {
  a.failure = std::move(failure);
  a.progress.store(-1 - rank, std::memory_order_release);
}

}  // namespace

StageContext Rebalancer::Impl::stage_context(const std::atomic<bool>* cancel, int64_t index) {
  return {.weights = weights_, .cancel = cancel, .delay_hook = &delay_hook_,
          .progress = &progress_, .rebalance = index};
}

// -------------------------------------------------------------- worker thread
void WorkerThread::start(std::function<void(Active&)> run) {
  thread_ = std::thread([this, run = std::move(run)] {
    make_background_thread();
    for (;;) {
      std::shared_ptr<Active> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        job = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      run(*job);
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
      }
      idle_cv_.notify_all();
    }
  });
}

void WorkerThread::submit(std::shared_ptr<Active> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void WorkerThread::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void WorkerThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Rebalancer::Impl::run_job(Active& a) {
  const auto cancelled = [&] { return a.cancel.load(std::memory_order_acquire); };
  try {
    while (a.window.wait_for(std::chrono::milliseconds(2)) != std::future_status::ready) {
      if (cancelled()) return;
    }
    CollectiveResult result = a.window.get();  // a copy: the monitor may read it too
    std::vector<int64_t> window = std::move(result).take();
    const GainFigures gain = take_gain_figures(window, spec_.layers * config_.layout.experts);
    if (cancelled()) return;
    progress_.note(a.index, Phase::kPlacement);
    if (a.proposed) {  // every rank proposed this very placement, or every rank fails here
      while (a.proposal_check.wait_for(std::chrono::milliseconds(2)) !=
             std::future_status::ready) {
        if (cancelled()) return;
      }
      CollectiveResult check = a.proposal_check.get();
      check_agreed(std::move(check).take(), *a.proposed);
    }
    if (delay_hook_) delay_hook_(DelayPoint::kPlacement);
    a.plan = make_plan(window, a.current_phy2log, config_, spec_.expert_bytes(), a.elastic, gain,
                       a.proposed ? &*a.proposed : nullptr);
    progress_.note(a.index, Phase::kAgreeing);
    a.progress.store(1, std::memory_order_release);
    if (a.plan.skipped) return;
    BufferMap map = a.map;
    const StageContext context = stage_context(&a.cancel, a.index);
    for (size_t k = 0; k < a.plan.moved_layers.size(); ++k) {
      const int64_t layer = a.plan.moved_layers[k];
      progress_.note(a.index, Phase::kReading, layer);
      const auto read_start = Clock::now();
      if (!stage_layer(context, map, layer, a.plan.migrations[k])) return;
      // Before the progress that publishes the layer: the forward thread reads them at the end.
      a.read_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              Clock::now() - read_start).count(),
                          std::memory_order_relaxed);
      a.bytes_read.fetch_add(bytes_read_by(a.plan.migrations[k], seat_),
                             std::memory_order_relaxed);
      progress_.note(a.index, Phase::kAgreeing, layer);
      a.progress.store(2 + static_cast<int64_t>(k), std::memory_order_release);
      // One layer of staging: the next layer waits until this one is installed everywhere.
      std::unique_lock<std::mutex> lock(a.mu);
      a.cv.wait(lock, [&] { return a.installed > static_cast<int64_t>(k) || cancelled(); });
      if (cancelled()) return;
      if (weights_.swaps()) map.install(layer);
    }
  } catch (...) {
    worker_failed(a, seat_, Failure::current());
  }
}

}  // namespace eplb::runtime
