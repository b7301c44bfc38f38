#pragma once
// What watches a running Rebalancer from the side: the progress of the rebalance in flight
// (PhaseTracker, written by whichever thread moves it on), and the monitor thread, which keeps the
// in-flight metrics fresh, warns about a rebalance that makes no progress (the watchdog), and
// measures the recorded window's balancedness off the forward thread.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/metrics.h"
#include "runtime/control_thread.h"
#include "runtime/runtime_metrics.h"

namespace eplb::runtime {

using MonitorClock = std::chrono::steady_clock;

// The rebalance in flight, as far as this rank knows. Any thread (one mutex: a few calls per
// layer, never per token).
class PhaseTracker {
 public:
  struct Snapshot {
    bool active = false;
    int64_t index = 0;         // the rebalance's RebalanceRecord::index
    int64_t trigger_step = 0;
    Phase phase = Phase::kIdle;
    int64_t layer = -1;        // the layer read or waited for; -1 when none
    std::vector<int> peers;    // the ranks a read in flight waits for (kReading)
    MonitorClock::time_point started;
    MonitorClock::time_point last;  // the last progress
    int64_t generation = 0;         // counts progress: the watchdog warns once per stall
  };

  // note() and touch() name the rebalance they come from: a cancelled worker still finishing
  // an old one must not move the next one on (nor reset the watchdog's clock).
  void start(int64_t index, int64_t trigger_step);  // phase kWindow
  void note(int64_t index, Phase phase, int64_t layer = -1, std::vector<int> peers = {});
  void touch(int64_t index);  // progress within the phase (a layer installed, reads done)
  void finish();              // none in flight
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  Snapshot now_;  // guarded by mu_
};

// The watchdog's sentence for a stall: the phase, the layer, who it waits for.
std::string describe_stall(const PhaseTracker::Snapshot& s, int rank, double seconds);

class Monitor {
 public:
  // `stall_warn` 0: no watchdog. `on_failed_window` (monitor thread) is told of a window
  // all-reduce that failed: the control plane is broken. Starts its thread.
  Monitor(int rank, Layout layout, std::chrono::milliseconds stall_warn,
          std::chrono::milliseconds timeout, PhaseTracker& progress, RuntimeMetrics& metrics,
          std::function<void(const Failure&, int64_t group)> on_failed_window);
  ~Monitor();  // stop()
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Forward thread: measure the balancedness of `window` (the all-reduce of every rank's
  // recorded window, [layers][experts], in flight on the control thread) under `phy2log`
  // ([layers][physical], in force at `step`) once it arrives, over the slots that served
  // (placement::served_metrics: `members` and `usable` as they were at `step`; empty: all).
  // `group` (the Rebalancer's count of reconfigures) is handed back to on_failed_window, so that
  // the failure of an old group's window breaks nothing of the new group's.
  void measure(std::shared_future<CollectiveResult> window, std::vector<int32_t> phy2log,
               int64_t step, int64_t group = 0, std::vector<int32_t> members = {},
               std::vector<uint8_t> usable = {});

  // Any thread: the in-flight metrics brought up to date now (one caller at a time, so an
  // older snapshot never overwrites a newer one).
  void refresh();

  // Joins the thread, then takes the measurements whose window has arrived (the others are
  // dropped). Idempotent.
  void stop();

 private:
  struct Job {
    std::shared_future<CollectiveResult> window;
    std::vector<int32_t> phy2log;
    int64_t step = 0;
    MonitorClock::time_point deadline;
    int64_t group = 0;
    std::vector<int32_t> members;  // empty: every seat
    std::vector<uint8_t> usable;   // empty: every slot
  };
  void loop();
  void watch(MonitorClock::time_point now);
  void run(Job& job);
  void measure_now(Job& job);

  const int rank_;
  const Layout layout_;
  const std::chrono::milliseconds stall_warn_;
  const std::chrono::milliseconds timeout_;
  PhaseTracker& progress_;
  RuntimeMetrics& metrics_;
  const std::function<void(const Failure&, int64_t)> on_failed_window_;

  // Monitor thread only.
  int64_t warned_generation_ = -1;
  MonitorClock::time_point warned_at_;

  std::mutex refresh_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;  // guarded by mu_
  bool stop_ = false;     // guarded by mu_
  std::thread thread_;
};

}  // namespace eplb::runtime
