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

// Ends the open record at this step; `raise` is what step_end throws under on_error=raise.
void Rebalancer::Impl::close_open(std::optional<Failure> raise) {
  // A repair that completed (or found nothing to do) leaves every member slot filled.
  if (records_.open->repair) group_.repair_ended(records_.open->outcome);
  records_.end(step_, std::move(raise));
  progress_.finish();
  metrics_->set_age_steps(0);
}

void Rebalancer::Impl::fill_plan_figures(const RebalancePlan& plan) {
  if (plan.gain) {
    RebalanceRecord& r = *records_.open;
    r.gain_checked = true;
    r.below_min_gain = !plan.gain->rebalance;
    r.moe_us_before = plan.gain->current_us;
    r.moe_us_after = plan.gain->proposed_us;
    r.gain_us = plan.gain->gain_us;
    r.price_us = plan.gain->price_us;
    r.priced = plan.gain->priced;
  }
  records_.open->placement_ms = plan.placement_ms;
  records_.open->balancedness_before = plan.balancedness_before;
  records_.open->balancedness_after = plan.balancedness_after;
  records_.open->layers_moved = static_cast<int64_t>(plan.moved_layers.size());
  records_.open->slots_moved = plan.slots_moved;
  records_.open->bytes_intra_node = plan.bytes_intra_node;
  records_.open->bytes_inter_node = plan.bytes_inter_node;
  records_.open->bytes_local_copy = plan.bytes_local_copy;
  records_.open->rounds = plan.rounds;
}

// Logs, calls back, appends to the history and, under on_error=raise, throws.
void Rebalancer::Impl::publish_open() {
  std::optional<Failure> raise;
  const RebalanceRecord record = records_.publish(raise);
  gain_book_.on_record(record, config_.mode);
  const auto level = record.outcome == Outcome::kFailed      ? spdlog::level::warn
                     : record.outcome == Outcome::kCompleted ? spdlog::level::info
                                                             : spdlog::level::debug;
  spdlog::log(level,
              "eplb runtime rank {}: rebalance {} {} at step {} (triggered at {}): "
              "balancedness {:.4f} -> {:.4f}, {} layers ({} installed), {} slots, "
              "{} B intra-node + {} B inter-node, {} rounds, {} steps, {:.3f} s, placement "
              "{:.2f} ms, stall {:.3f} ms (max {:.3f} ms){}{}",
              seat_, record.index, outcome_name(record.outcome), record.end_step,
              record.trigger_step, record.balancedness_before, record.balancedness_after,
              record.layers_moved, record.layers_installed, record.slots_moved,
              record.bytes_intra_node, record.bytes_inter_node, record.rounds, record.steps,
              record.seconds, record.placement_ms, record.stall_total_ms,
              record.stall_max_ms, record.error.empty() ? "" : ": ", record.error);
  metrics_->on_record(record);
  if (monitor_) monitor_->refresh();
  if (record.outcome == Outcome::kFailed) {
    if (config_.on_failure) config_.on_failure(record);
    if (config_.on_error == OnError::kRaise && raise) raise->raise();
  }
}

// `error`: what step_end raises under on_error=raise (by default an IoError with `message`).
void Rebalancer::Impl::fail_open(std::string message, std::optional<Failure> error) {
  records_.open->outcome = Outcome::kFailed;
  records_.open->error = std::move(message);
  close_open(error ? std::move(error) : Failure{FailureKind::kIoError, records_.open->error});
}

}  // namespace eplb::runtime
