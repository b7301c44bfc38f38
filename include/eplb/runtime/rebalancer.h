#pragma once
// The Rebalancer an inference engine embeds: records expert loads, serves the dispatch tables,
// and rebalances the experts while the engine keeps serving (DESIGN.md, "The runtime protocol";
// docs/runtime.md has the full protocol, the threads and the ownership of every buffer).
//
// Use:
//   Rebalancer rb(config, communicator, transport, weight_spec, initial_placement);
//   rb.connect();                     // start-up: arena + staging allocated, every peer read once
//   fill rb.weights(layer, tensor) with the experts of rb.phy2log(layer) (this rank's slots)
//   loop (forward thread):
//     rb.record(layer, expert_ids) ...; rb.dispatch(layer) ...; forward pass ...; rb.step_end();
//   rb.shutdown();
//
// Threads. The engine's forward thread calls record*, dispatch, weights, phy2log and step_end;
// they are not thread-safe against each other (one forward thread). history(), rank(), step()
// accessors marked "any thread" may be called from anywhere. The Rebalancer runs two threads
// of its own from connect() to shutdown(): a control thread, the only user of the communicator,
// and a worker thread (placement, planning, reads). The communicator and the transport belong
// to the caller, must outlive the Rebalancer (or its shutdown()), and must not be used by
// anyone else in between.
//
// Weights. The engine's own tensors (WeightSpec::engine), which eplb registers with the
// transport and installs into by copying only the slots whose expert changes (one staging
// layer beside them); or an arena eplb allocates, for a server with no weights of its own.
// The arena holds layers + 1 layer buffers of [tensors][slots_per_rank][expert_bytes];
// the extra one is the staging buffer. By default (Install::kSwap) a layer is installed by
// swapping its buffer with the staging buffer, so weights(layer, tensor) is, like
// dispatch(layer), valid until the next step_end(): an engine re-reads both after every step_end
// (or at least after each step whose installed_layers() changed). With Install::kCopy the staged
// bytes are copied into the live buffer instead and weights() never moves (what captured CUDA
// graphs need). Where the arena is device memory (a transport with capabilities().device_memory)
// weights() spans carry device addresses; an Installer orders installs with the engine's queued
// device work (eplb/cuda/installer.h).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/engine_maps.h"
#include "eplb/stats/load_file.h"

namespace prometheus {
class Registry;
struct MetricFamily;
}  // namespace prometheus
namespace eplb::control {
class Communicator;
}
namespace eplb::transport {
class Transport;
}

