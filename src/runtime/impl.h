#pragma once
// Rebalancer::Impl, the runtime behind the public Rebalancer. One rebalance, step by step, and
// the file of each:
//   record      the loads of each step (rebalancer.cc: record, record_counts, record_pass)
//   trigger     at an interval, the window to the control thread's all-reduce (trigger.cc)
//   compute     placement, migration plan, schedule, tables, on the worker (worker.cc, compute.cc)
//   stage       one layer at a time, reads of peers' live weights into staging (stage.cc)
//   agree       one tiny all-reduce per step; its result acts lag steps later (agree.cc)
//   install     staging becomes live, tables and maps change, every rank at one step (install.cc)
//   record      the rebalance's record, published when it ends (records.cc)
// Sync mode does all of it inside one step_end (sync.cc); start-up is connect.cc, the starting
// placement initial_placement.cc, reconfigure() and lost slots elastic.cc.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/clock.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/backup.h"
#include "runtime/control_thread.h"
#include "runtime/engine_maps.h"
#include "runtime/failure.h"
#include "runtime/metrics.h"
#include "runtime/monitor.h"
#include "runtime/compute.h"
#include "runtime/stage.h"
#include "runtime/testing.h"

namespace eplb::runtime {

using Clock = std::chrono::steady_clock;

// The state one rebalance shares between the forward thread and the worker (async mode).
//   written by the worker, read by the forward thread after an acquire load of `progress`:
//     plan (before progress >= 1), failure (before progress < 0);
//   written by the forward thread under `mu`, waited on by the worker: installed, cancel.
struct Active {
  // Set by the forward thread before the worker sees it; then read-only.
  int64_t index = 0;                     // the rebalance's record index (for Progress)
  std::vector<int32_t> current_phy2log;  // [layers][physical] at the trigger
  BufferMap map;                         // at the trigger
  ElasticInputs elastic;                 // members, usable slots, backups at the trigger
  // The window all-reduce: the worker waits on it (and the monitor, to measure the window).
  std::shared_future<CollectiveResult> window;

  // Progress this rank contributes to the agreement: -1 - rank after a failure, 0 while
  // the placement is computed, 1 + the number of moved layers staged.
  std::atomic<int64_t> progress{0};
  RebalancePlan plan;
  Failure failure;

  std::mutex mu;
  std::condition_variable cv;
  int64_t installed = 0;            // guarded by mu
  std::atomic<bool> cancel{false};  // set under mu, read anywhere

  // Forward thread only.
  int64_t installed_fwd = 0;
  bool figures_filled = false;
};

// One agreement contributed by the forward thread, to be acted on at step + lag.
struct PendingAgreement {
  int64_t step = 0;
  int64_t mine = 0;  // this rank's contribution
  std::future<CollectiveResult> result;  // internal agreement only
};

// Every catch on a runtime thread takes everything (a foreign exception type from a hook or a
// backend is still an error to report, never a reason to end the process from a thread the
// engine does not own, or to leave a rebalance half done) and keeps it as a Failure: plain
// values, never the exception object, cross to another thread (failure.h).

class Rebalancer::Impl {
  friend class RebalancerTesting;  // the delay hook (testing.h)

 public:
  Impl(Config config, control::Communicator& communicator, transport::Transport& transport,
       WeightSpec spec, const Placement& initial);
  // A joining rank in `seat`: no group until reconfigure().
  Impl(Config config, WeightSpec spec, int seat);

 private:
  // Both: `initial` null for a joining rank (and no communicator or transport yet).
  Impl(Config config, WeightSpec spec, int seat, const Placement* initial,
       control::Communicator* communicator, transport::Transport* transport);

 public:

  ~Impl();

  // No two slots of the engine's tensors may share a byte: an install into one would change
  // the other (the same tensor given for two layers, say). Interleaved layouts are fine.
  void check_engine_slots_apart() const;

  // ---------------------------------------------------------------- start-up
  int64_t connect();

  // The engine's tensors, one transport region each, right after the staging region.
  void register_engine_tensors();

