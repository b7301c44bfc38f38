#pragma once
// The Rebalancer an inference engine embeds: records expert loads, serves the dispatch tables,
// and rebalances the experts while the engine keeps serving (docs/design.md, "The runtime
// protocol"; docs/runtime.md: the protocol, the threads, who owns each buffer;
// examples/cpp_engine.cc: a whole engine embedding it).
//
// Use (the communicator, eplb's small CPU collectives: from eplb/control/launch.h, or one the
// engine implements, docs/launch.md; the transport: eplb/transport/registry.h, docs/cuda.md):
//   auto communicator = control::connect_from_env();   // torchrun's (or mpirun's) variables
//   auto transport = transport::create("shm", {.rank = communicator->rank()});
//   Rebalancer rb(config, *communicator, *transport, weight_spec, initial_placement);
//   rb.connect();  // start-up: staging (and any arena) allocated, peers read once
//   fill rb.weights(layer, tensor) with the experts of rb.phy2log(layer) (this rank's slots)
//   loop (forward thread):
//     rb.record(layer, expert_ids) ...; rb.dispatch(layer) ...; forward pass ...; rb.step_end();
//   rb.shutdown();
//
// Threads. The engine's forward thread calls record*, dispatch, weights, phy2log and step_end;
// they are not thread-safe against each other (one forward thread). history(), rank(), step()
// accessors marked "any thread" may be called from anywhere. The Rebalancer runs three threads
// of its own: a control thread, the only user of the communicator, and a worker thread
// (placement, planning, reads), both from connect() to shutdown(); and a monitor thread (the
// stall watchdog, the in-flight metrics, the periodic balancedness log), from the constructor
// to shutdown(). The communicator and the transport belong to the caller, must outlive the
// Rebalancer (or its shutdown()), and must not be used by anyone else in between.
//
// Weights: the engine's own tensors, or an arena eplb allocates (config.h, WeightSpec).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/config.h"
#include "eplb/runtime/engine_maps.h"
#include "eplb/runtime/record.h"
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
  // reads a few bytes from each, starts the control and worker threads (the monitor thread runs
  // from the constructor). Returns the bytes eplb holds (arena or staging); nothing more is
  // allocated or connected later.
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
  // expert ([layers][experts]); per slot also at the members' width after a reconfigure() to
  // fewer seats (bind_maps()). Read in place, once per step: a second call before step_end(),
  // a wrong shape or a negative count is InvalidArgument, and nothing of that call is counted.
  void record_pass(const IntTensor& counts, CountsOf of);
  // Binds the engine's map tensors (engine_maps.h) in place of any bound before, and writes
  // every layer's rows now. From then on eplb writes a layer's rows at the step it installs
  // that layer (the same step on every rank, so every rank's tensors are the same after every
  // step, kRankDispatch excepted: it is this rank's) and after reconfigure(); their storage
  // never moves, and tensors bound before are never written again. After a reconfigure() to
  // fewer seats an engine may bind views at the members' width (vLLM's elastic EP re-slices its
  // physical_to_logical_map to the survivors' slots, renumbered): a call whose
  // kPhysicalToLogical tensor is [layers][members x slots_per_rank] numbers every slot of its
  // tensors that way (member g, in ascending seat order, owns [g * slots_per_rank, ...)). Such
  // a binding is unbound (with a warning) by the next reconfigure() that changes the members.
  // InvalidArgument for a wrong shape, a width neither the layout's nor the members', or R too
  // small; nothing is bound then.
  void bind_maps(std::vector<MapBinding> maps);
  // A placement computed elsewhere (the engine's own policy, a file `eplb plan` wrote): the
  // next step_end() starts a rebalance that installs it instead of placing with the configured
  // policy. The runtime plans the moves, stages them off the forward thread, agrees the install
  // steps and installs layer by layer, exactly as for its own placements (never skipped for
  // min_gain: the engine's policy decided; skipped when it equals the placement in force).
  // `placement.phy2log` decides ([layers][physical]); its width is the layout's physical, or
  // after a reconfigure() to fewer seats the members' slots (member g, in ascending seat order,
  // at [g * slots_per_rank, ...): an engine's compact view); slots of seats that are no member
  // keep what they hold. Every rank proposes the same placement at the same step (between the
  // same two step_end() calls): the trigger proves it with one all-reduce, and a mismatch fails
  // that rebalance on every rank, naming the first differing layer and slot (or the steps); a
  // rank that does not propose while the others do leaves their collective without a partner
  // (it fails at the timeout, as a rank that skipped a step_end()). A second call before the
  // next step_end() replaces the first; reconfigure() drops a proposal not yet started.
  // Forward thread. InvalidArgument, and nothing queued, for a wrong shape, an expert outside
  // [0, experts) or a layer that leaves an expert without a member slot, while a rebalance is
  // in flight (rebalancing()), or once the control plane is broken (control_broken()).
  void propose(const Placement& placement);
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
  // Writes the recorded window ([steps][layers][experts]) in any load format stats writes
  // (eplb's, SGLang's logical_count, vLLM's load_history, a CSV matrix), so a run can seed the
  // next one.
  void save_stats(const std::string& path, stats::LoadFormat format = stats::LoadFormat::kEplb)
      const;

  // The cost model Config::min_gain's check predicts with from the next trigger on (a model
  // the engine fits from its own timings while serving; it replaces Config::cost). Give every
  // rank the same one at the same step: the ranks decide with the mean of their models, so
  // different ones cannot make them disagree, but only the same one means what was fitted.
  // Forward thread. InvalidArgument for a bad model (CostModel::validate).
  void set_cost_model(const placement::CostModel& model);

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

  // Drains the control thread's queue and joins the three threads; idempotent. Call it on every
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
  friend class RebalancerTesting;  // test hooks: src/runtime/testing.h
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Fills this rank's slots of every layer by calling fill(layer, tensor, expert, bytes) for
// each (layer, tensor, local slot), `expert` being the slot's logical expert now. For tests,
// examples and engines that load weights per expert.
void fill_weights(Rebalancer& rebalancer,
                  const std::function<void(int64_t layer, int64_t tensor, int32_t expert,
                                           std::span<std::byte> bytes)>& fill);

}  // namespace eplb::runtime