namespace eplb::runtime {

enum class Mode { kAsync, kSync };
// "async" | "sync"; else InvalidArgument listing them.
Mode parse_mode(std::string_view name);
std::string_view mode_name(Mode mode);

// Where the per-step agreement of an async rebalance runs (DESIGN.md, "The runtime protocol",
// step 4). The window all-reduce at a trigger always runs on eplb's control plane.
enum class Agreement {
  kInternal,  // an all-reduce (min) of one value per step on the control thread
  kExternal,  // the engine carries agreement_contribution() on a collective it already runs
              // every step and hands the minimum in with agreement_result()
};
// "internal" | "external"; else InvalidArgument listing them.
Agreement parse_agreement(std::string_view name);
std::string_view agreement_name(Agreement agreement);

// agreement_contribution() at a step where no rebalance runs: the identity of min, so an
// engine can carry a value at every step without asking whether one is needed.
inline constexpr int64_t kNoAgreement = std::numeric_limits<int64_t>::max();

// How a staged layer becomes live.
enum class Install {
  kSwap,  // the staging buffer and the live one trade places: O(1), weights() moves
  kCopy,  // the staged bytes are copied into the live buffer: weights() never moves
};
// "swap" | "copy"; else InvalidArgument listing them.
Install parse_install(std::string_view name);
std::string_view install_name(Install install);

// Puts installs in order with work the engine has queued but not yet run (a CUDA stream), so
// that no byte the engine may still read is overwritten. Without one (Config::installer null)
// the engine is assumed to have finished with the weights when it calls step_end(), as a CPU
// forward pass has, and kCopy copies with memcpy.
//
// Threads: copy() and mark() are called on the forward thread inside step_end(); wait_marked()
// on the thread that stages the next layer (the worker; the forward thread in sync mode), and
// on the control thread before it contributes this rank's window at a trigger (peers then
// read the live buffers), never concurrently with mark(). copy() and mark() must not fail in
// practice: one that throws stops the process (the rank's weights could no longer be trusted).
class Installer {
 public:
  virtual ~Installer() = default;
  // Install::kCopy: copies `bytes` from the staging buffer `src` to the live buffer `dst`,
  // after the engine's work queued so far (may only enqueue the copy).
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  // After each install: marks the point of the engine's work after which the bytes an install
  // replaced (kSwap: the old live buffer, now staging; kCopy: the staging buffer it copied)
  // are no longer read.
  virtual void mark() = 0;
  // Returns once the engine's work has passed the last mark(); Timeout after `timeout`.
  virtual void wait_marked(std::chrono::milliseconds timeout) = 0;
};

enum class OnError { kLog, kRaise };
OnError parse_on_error(std::string_view name);  // "log" | "raise"

// Where the test-only delay hook is called (Config::delay_hook).
enum class DelayPoint {
  kPlacement,  // worker, before computing the placement
  kRead,       // worker (forward thread in sync mode), before posting each round of reads
  kControl,    // control thread, before each collective
  kInstall,    // forward thread, inside step_end(), before each layer install (must not throw)
};

enum class Outcome {
  kCompleted,  // every moved layer installed on every rank
  kSkipped,    // predicted gain below min_gain, or nothing to move
  kFailed,     // abandoned on every rank at the same step (see RebalanceRecord::error)
  kCancelled,  // shutdown() came while it ran
};
std::string_view outcome_name(Outcome outcome);

// What one rebalance did, as seen from this rank. Every rank records the same trigger_step,
// end_step, outcome and (for the same load) the same plan figures; timings are this rank's.
// A rebalance that failed before every rank had its plan records no plan figures.
struct RebalanceRecord {
  int64_t index = 0;         // 0, 1, ... in order of triggering
  int64_t trigger_step = 0;  // step() when it was triggered
  int64_t end_step = 0;      // step() when it ended (installed, skipped or abandoned)
  Outcome outcome = Outcome::kCompleted;
  std::string error;         // why it failed or was skipped; empty when completed
  double placement_ms = 0;   // placement + plan + tables on the worker
  double balancedness_before = 0;  // predicted on the window's load, current placement
  double balancedness_after = 0;   // predicted on the window's load, new placement
  int64_t layers_moved = 0;        // layers whose slots change
  int64_t layers_installed = 0;
  int64_t slots_moved = 0;         // slots whose expert changes, all ranks
  int64_t bytes_intra_node = 0;    // remote reads of all ranks, moved layers
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;
  int64_t rounds = 0;              // read rounds, summed over moved layers
  int64_t bytes_installed = 0;     // bytes this rank's installs wrote into live weights
  int64_t bytes_restored = 0;      // bytes this rank restored from a backup (host copy or loader)
  bool repair = false;             // triggered by reconfigure(): lost or empty slots to fill
  int64_t steps = 0;               // end_step - trigger_step
  double seconds = 0;              // wall time from trigger to end on this rank
  double stall_total_ms = 0;       // this rank's forward thread in step_end, steps of this
  double stall_max_ms = 0;         //   rebalance (trigger to end, both included): sum, max;
                                   //   less the time it waited for a core (below)
  double stall_preempted_ms = 0;   // time in those step_ends the forward thread was runnable
                                   //   but the OS ran other threads (Linux; 0 elsewhere)
};

// The expert weights of one MoE layer: one or more tensors (gate_up, down, scales, ...), each
// [slots_per_rank][expert_bytes] on every rank. Every layer has the same tensors.
struct TensorSpec {
  std::string name;
  int64_t expert_bytes = 0;  // bytes of one expert of this tensor
};

// Where the engine keeps one tensor of one layer: this rank's slots of it, slot j at
// base + j * stride (docs/runtime.md, "Embedding with the engine's own weights").
struct TensorMemory {
  void* base = nullptr;
  int64_t stride = 0;  // bytes from one slot to the next, >= the tensor's expert_bytes; 0: those
};

struct WeightSpec {
  int64_t layers = 0;
  std::vector<TensorSpec> tensors;
  // The engine's own tensors, [layers][tensors] (layer-major), or empty for an arena eplb
  // allocates. With them eplb allocates one staging layer only, registers these with the
  // transport (peers read them in place), and installs by copying into them the slots whose
  // expert changes: weights() is these tensors, at addresses that never change. Host memory,
  // or device memory where the transport's capabilities().device_memory; every rank must give
  // the same strides. The memory stays the engine's and must outlive the Rebalancer.
  std::vector<TensorMemory> engine = {};

