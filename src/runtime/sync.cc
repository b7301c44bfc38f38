#include "runtime/impl.h"

#include <future>
#include <string>
#include <optional>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/compute.h"
#include "runtime/stage.h"

// Rebalancer::Impl's sync mode: the whole rebalance inside one step_end.

namespace eplb::runtime {

// -------------------------------------------------------------- sync mode
void Rebalancer::Impl::step_end_sync(std::optional<std::vector<int64_t>>& all_reduced) {
  if (!should_trigger()) return;
  open_record();
  const int64_t loads = spec_.layers * config_.layout.experts;
  std::vector<int64_t> window(static_cast<size_t>(loads));
  recorder_.snapshot_window(window);
  gain_book_.append(window, recorder_.steps_in_window());
  GainFigures gain;
  std::optional<Proposals::Queued> proposed = proposals_.take();
  std::vector<int64_t> check;
  try {
    std::future<CollectiveResult> sum = control_->all_reduce(
        std::move(window), control::ReduceOp::kSum, config_.timeout, installs_done());
    std::future<CollectiveResult> max;
    if (proposed) {  // right behind the window, as in async mode (proposal.h)
      max = control_->all_reduce(agreement_values(proposed->placement, proposed->step),
                                 control::ReduceOp::kMax, config_.timeout);
    }
    window = await(std::move(sum));
    gain = take_gain_figures(window, loads);
    if (proposed) check = await(std::move(max));
    all_reduced = window;
  } catch (...) {
    protocol_.set_control_broken(true);
    Failure failure = Failure::current();
    // The message first: the two arguments are built in no set order.
    std::string message = detail::concat("the window all-reduce failed: ", failure.message);
    fail_open(std::move(message), std::move(failure));
    return;
  }
  RebalancePlan plan;
  std::optional<Failure> local;
  progress_.note(records_.open->index, Phase::kPlacement);
  try {
    if (proposed) check_agreed(check, proposed->placement);
    if (delay_hook_) delay_hook_(DelayPoint::kPlacement);
    const ElasticInputs elastic =
        group_.inputs(weights_, static_cast<bool>(config_.backup.loader));
    plan = make_plan(window, phy2log_, config_, spec_.expert_bytes(), elastic, gain,
                     proposed ? &proposed->placement : nullptr);
  } catch (...) {
    local = Failure::current();
  }
  progress_.note(records_.open->index, Phase::kAgreeing);
  if (!agree_sync(local)) return;
  fill_plan_figures(plan);
  if (plan.skipped) {
    records_.open->outcome = Outcome::kSkipped;
    records_.open->error = plan.skip_reason;
    close_open(std::nullopt);
    return;
  }
  const StageContext context = stage_context(nullptr, records_.open->index);
  for (size_t k = 0; k < plan.moved_layers.size(); ++k) {
    progress_.note(records_.open->index, Phase::kReading, plan.moved_layers[k]);
    const auto read_start = Clock::now();
    try {
      stage_layer(context, weights_.map(), plan.moved_layers[k], plan.migrations[k]);
    } catch (...) {
      local = Failure::current();
    }
    records_.open->read_ms += ms_between(read_start, Clock::now());
    records_.open->bytes_read += bytes_read_by(plan.migrations[k], seat_);
    progress_.note(records_.open->index, Phase::kAgreeing, plan.moved_layers[k]);
    if (!agree_sync(local)) return;
    install(plan, static_cast<int64_t>(k));
  }
  records_.open->outcome = Outcome::kCompleted;
  close_open(std::nullopt);
}

// One agreement of sync mode, on whether this rank failed (`local`); false (and the record
// failed) unless every rank succeeded.
bool Rebalancer::Impl::agree_sync(const std::optional<Failure>& local) {
  const int64_t mine = local ? -1 - seat_ : 1;
  int64_t agreed = 0;
  try {
    agreed = await(control_->all_reduce({mine}, control::ReduceOp::kMin, config_.timeout)).at(0);
  } catch (...) {
    protocol_.set_control_broken(true);
    Failure failure = Failure::current();
    std::string message = detail::concat("an agreement failed: ", failure.message);
    fail_open(std::move(message), std::move(failure));
    return false;
  }
  if (agreed >= 0) return true;
  if (local) {
    fail_open(detail::concat("rank ", seat_, ": ", local->message), local);
  } else {
    fail_open(detail::concat("rank ", -1 - agreed, " failed (its log has the error)"),
              std::nullopt);
  }
  return false;
}

std::vector<int64_t> Rebalancer::Impl::await(std::future<CollectiveResult> future) {
  if (future.wait_for(protocol_.result_bound()) != std::future_status::ready) {
    fail<Timeout>("runtime: a collective gave no result within ",
                  protocol_.result_bound().count(),
                  " ms");
  }
  return future.get().take();
}

}  // namespace eplb::runtime
