// The record of the rebalance in flight: closed when it ends, published (logged, counted, in
// the history, raised under on_error=raise) at the end of that step (Rebalancer::Impl).

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

void Rebalancer::Impl::close_open(std::optional<Failure> raise) {
  // A repair that completed (or found nothing to do) leaves every member slot filled.
  if (open_->repair && open_->outcome != Outcome::kFailed && open_->outcome != Outcome::kCancelled) {
    repair_pending_ = false;
  }
  if (open_->repair && open_->outcome == Outcome::kFailed) repair_failed_ = true;
  open_->end_step = step_;
  open_->steps = step_ - open_->trigger_step;
  open_->seconds = ms_between(open_started_, Clock::now()) / 1000.0;
  open_finished_ = true;
  raise_ = std::move(raise);
  progress_.finish();
  metrics_->set_age_steps(0);
}

void Rebalancer::Impl::fill_plan_figures(const RebalancePlan& plan) {
  open_->placement_ms = plan.placement_ms;
  open_->balancedness_before = plan.balancedness_before;
  open_->balancedness_after = plan.balancedness_after;
  open_->layers_moved = static_cast<int64_t>(plan.moved_layers.size());
  open_->slots_moved = plan.slots_moved;
  open_->bytes_intra_node = plan.bytes_intra_node;
  open_->bytes_inter_node = plan.bytes_inter_node;
  open_->bytes_local_copy = plan.bytes_local_copy;
  open_->rounds = plan.rounds;
}

void Rebalancer::Impl::publish_open() {
  RebalanceRecord record = std::move(*open_);
  open_.reset();
  open_finished_ = false;
  const std::optional<Failure> raise = std::exchange(raise_, std::nullopt);
  const auto level = record.outcome == Outcome::kFailed      ? spdlog::level::warn
                     : record.outcome == Outcome::kCompleted ? spdlog::level::info
                                                             : spdlog::level::debug;
  spdlog::log(level,
              "eplb runtime rank {}: rebalance {} {} at step {} (triggered at {}): "
              "balancedness {:.4f} -> {:.4f}, {} layers ({} installed), {} slots, "
              "{} B intra-node + {} B inter-node, {} rounds, {} steps, {:.3f} s, placement "
              "{:.2f} ms, stall {:.3f} ms (max {:.3f} ms){}{}",
              rank_, record.index, outcome_name(record.outcome), record.end_step,
              record.trigger_step, record.balancedness_before, record.balancedness_after,
              record.layers_moved, record.layers_installed, record.slots_moved,
              record.bytes_intra_node, record.bytes_inter_node, record.rounds, record.steps,
              record.seconds, record.placement_ms, record.stall_total_ms,
              record.stall_max_ms, record.error.empty() ? "" : ": ", record.error);
  metrics_->on_record(record);
  if (monitor_) monitor_->refresh();
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    history_.push_back(record);
  }
  if (record.outcome == Outcome::kFailed) {
    if (config_.on_failure) config_.on_failure(record);
    if (config_.on_error == OnError::kRaise && raise) raise->raise();
  }
}

void Rebalancer::Impl::fail_open(std::string message, std::optional<Failure> error) {
  open_->outcome = Outcome::kFailed;
  open_->error = std::move(message);
  close_open(error ? std::move(error) : Failure{FailureKind::kIoError, open_->error});
}

}  // namespace eplb::runtime
