#include "runtime/monitor.h"

#include <algorithm>
#include <utility>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "eplb/placement/metrics.h"

namespace eplb::runtime {
namespace {

double seconds_between(MonitorClock::time_point a, MonitorClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

void PhaseTracker::start(int64_t index, int64_t trigger_step) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = MonitorClock::now();
  now_.active = true;
  now_.index = index;
  now_.trigger_step = trigger_step;
  now_.phase = Phase::kWindow;
  now_.layer = -1;
  now_.peers.clear();
  now_.started = now;
  now_.last = now;
  ++now_.generation;
}

void PhaseTracker::note(int64_t index, Phase phase, int64_t layer, std::vector<int> peers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!now_.active || now_.index != index) return;
  now_.phase = phase;
  now_.layer = layer;
  now_.peers = std::move(peers);
  now_.last = MonitorClock::now();
  ++now_.generation;
}

void PhaseTracker::touch(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!now_.active || now_.index != index) return;
  now_.last = MonitorClock::now();
  ++now_.generation;
}

void PhaseTracker::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  now_.active = false;
  now_.phase = Phase::kIdle;
  now_.layer = -1;
  now_.peers.clear();
  ++now_.generation;
}

PhaseTracker::Snapshot PhaseTracker::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return now_;
}

std::string describe_stall(const PhaseTracker::Snapshot& s, int rank, double seconds) {
  std::string what;
  switch (s.phase) {
    case Phase::kWindow:
      what = "the window all-reduce of every rank's loads has not completed (the control plane "
             "does not say which ranks are late)";
      break;
    case Phase::kPlacement: what = "this rank is still computing the placement"; break;
    case Phase::kReading:
      what = s.peers.empty()
                 ? fmt::format("staging layer {}", s.layer)
                 : fmt::format("reading layer {} from rank{} {}", s.layer,
                               s.peers.size() == 1 ? "" : "s", fmt::join(s.peers, ", "));
      break;
    case Phase::kAgreeing:
      what = s.layer < 0
                 ? std::string("waiting for every rank to have the plan")
                 : fmt::format("layer {} is staged here, waiting for every rank to stage it",
                               s.layer);
      what += " (an agreement carries only the minimum over the ranks: which ones are late is "
              "not known here)";
      break;
    case Phase::kIdle: what = "idle"; break;
  }
  return fmt::format("eplb runtime rank {}: rebalance {} (triggered at step {}) has made no "
                     "progress for {:.1f} s in phase {}: {}",
                     rank, s.index, s.trigger_step, seconds, phase_name(s.phase), what);
}

Monitor::Monitor(int rank, Layout layout, std::chrono::milliseconds stall_warn,
                 std::chrono::milliseconds timeout, PhaseTracker& progress, RuntimeMetrics& metrics,
                 std::function<void(const Failure&, int64_t)> on_failed_window)
    : rank_(rank),
      layout_(layout),
      stall_warn_(stall_warn),
      timeout_(timeout),
      progress_(progress),
      metrics_(metrics),
      on_failed_window_(std::move(on_failed_window)),
      thread_([this] { loop(); }) {}

Monitor::~Monitor() { stop(); }

void Monitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The windows that arrived are still measured, so every rank's last figure is that of the
  // same step (the Rebalancer stops the control thread first, which runs every queued one).
  std::deque<Job> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs.swap(jobs_);
  }
  for (Job& job : jobs) {
    if (job.window.valid() &&
        job.window.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      run(job);
    }
  }
}

void Monitor::measure(std::shared_future<CollectiveResult> window,
                      std::vector<int32_t> phy2log, int64_t step, int64_t group,
                      std::vector<int32_t> members, std::vector<uint8_t> usable) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    // The result is bounded by its own timeout, behind at most a few queued collectives.
    jobs_.push_back({std::move(window), std::move(phy2log), step,
                     MonitorClock::now() + timeout_ * 8, group, std::move(members),
                     std::move(usable)});
  }
  cv_.notify_all();
}