  bool engine_weights() const { return !engine.empty(); }
  const TensorMemory& memory(int64_t layer, int64_t tensor) const {
    return engine[static_cast<size_t>(layer) * tensors.size() + static_cast<size_t>(tensor)];
  }
  int64_t stride(int64_t layer, int64_t tensor) const;  // resolved (never 0)
  int64_t expert_bytes() const;  // sum over tensors: bytes that move with one expert
  void validate() const;         // InvalidArgument naming the bad value
};

// Where an expert comes from when every slot that held it was on a lost rank (DESIGN.md, "The
// runtime protocol", step 7; docs/elastic.md). Both are optional; with neither, a rank loss that
// takes the last replica of an expert cannot be repaired (reconfigure's repair then fails,
// naming the expert).
struct Backup {
  // Host copies of every expert of every layer kept across the ranks, each on a different rank
  // (on different nodes while there are nodes enough): each rank holds about
  // copies * experts / ranks experts of every layer (backup_bytes()), filled by fill_backup()
  // after connect(). A repair reads a lost expert from a live rank's copy (its own first, then
  // one on its node), one-sided like any read. 0: none. Host-memory transports only.
  int64_t copies = 0;
  // Reads expert `expert` of `layer`, tensor `tensor`, into `bytes` (this rank's staging, host
  // memory): from the checkpoint, say. Called on the worker thread (the forward thread in sync
  // mode), only for an expert that no live slot and no live copy holds. Empty: none.
  std::function<void(int64_t layer, int64_t tensor, int32_t expert, std::span<std::byte> bytes)>
      loader;
};

// Who serves after a reconfigure(): the seat (the rank of the layout) of each member of the new
// group, by its rank in the new communicator and transport. Seats of the layout that are not
// listed are lost: nothing is placed on them or routed to them until a member takes them back.
struct Membership {
  std::vector<int32_t> seats;  // [new group size], distinct, each in [0, layout.ranks)

