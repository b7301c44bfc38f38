// A rebalance starts: at the steps that trigger one, this rank's window goes to the control
// thread's all-reduce and the rebalance, as an Active, to the worker (Rebalancer::Impl).

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

bool Rebalancer::Impl::should_trigger() const {
  if (control_broken() || records_.open) return false;
  // A repair starts at once after reconfigure(); after a failed one, again at the next interval
  // (a loader that keeps failing must not cost a collective and a warning at every step).
  // Interval 0: no rebalance of the runtime's own (an engine that proposes its placements).
  const bool at_interval = config_.interval > 0 && step_ > 0 && step_ % config_.interval == 0;
  return group_.repair_due() || at_interval || proposals_.pending();
}

void Rebalancer::Impl::open_record() {
  records_.start(step_, group_.repair_pending());
  records_.open->proposed = proposals_.pending();
  progress_.start(records_.open->index, step_);
  metrics_->set_age_steps(0);
}

// Run on the control thread before this rank contributes its window: peers start reading this
// rank's live buffers once every window is in, so the last install's queued work (a copy into
// a live buffer, kCopy) must have run by then. Nothing to wait for on host memory.
std::function<void()> Rebalancer::Impl::installs_done() {
  if (!config_.installer) return {};
  return [installer = config_.installer, timeout = config_.timeout] {
    installer->wait_marked(timeout);
  };
}

void Rebalancer::Impl::trigger_async() {
  open_record();
  auto a = std::make_shared<Active>();
  a->index = records_.open->index;
  std::vector<int64_t> window(static_cast<size_t>(spec_.layers * config_.layout.experts));
  recorder_.snapshot_window(window);
  gain_book_.append(window, recorder_.steps_in_window());
  a->window = control_->all_reduce(std::move(window), control::ReduceOp::kSum,
                                   config_.timeout, installs_done())
                  .share();
  // A proposal: the check that every rank proposed it, right behind the window (proposal.h).
  if (std::optional<Proposals::Queued> queued = proposals_.take()) {
    a->proposal_check = control_->all_reduce(agreement_values(queued->placement, queued->step),
                                             control::ReduceOp::kMax, config_.timeout)
                            .share();
    a->proposed = std::move(queued->placement);
  }
  a->current_phy2log = phy2log_;
  a->map = weights_.map();
  a->elastic = group_.inputs(weights_, static_cast<bool>(config_.backup.loader));
  worker_.submit(a);
  protocol_.start(std::move(a));
}

}  // namespace eplb::runtime