void Monitor::refresh() {
  std::lock_guard<std::mutex> lock(refresh_mu_);
  const PhaseTracker::Snapshot s = progress_.snapshot();
  const auto now = MonitorClock::now();
  RuntimeMetrics::InFlight f;
  f.active = s.active;
  f.phase = s.phase;
  f.layer = s.layer;
  if (s.active) {
    f.age_seconds = seconds_between(s.started, now);
    f.since_progress_seconds = seconds_between(s.last, now);
    f.stalled = stall_warn_.count() > 0 && now - s.last >= stall_warn_;
  }
  metrics_.set_in_flight(f);
}

void Monitor::watch(MonitorClock::time_point now) {
  refresh();
  if (stall_warn_.count() <= 0) return;
  const PhaseTracker::Snapshot s = progress_.snapshot();
  if (!s.active || now - s.last < stall_warn_) return;
  // Once per stall_warn while the same stall lasts; at once for a new one.
  if (s.generation == warned_generation_ && now - warned_at_ < stall_warn_) return;
  warned_generation_ = s.generation;
  warned_at_ = now;
  metrics_.on_watchdog_warning();
  spdlog::warn("{}", describe_stall(s, rank_, seconds_between(s.last, now)));
}

void Monitor::run(Job& job) {
  try {
    measure_now(job);
  } catch (...) {
    // A measurement is a figure, never a reason to stop: say why there is none.
    spdlog::warn("eplb runtime rank {}: measuring the balancedness of step {} failed: {}", rank_,
                 job.step, Failure::current().message);
  }
}

void Monitor::measure_now(Job& job) {
  CollectiveResult result = job.window.get();  // a copy: the worker may read it too
  if (result.failure) {
    // A failed collective means a broken control plane: no rebalance may trigger any more.
    spdlog::warn("eplb runtime rank {}: the balancedness window of step {} failed ({}): no "
                 "rebalance will trigger again",
                 rank_, job.step, result.failure->message);
    if (on_failed_window_) on_failed_window_(*result.failure, job.group);
    return;
  }
  const std::vector<int64_t> window = std::move(result.values);
  const int64_t layers = static_cast<int64_t>(job.phy2log.size()) / layout_.physical;
  LoadMatrix load(layers, layout_.experts);
  for (size_t i = 0; i < load.values.size() && i < window.size(); ++i) {
    load.values[i] = static_cast<double>(window[i]);
  }
  Placement placement(layers, layout_.experts, layout_.physical);
  placement.phy2log = std::move(job.phy2log);
  placement.derive_from_phy2log();
  const std::optional<placement::PlacementMetrics> served =
      placement::served_metrics(load, placement, layout_, job.members, job.usable);
  if (!served) {
    // As the plans' predictions read it: some expert's tokens had nowhere to go.
    metrics_.set_recorded_balancedness(0);
    if (rank_ == 0) {
      spdlog::info("eplb runtime: balancedness 0 at step {} (an expert had no usable slot on "
                   "the group's ranks)",
                   job.step);
    }
    return;
  }
  const placement::PlacementMetrics& m = *served;
  if (m.moe_layers == 0) return;  // nothing recorded yet: no figure rather than a perfect one
  metrics_.set_recorded_balancedness(m.balancedness_mean);
  if (rank_ == 0) {
    spdlog::info("eplb runtime: balancedness {:.4f} at step {} (the recorded window under the "
                 "placement in force over the slots that served, mean over {} MoE layers; "
                 "step-weighted {:.4f})",
                 m.balancedness_mean, job.step, m.moe_layers, m.balancedness_step);
  }
}

void Monitor::loop() {
  // Often enough to warn within a few percent of stall_warn and keep the age metrics fresh.
  const auto tick = std::clamp<std::chrono::milliseconds>(
      stall_warn_.count() > 0 ? stall_warn_ / 8 : std::chrono::milliseconds(250),
      std::chrono::milliseconds(5), std::chrono::milliseconds(250));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, tick);
    if (stop_) break;
    // A measurement whose window has arrived (or never will) is taken off the queue.
    while (!jobs_.empty()) {
      Job& job = jobs_.front();
      const bool ready = job.window.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
      if (!ready && MonitorClock::now() < job.deadline) break;
      Job taken = std::move(job);
      jobs_.pop_front();
      lock.unlock();
      if (ready) run(taken);
      lock.lock();
    }
    lock.unlock();
    watch(MonitorClock::now());
    lock.lock();
  }
}

}  // namespace eplb::runtime