  // The control thread on comm_ (connect(), reconfigure()), and the worker thread.
  void start_control_thread();
  void start_worker_thread();

  // ---------------------------------------------------------------- forward thread
  void record(int64_t layer, std::span<const int32_t> ids);
  void record_counts(int64_t layer, std::span<const int64_t> counts);
  // The engine's seams (engine_maps.h): one pass of its counters, its map tensors.
  void record_pass(const IntTensor& counts, CountsOf of);
  void bind_maps(std::vector<MapBinding> maps);
  // Rows `layer` of the bound maps from phy2log_ and tables_ (after any change of either).
  void write_maps(int64_t layer) const;

  const routing::DispatchTables& dispatch(int64_t layer) const;

  std::span<std::byte> weights(int64_t layer, int64_t tensor) const;

  std::span<std::byte> slot_weights(int64_t layer, int64_t tensor, int64_t slot) const;

  std::span<const int32_t> phy2log(int64_t layer) const;

  Placement placement() const;

  void step_end();

  void save_stats(const std::string& path, stats::LoadFormat format) const;

  void shutdown();

  // ---------------------------------------------------------------- elastic (elastic.cc)
  void reconfigure(control::Communicator& communicator, transport::Transport& transport,
                   const Membership& membership);
  std::vector<int32_t> members() const;
  std::vector<int32_t> unavailable(int64_t layer) const;
  bool any_unavailable() const;
  int64_t unavailable_count() const;  // all layers
  std::vector<int32_t> backup_experts() const;
  std::span<std::byte> backup_weights(int64_t layer, int64_t tensor, int32_t expert) const;
  int64_t backup_bytes() const;
  void fill_backup(const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>&
                       fill);

  int64_t agreement_contribution() const;

  void agreement_result(int64_t step, int64_t min_value);

  int rank() const;
  int64_t step() const;
  bool rebalancing() const;
  int64_t installed_layers() const;
  bool control_broken() const;
  int64_t bytes_held() const;
  int64_t host_bytes() const;
  std::vector<RebalanceRecord> history() const;
  std::shared_ptr<prometheus::Registry> registry() const;
  std::vector<prometheus::MetricFamily> collect_metrics() const;
  const Config& config() const;
  const WeightSpec& weight_spec() const;

 private:
  bool should_trigger() const;

  // The tables of `layer` of `placement` routing only to usable slots (usable_ now, or the
  // members' slots all, `after_install`).
  routing::DispatchTables build_tables(const Placement& placement, int64_t layer,
                                       bool after_install) const;
  // What a plan needs beyond the window: members, usable slots, backups (elastic.cc).
  ElasticInputs elastic_inputs() const;
  // After installing `layer`: every member slot of it holds its expert now.
  void mark_installed(int64_t layer);
  // Waits until the worker has no job (after a cancel).
  void wait_worker_idle();
  // The transport rank of every seat of the layout (-1: not a member).
  int peer_of(int seat) const { return peer_of_seat_[static_cast<size_t>(seat)]; }
  // Allocates the arena or staging, registers the engine's tensors and allocates the backup, in
  // that order (the same region ids on every rank), in transport_.
  void allocate_regions();
  // The exchange of reconfigure(): descriptors and every member's slots; adopts the group's
  // state.
  void exchange_membership(const Membership& membership, bool joining);

  // The longest the forward thread waits for a collective's result: each queued collective
  // (at most lag + 1 agreements, a window, and a balancedness window before it) is bounded by
  // the timeout itself.
  std::chrono::milliseconds result_bound() const;

  void open_record();

  // At steps that are multiples of the balancedness period, after this step's protocol: the
  // window for the monitor thread to measure under `phy2log`. A rebalance triggered at this
  // step all-reduced it already (that result is shared); with one in flight since an earlier
  // step there is no measurement (no collective queues up among its agreements); else one
  // all-reduce, on every rank alike. `served_by`: the group's seats and usable slots when
  // `phy2log` served (empty where all of them did).
  struct ServedBy {
    std::vector<int32_t> members;
    std::vector<uint8_t> usable;
  };
  ServedBy served_by_now() const;
  void submit_balancedness(std::vector<int32_t> phy2log, ServedBy served_by);

