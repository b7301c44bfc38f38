// The async step driver on the forward thread: once per step this rank's progress goes into the
// agreement, and the agreed value of step s - lag decides, on every rank alike, whether to wait,
// install the next layer, end the rebalance or abandon it (Rebalancer::Impl; the protocol's
// state and rules are async_protocol.h; docs/runtime.md, "The async protocol").

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

void Rebalancer::Impl::step_end_async() {
  if (protocol_.active()) advance_async();
  if (!protocol_.active() && should_trigger()) trigger_async();
  protocol_.contribute(step_, control_.get());
}

void Rebalancer::Impl::advance_async() {
  AsyncProtocol::Agreed agreed = protocol_.take_due(step_, seat_);
  if (!agreed.due) return;
  if (agreed.failed) {
    end_active(std::move(agreed.message), std::move(agreed.error));
    return;
  }
  if (agreed.value == 0) return;  // some rank is still placing
  // Every rank has the (same) plan: this rank's own contribution was >= 1, loaded with
  // acquire after the worker wrote the plan.
  Active& a = *protocol_.active();
  RebalancePlan& plan = a.plan;
  if (!a.figures_filled) {
    fill_plan_figures(plan);
    a.figures_filled = true;
  }
  if (plan.skipped) {
    records_.open->outcome = Outcome::kSkipped;
    records_.open->error = plan.skip_reason;
    close_open(std::nullopt);
    protocol_.finish(false);
    return;
  }
  const int64_t moved = static_cast<int64_t>(plan.moved_layers.size());
  if (a.installed_fwd < agreed.value - 1 && a.installed_fwd < moved) {
    install(plan, a.installed_fwd);
    ++a.installed_fwd;
    AsyncProtocol::hand_over(a, a.installed_fwd);
  }
  if (a.installed_fwd == moved) {
    records_.open->bytes_read = a.bytes_read.load(std::memory_order_relaxed);
    records_.open->read_ms = static_cast<double>(a.read_ns.load(std::memory_order_relaxed)) / 1e6;
    records_.open->outcome = Outcome::kCompleted;
    close_open(std::nullopt);
    protocol_.finish(false);
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
  protocol_.finish(true);
}

}  // namespace eplb::runtime