  // The identity: every seat of the layout, member g in seat g.
  static Membership all(int64_t ranks);
  // InvalidArgument naming the bad seat or size.
  void validate(const Layout& layout) const;
};

// The largest lag and timeout Config takes.
inline constexpr int64_t kMaxLag = 1024;
inline constexpr std::chrono::milliseconds kMaxTimeout{24LL * 3600 * 1000};

struct Config {
  Layout layout;               // experts, physical, ranks (= communicator size), nodes, groups
  int64_t interval = 100;      // a rebalance is triggered at steps that are multiples of this
  int64_t window = 100;        // steps of load history the placement sees
  placement::Policy policy = placement::Policy::kSticky;
  bool hierarchical = false;   // pack groups to nodes first
  double tolerance = 0.01;     // sticky: accepted balancedness loss against balanced
  bool thorough = false;       // balanced / sticky: thorough counts at two slots per rank
  double min_gain = 0;         // skip when predicted balancedness gain is smaller than this
  int64_t lag = 2;             // agreement of step s is acted on at step s + lag, in [1, kMaxLag]
  std::chrono::milliseconds timeout{30'000};  // every collective and every batch of reads
  Mode mode = Mode::kAsync;
  Agreement agreement = Agreement::kInternal;  // kExternal needs mode kAsync
  int64_t peers_per_round = 1;  // read schedule: peers per rank per round
  routing::DispatchPolicy dispatch = routing::DispatchPolicy::kStatic;
  OnError on_error = OnError::kLog;
  Install install = Install::kSwap;
  std::shared_ptr<Installer> installer;  // null: host memory, see Installer
  // Called on the forward thread, inside step_end(), when a rebalance fails (on every rank).
  std::function<void(const RebalanceRecord&)> on_failure;
  // Metrics (docs/runtime.md, "Metrics"): registered in `registry` when the engine passes the
  // one it serves, else in one of the Rebalancer's own; every metric carries the label
  // rank="<rank>" and `metric_labels` (say, a model name). Rebalancers sharing a registry need
  // labels that tell them apart (the constructor refuses the same ones twice); a Rebalancer's
  // metrics leave the registry when it is destroyed.
  std::shared_ptr<prometheus::Registry> registry;
  std::map<std::string, std::string> metric_labels;
  // Watchdog: a rebalance in flight that makes no progress (no phase change, no layer read or
  // installed) for this long logs a warning naming the phase, the layer and the ranks it waits
  // for where it knows them, and again at most this often; 0 turns it off.
  std::chrono::milliseconds stall_warn{10'000};
  // Every this many steps the recorded window's balancedness under the placement in force is
  // measured off the forward thread, logged and exported; 0: every `interval` steps; -1:
  // never. It shares the window of a rebalance triggered at that step, skips a step with one
  // in flight, and else adds one all-reduce of the window on the control thread.
  int64_t balancedness_period = 0;
  // Elastic serving: where lost experts are restored from.
  Backup backup;
  // Testing: called at each DelayPoint, from the thread named there (so it must be
  // thread-safe). It may sleep; at kPlacement and kRead it may also throw, which fails the
  // rebalance as a worker error would. It must not throw at kControl.
  std::function<void(DelayPoint)> delay_hook;

  void validate() const;  // InvalidArgument naming the bad value and the rule
};

class Rebalancer {
 public:
  // Validates everything (config, spec, placement shape against the layout and the
  // communicator's size and the transport's rank). Allocates nothing yet.
  Rebalancer(Config config, control::Communicator& communicator, transport::Transport& transport,
             WeightSpec weights, Placement initial);
  // A process that joins a running group in seat `seat` (a restarted rank, or a new one taking a
  // lost seat): no communicator, no transport and no weights yet; reconfigure() brings it in,
  // in place of connect(). Validates config and spec.
  Rebalancer(Config config, WeightSpec weights, int seat);
  // shutdown(), then releases everything.
  ~Rebalancer();
  Rebalancer(const Rebalancer&) = delete;
  Rebalancer& operator=(const Rebalancer&) = delete;

  // Start-up, on every rank together (it runs collectives): allocates the arena (layers + 1
  // layer buffers, zero-filled) as one transport region, or with the engine's own weights one
  // staging layer and registers the engine's tensors; exchanges descriptors with every peer,
  // reads a few bytes from each, starts the control and worker threads. Returns the bytes eplb
  // holds (arena or staging); nothing more is allocated or connected later.
  int64_t connect();

  // Elastic serving (docs/elastic.md). Called by every member of the new group at the same step
  // (forward thread, between two step_end() calls), with a communicator and a transport built
  // for the new group (member g of `membership` is rank g of both), after a failure or to take
  // a rank back. A rebalance in flight is abandoned first (installed layers stay, as after any
  // failure), the old control thread drains, and eplb moves its staging (and arena, and backup
  // copy) into the new transport. The members then exchange descriptors and what every one of
  // their slots holds; the slots of lost seats, and every slot of a joining member, are marked
  // lost, and every layer's dispatch tables are rebuilt so that no token goes to a lost slot
  // (unavailable() lists the experts left with no replica). The next step_end() starts a repair
  // rebalance: a placement over the members' seats only, lost experts restored (from a live
  // replica, a backup copy, or the loader) and the layers with unavailable experts installed
  // first; a joining member receives tokens once its slots are installed. The old communicator
  // and transport are no longer used once it returns (the caller may destroy them). With the
  // arena, weights() moves to the new transport's memory (Install::kCopy too): re-read it after
  // reconfigure(); the engine's own tensors (WeightSpec::engine) stay where they are. A joining
  // Rebalancer (the constructor above) adopts the group's step and placement. Throws (and the
  // engine may call it again with another group) when a collective fails or the members
  // disagree: InvalidArgument naming the seat, step or configuration that differs.
  void reconfigure(control::Communicator& communicator, transport::Transport& transport,
                   const Membership& membership);
  // The seats of the group now (Membership::all after connect()); forward thread.
  std::vector<int32_t> members() const;
  // The experts of `layer` no token can be routed to now (every replica lost), ascending.
  std::vector<int32_t> unavailable(int64_t layer) const;
  // Whether some expert of some layer is unavailable now.
  bool any_unavailable() const;
  // Backup: this rank's share of the host copies (Backup::copies): the experts it keeps a copy
  // of (the same in every layer), the bytes of one tensor of one of them, and the bytes held.
  std::vector<int32_t> backup_experts() const;
  std::span<std::byte> backup_weights(int64_t layer, int64_t tensor, int32_t expert);
  int64_t backup_bytes() const;
  // Fills this rank's share of the backup: fill(layer, tensor, expert, bytes) for each. Call it
  // after connect(), before serving (a joining rank: after reconfigure(); its share serves
  // restores from the next reconfigure on). A rank whose share is not filled is not a source.
  void fill_backup(const std::function<void(int64_t layer, int64_t tensor, int32_t expert,
                                            std::span<std::byte> bytes)>& fill);

  // ---- forward thread ----
  // Counts tokens routed to each listed logical expert of `layer` in the current step.
  void record(int64_t layer, std::span<const int32_t> expert_ids);
  // Adds a count vector [experts] to `layer` in the current step.
  void record_counts(int64_t layer, std::span<const int64_t> counts);
  // One forward pass of the engine's own counters, all layers at once (engine_maps.h): tokens
  // per slot ([layers][physical], counted for the expert each slot holds now) or per logical
  // expert ([layers][experts]). Read in place, once per step: a second call before step_end(),
  // a wrong shape or a negative count is InvalidArgument, and nothing of that call is counted.
  void record_pass(const IntTensor& counts, CountsOf of);
  // Binds the engine's map tensors (engine_maps.h) in place of any bound before, and writes
  // every layer's rows now. From then on eplb writes a layer's rows at the step it installs
  // that layer (the same step on every rank, so every rank's tensors are the same after every
  // step, kRankDispatch excepted: it is this rank's) and after reconfigure(); their storage
  // never moves. InvalidArgument for a wrong shape (or R too small); nothing is bound then.
  void bind_maps(std::vector<MapBinding> maps);
  // The tables of `layer` now; valid until the next step_end() or reconfigure(). Only they say
  // which slots serve: after a rank is lost, phy2log() still names an expert in its slots.
  const routing::DispatchTables& dispatch(int64_t layer) const;
  // This rank's weights of one tensor of `layer`: [slots_per_rank][expert_bytes] (the engine's
  // tensor with its stride, with engine weights); slot j holds the expert
  // phy2log(layer)[rank * slots_per_rank + j]. Valid until the next step_end() with the arena
  // and Install::kSwap; at fixed addresses otherwise.
  std::span<std::byte> weights(int64_t layer, int64_t tensor);
  std::span<const std::byte> weights(int64_t layer, int64_t tensor) const;
  // The bytes of one slot of one tensor of `layer` (within weights()).
  std::span<std::byte> slot_weights(int64_t layer, int64_t tensor, int64_t slot);
  std::span<const std::byte> slot_weights(int64_t layer, int64_t tensor, int64_t slot) const;
  // The placement in force now, one layer: [physical].
  std::span<const int32_t> phy2log(int64_t layer) const;
  // The placement in force now, all layers (built on demand).
  Placement placement() const;
  // Once after every forward pass. Advances the rebalance protocol; see docs/runtime.md.
  // With on_error = raise, throws the error of a rebalance that failed at this step (the
  // rebalance is already abandoned consistently; later calls go on serving).
  void step_end();
  // Writes the recorded window ([steps][layers][experts]) as eplb's load format (kEplb) or
  // SGLang's logical_count (kSglang), so a run can seed the next one.
  void save_stats(const std::string& path, stats::LoadFormat format = stats::LoadFormat::kEplb)
      const;

  // ---- external agreement (Config::agreement = kExternal) ----
  // The value this rank contributes to the agreement of step(): read it after step_end(),
  // min-reduce it over the ranks on a collective the engine runs anyway, and hand the minimum
  // to agreement_result(step, min) on every rank. kNoAgreement when no rebalance runs at
  // step() (handing that result in is then optional). Forward thread, or any thread the
  // engine orders after the step_end() of that step.
  int64_t agreement_contribution() const;
  // The minimum over all ranks of their agreement_contribution() at `step`. It must come
  // before the step_end() that makes step() == step + lag: that step_end acts on it, waiting
  // at most `timeout` for a late one; a result still missing then fails the rebalance on this
  // rank like a failed collective (no rebalance triggers again, control_broken()). Results of
  // steps where no rebalance ran are ignored. Any thread. InvalidArgument with an internal
  // agreement, or for a step after step().
  void agreement_result(int64_t step, int64_t min_value);

  // Drains the control thread's queue and joins both threads; idempotent. Call it on every
  // rank at the same step (a rank leaving alone mid-rebalance is, to its peers, a dead peer).
  void shutdown();

  // ---- state ----
  int rank() const;                    // this rank's seat in the layout; any thread
  int64_t step() const;                // step_end() calls so far; forward thread
  bool rebalancing() const;            // forward thread
  int64_t installed_layers() const;    // layer installs so far, all rebalances; forward thread
  bool control_broken() const;         // a collective (or an external agreement) failed: no
                                       // rebalance will trigger again
  int64_t bytes_held() const;          // any thread, after connect()
  // Host memory eplb holds on this rank now, in bytes: the arena or staging layer (bytes_held(),
  // unless the transport keeps it in device memory), the load window
  // (stats::LoadRecorder::bytes_for), the placement in force and every layer's dispatch tables.
  // Not counted: the engine's own weights, a rebalance in flight's plan (the new placement and
  // tables of the layers it moves, freed when it ends), the threads' stacks, the backends'
  // buffers. Forward thread, after connect().
  int64_t host_bytes() const;
  // The metrics now (any thread): the registry they live in, its families, and their text
  // exposition (what a /metrics endpoint serves). The in-flight figures (age, phase) are
  // brought up to date first.
  std::shared_ptr<prometheus::Registry> registry() const;
  std::vector<prometheus::MetricFamily> collect_metrics() const;
  std::string metrics_text() const;
  std::vector<RebalanceRecord> history() const;  // any thread
  const Config& config() const;
  const WeightSpec& weight_spec() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Start from any placement (all validated against `layout`, InvalidArgument naming the
// mismatch):
//   a placement file, eplb's or SGLang's physical_to_logical_map;
Placement placement_from_file(const std::string& path, const Layout& layout);
//   a load file (any format stats::read_load reads), placed with the configured policy
//   (sticky starts from the trivial placement);
Placement placement_from_load(const std::string& path, const Config& config);
//   or the trivial one: eplb::trivial_placement (core/types.h).

// Fills this rank's slots of every layer by calling fill(layer, tensor, expert, bytes) for
// each (layer, tensor, local slot), `expert` being the slot's logical expert now. For tests,
// examples and engines that load weights per expert.
void fill_weights(Rebalancer& rebalancer,
                  const std::function<void(int64_t layer, int64_t tensor, int32_t expert,
                                           std::span<std::byte> bytes)>& fill);

}  // namespace eplb::runtime