  // Ends the open record at this step; `raise` is what step_end throws under on_error=raise.
  void close_open(std::optional<Failure> raise);

  void fill_plan_figures(const RebalancePlan& plan);

  // Logs, calls back, appends to the history and, under on_error=raise, throws.
  void publish_open();

  // Installs moved layer k of `plan` on this rank: the staged buffer becomes live, the new
  // tables and phy2log take effect. kSwap: O(1) in the weights' size; kCopy: one layer copied
  // (or enqueued, by the installer).
  void install(RebalancePlan& plan, int64_t k);

  // Installs swap buffers only with the arena and Install::kSwap.
  bool swaps() const;

  // The engine's tensors of layer k of `plan` get, slot by slot, the staged bytes of every
  // slot whose expert changes; the others are not written.
  void install_into_engine(const RebalancePlan& plan, int64_t k);

  // An installer that fails mid-install (a CUDA error on the engine's stream) leaves this
  // rank's weights, tables and buffer map no longer in step with each other or with the other
  // ranks', and there is no consistent way back: the process stops, loudly, so that its peers
  // see a dead rank and abandon the rebalance cleanly instead of serving wrong experts.
  // Defined in rebalancer.cc, beside the installs that call it.
  template <typename F>
  void installer_or_stop(F&& call, int64_t layer);

  // `error`: what step_end raises under on_error=raise (by default an IoError with `message`).
  void fail_open(std::string message, std::optional<Failure> error);

  // -------------------------------------------------------------- async protocol
  void step_end_async();

  // Run on the control thread before this rank contributes its window: peers start reading
  // this rank's live buffers once every window is in, so the last install's queued work (a copy
  // into a live buffer, kCopy) must have run by then. Nothing to wait for on host memory.
  std::function<void()> installs_done();

  void trigger_async();

  void submit_agreement();

  // The agreed value of `pending`, waiting for it within its bound. When there is none (a
  // failed or late collective, a missing or impossible external result) the rebalance is
  // abandoned here and nothing is returned: the agreement can no longer be trusted to be the
  // same on every rank, so no rebalance triggers again.
  std::optional<int64_t> take_agreement(PendingAgreement pending);

  void advance_async();

  // Abandons the running rebalance at this step: layers installed so far stay (they are
  // complete on every rank), the others keep their old buffers and tables.
  //
  // The record keeps the plan's figures only if an agreement proved every rank had the plan
  // (figures_filled): filling them from this rank's own plan would make the records of ranks
  // whose workers were at different points differ.
  void end_active(std::string message, std::optional<Failure> error);

  void finish_active();

  static void cancel_worker(Active& a);

  StageContext stage_context(const std::atomic<bool>* cancel, int64_t index);

  // -------------------------------------------------------------- worker thread
  void worker_loop();

  void run_job(Active& a);

  // -------------------------------------------------------------- sync mode
  // The whole rebalance inside this step_end: the baseline. The collectives are the window,
  // one agreement on the plan, and one per moved layer, the same on every rank.
  void step_end_sync();

  // One agreement of sync mode, on whether this rank failed (`local`); false (and the record
  // failed) unless every rank succeeded.
  bool agree_sync(const std::optional<Failure>& local);

  std::vector<int64_t> await(std::future<CollectiveResult> future);

