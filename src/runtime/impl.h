#pragma once
// Rebalancer::Impl, the runtime behind the public Rebalancer. One rebalance, step by step, and
// the file of each:
//   record      the loads of each step (rebalancer.cc: record, record_counts, record_pass)
//   trigger     at an interval, the window to the control thread's all-reduce (trigger.cc)
//   compute     placement, migration plan, schedule, tables, on the worker (worker.cc, compute.cc)
//   stage       one layer at a time, reads of peers' live weights into staging (stage.cc),
//               through the weight store: regions, peers, backups, buffer map (weight_store.cc)
//   agree       one tiny all-reduce per step; its result acts lag steps later (agree.cc, the
//               step driver; the agreements and the rebalance in flight: async_protocol.cc)
//   install     staging becomes live (WeightStore::install), tables and maps change, every rank
//               at one step (install.cc)
//   record      the rebalance's record, published when it ends (records.cc)
// Sync mode does all of it inside one step_end (sync.cc); start-up is connect.cc, the starting
// placement initial_placement.cc, reconfigure() and lost slots elastic.cc, the group's
// members, usable slots and repairs group_state.cc.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/clock.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/async_protocol.h"
#include "runtime/backup.h"
#include "runtime/compute.h"
#include "runtime/control_thread.h"
#include "runtime/engine_maps.h"
#include "runtime/external_agreement.h"
#include "runtime/failure.h"
#include "runtime/gain.h"
#include "runtime/group_state.h"
#include "runtime/in_flight.h"
#include "runtime/runtime_metrics.h"
#include "runtime/monitor.h"
#include "runtime/proposal.h"
#include "runtime/record_book.h"
#include "runtime/stage.h"
#include "runtime/testing.h"
#include "runtime/weight_store.h"
#include "runtime/worker.h"

namespace eplb::runtime {

using Clock = std::chrono::steady_clock;

class Rebalancer::Impl {
  friend class RebalancerTesting;  // the delay hook (testing.h)
  friend class Rebalancer;         // calls the owning part directly where Impl adds nothing

 public:
  Impl(Config config, control::Communicator& communicator, transport::Transport& transport,
       WeightSpec spec, const Placement& initial);
  Impl(Config config, WeightSpec spec, int seat);  // a joining rank: no group yet
  ~Impl();

  // The public Rebalancer's calls (rebalancer.h says who may call each, and when).
  int64_t connect();
  void record_pass(const IntTensor& counts, CountsOf of);
  void bind_maps(std::vector<MapBinding> maps);
  void propose(const Placement& placement);
  const routing::DispatchTables& dispatch(int64_t layer) const;
  std::span<const int32_t> phy2log(int64_t layer) const;
  Placement placement() const;
  void step_end();
  void set_cost_model(const placement::CostModel& model);
  void save_stats(const std::string& path, stats::LoadFormat format) const;
  void shutdown();
  void reconfigure(control::Communicator& communicator, transport::Transport& transport,
                   const Membership& membership);
  std::vector<int32_t> unavailable(int64_t layer) const;
  bool any_unavailable() const;
  int64_t unavailable_count() const;  // all layers
  bool control_broken() const;
  int64_t host_bytes() const;
  std::vector<prometheus::MetricFamily> collect_metrics() const;

 private:
  Impl(Config config, WeightSpec spec, int seat, const Placement* initial,
       control::Communicator* communicator, transport::Transport* transport);

  // Start-up (connect.cc) and the group (elastic.cc).
  void start_control_thread();
  void start_worker_thread();
  void exchange_membership(const Membership& membership, bool joining);
  // Trigger and records (trigger.cc, records.cc).
  bool should_trigger() const;
  const CompactSlots& compact_slots() const;
  void open_record();
  void fill_plan_figures(const RebalancePlan& plan);
  void close_open(std::optional<Failure> raise);
  void fail_open(std::string message, std::optional<Failure> error);
  void publish_open();
  // The window's balancedness, measured by the monitor (rebalancer.cc).
  struct ServedBy {  // the members and usable slots that served; empty where all did
    std::vector<int32_t> members;
    std::vector<uint8_t> usable;
  };
  ServedBy served_by_now() const;
  // `all_reduced`: the window of a rebalance triggered at this step in sync mode.
  void submit_balancedness(std::vector<int32_t> phy2log, ServedBy served_by,
                           std::optional<std::vector<int64_t>> all_reduced);
  // The async protocol (trigger.cc, agree.cc) and the worker (worker.cc).
  void step_end_async();
  std::function<void()> installs_done();
  void trigger_async();
  void advance_async();
  void end_active(std::string message, std::optional<Failure> error);
  void run_job(Active& a);
  StageContext stage_context(const std::atomic<bool>* cancel, int64_t index);
  // Sync mode (sync.cc).
  void step_end_sync(std::optional<std::vector<int64_t>>& all_reduced);
  bool agree_sync(const std::optional<Failure>& local);
  std::vector<int64_t> await(std::future<CollectiveResult> future);
  // Install (install.cc).
  void install(RebalancePlan& plan, int64_t k);
  routing::DispatchTables build_tables(const Placement& placement, int64_t layer) const;
  void write_maps(int64_t layer) const;

  // Immutable after construction / connect(), or replaced by reconfigure() on the forward
  // thread while the worker is idle and no control thread runs.
  const Config config_;
  std::function<void(DelayPoint)> delay_hook_;  // testing.h; set before any thread starts
  control::Communicator* comm_ = nullptr;
  const WeightSpec spec_;
  int seat_ = 0;  // this rank's seat in the layout (a member keeps its seat)
  // Regions, peers, backups, the engine's tensors, the buffer map (weight_store.h says which
  // thread touches what).
  WeightStore weights_;
  // Members, usable slots, repair flags, group counters, installs (group_state.h).
  GroupState group_;
  // Built (connect() next), joining (reconfigure() next), or connected.
  enum class Lifecycle : uint8_t { kBuilt, kJoining, kConnected };
  Lifecycle lifecycle_ = Lifecycle::kBuilt;

  // Metrics (atomic), the progress of the rebalance in flight (any thread, monitor.h), and the
  // monitor thread from connect() on.
  std::unique_ptr<RuntimeMetrics> metrics_;
  PhaseTracker progress_;
  std::unique_ptr<Monitor> monitor_;

  // Forward thread.
  stats::LoadRecorder recorder_;
  std::vector<int32_t> phy2log_;  // [layers][physical]
  std::vector<routing::DispatchTables> tables_;  // [layers]
  EngineMaps maps_;                              // the engine's map tensors, if bound
  struct PassCounts {
    int64_t step = -1;            // the step record_pass() last counted
    std::vector<int64_t> counts;  // its [layers][experts], reused
  };
  PassCounts pass_;
  int64_t step_ = 0;
  bool shut_down_ = false;
  Proposals proposals_;                      // a placement proposed for the next step_end
  RecordBook records_;                       // its record, and the history (any thread)
  GainBook gain_book_;  // what this rank adds to a trigger's window for min_gain's check

  // The rebalance in flight and its agreements (forward thread), the contribution and the
  // external agreement's results, whether the control plane broke (any thread):
  // async_protocol.h.
  AsyncProtocol protocol_;

  // Threads.
  std::unique_ptr<ControlThread> control_;
  WorkerThread worker_;
};

}  // namespace eplb::runtime