  // Immutable after construction / connect(), or replaced by reconfigure() on the forward
  // thread while the worker is idle and no control thread runs.
  const Config config_;
  // RebalancerTesting::set_delay_hook (testing.h): set before any runtime thread starts.
  std::function<void(DelayPoint)> delay_hook_;
  control::Communicator* comm_ = nullptr;
  transport::Transport* transport_ = nullptr;
  const WeightSpec spec_;
  int rank_ = 0;  // this rank's seat in the layout (fixed: a member keeps its seat)
  const int64_t layers_;
  ArenaLayout arena_;
  transport::Region region_;
  std::vector<int> peer_region_;  // [ranks] the arena's region id on each seat
  std::vector<int> peer_of_seat_;  // [ranks] each seat's transport rank, -1: not a member
  std::vector<int32_t> members_;   // seats of the group, ascending
  BackupLayout backup_;
  transport::Region backup_region_;      // this rank's share of the copies (none: bytes 0)
  std::vector<int> peer_backup_region_;  // [ranks] each seat's backup region id, -1: unusable
  std::atomic<bool> backup_filled_{false};
  bool joining_ = false;  // constructed to join, not yet reconfigured
  bool connected_ = false;
  std::atomic<int64_t> bytes_held_{0};
  int64_t balancedness_period_ = 0;  // resolved: 0 never

  // Metrics (thread-safe: prometheus-cpp's metrics are atomic) and the progress of the
  // rebalance in flight (any thread, see monitor.h); the monitor thread from connect() on.
  std::unique_ptr<RuntimeMetrics> metrics_;
  Progress progress_;
  std::unique_ptr<Monitor> monitor_;

  // Forward thread.
  stats::LoadRecorder recorder_;
  std::vector<int32_t> phy2log_;                 // [layers][physical]
  std::vector<uint8_t> usable_;  // [layers][physical]: the slot holds its expert's weights
  bool repair_pending_ = false;  // reconfigure() asks for a repair rebalance
  bool repair_failed_ = false;   // one failed since: retried at intervals only
  std::vector<routing::DispatchTables> tables_;  // [layers]
  EngineMaps maps_;                              // the engine's map tensors, if bound
  int64_t pass_step_ = -1;                       // the step record_pass() last counted
  std::vector<int64_t> pass_counts_;             // record_pass()'s [layers][experts], reused
  BufferMap map_;
  EngineTensors engine_;  // the engine's own tensors, from connect() on; empty with the arena
  int64_t step_ = 0;
  int64_t installed_total_ = 0;
  int64_t next_index_ = 0;
  bool shut_down_ = false;
  std::shared_ptr<Active> active_;
  std::deque<PendingAgreement> agreements_;  // by step
  std::optional<RebalanceRecord> open_;  // the running rebalance's record
  bool open_finished_ = false;           // it ended at this step: publish at the end of it
  Clock::time_point open_started_;
  std::optional<Failure> raise_;
  // Sync mode: the window a rebalance triggered at this step all-reduced, for the measurement.
  std::optional<std::vector<int64_t>> sync_window_;
  std::atomic<bool> control_broken_{false};
  std::atomic<int64_t> group_{0};  // reconfigure() calls so far: whose collectives these are
  std::atomic<int64_t> broken_group_{-1};  // the group whose window failed (monitor thread)
  std::atomic<int64_t> published_step_{0};          // step_, for agreement_result's check
  std::atomic<int64_t> contribution_{kNoAgreement};  // agreement_contribution()

  // External agreement: results handed in by agreement_result() (any thread), in a ring of
  // lag + 2 slots by step, so the result of step s is still there when s + lag acts on it.
  struct ExternalResult {
    int64_t step = -1;
    int64_t value = 0;
  };
  std::mutex external_mu_;
  std::condition_variable external_cv_;
  std::vector<ExternalResult> external_;  // guarded by external_mu_

  // Threads.
  std::unique_ptr<ControlThread> control_;
  std::thread worker_;
  std::mutex worker_mu_;
  std::condition_variable worker_cv_;
  std::deque<std::shared_ptr<Active>> worker_queue_;  // guarded by worker_mu_
  bool worker_stop_ = false;                          // guarded by worker_mu_
  bool worker_busy_ = false;                          // guarded by worker_mu_: a job runs
  std::condition_variable worker_idle_cv_;

  mutable std::mutex history_mu_;
  std::vector<RebalanceRecord> history_;  // guarded by history_mu_
};

}  // namespace eplb::runtime
