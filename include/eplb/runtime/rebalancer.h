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
// Threads. The engine's forward thread calls record*, dispatch, weights, phy2log and step_end
// (one forward thread: not thread-safe against each other); accessors marked "any thread" may
// be called from anywhere. eplb runs three threads of its own (docs/runtime.md): a control
// thread, the only user of the communicator, and a worker (placement, planning, reads), from
// connect() to shutdown(); and a monitor (stall watchdog, in-flight metrics), from the
// constructor to shutdown(). The communicator and the transport belong to the caller, must
// outlive the Rebalancer (or its shutdown()), and must not be used by anyone else in between.
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

  // Elastic serving (docs/elastic.md has the whole sequence). Every member of the new group
  // calls it at the same step (forward thread, between two step_end() calls), with a
  // communicator and a transport built for the new group (member g of `membership` is rank g of
  // both). A rebalance in flight is abandoned (installed layers stay); the members exchange
  // what their slots hold; lost slots are marked so and every layer's tables rebuilt so that no
  // token goes to one (unavailable()); the next step_end() starts a repair rebalance. The old
  // communicator and transport are unused once it returns. With the arena, re-read weights()
  // after it. A joining Rebalancer adopts the group's step and placement. Throws (the engine may
  // call it again with another group) when a collective fails or the members disagree:
  // InvalidArgument naming the seat, step or configuration that differs.
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
  void record(int64_t layer, std::span<const int32_t> expert_ids);  // one per token routed
  void record_counts(int64_t layer, std::span<const int64_t> counts);  // [experts] to add
  // One forward pass of the engine's own counters, all layers (engine_maps.h): tokens per slot
  // ([layers][physical], or the members' width, bind_maps()) or per expert ([layers][experts]).
  // Once per step: a second call before step_end(), a wrong shape or a negative count is
  // InvalidArgument, and nothing of that call is counted.
  void record_pass(const IntTensor& counts, CountsOf of);
  // Binds the engine's map tensors (engine_maps.h) in place of any bound before, and writes
  // every layer's rows now; then a layer's rows at the step it installs that layer (the same
  // step on every rank) and after reconfigure(). Their storage never moves; tensors bound before
  // are never written again. After a reconfigure() to fewer seats, views at the members' width
  // ([layers][members x slots_per_rank], member g at [g * slots_per_rank, ...), as vLLM's
  // elastic EP re-slices them) may be bound; the next reconfigure() that changes the members
  // unbinds them (docs/embedding.md). InvalidArgument for a wrong shape, a width neither the
  // layout's nor the members', or R too small; nothing is bound then.
  void bind_maps(std::vector<MapBinding> maps);
  // A placement computed elsewhere (the engine's own policy, a file `eplb plan` wrote): the
  // next step_end() starts a rebalance that installs it, planned, staged, agreed and installed
  // as the runtime's own (never skipped for a gain check; skipped when it equals the placement
  // in force). `placement.phy2log` is [layers][physical], or after a reconfigure() to fewer
  // seats the members' compact width. Every rank proposes the same placement at the same step:
  // the trigger proves it with one all-reduce, and a mismatch fails that rebalance on every
  // rank, naming the first differing layer and slot (docs/embedding.md). A second call before
  // the next step_end() replaces the first. Forward thread. InvalidArgument, nothing queued, for
  // a wrong shape, an expert outside [0, experts), a layer leaving an expert without a member
  // slot, a rebalance in flight, or a broken control plane.
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
  // Once after every forward pass: advances the rebalance protocol (docs/runtime.md). With
  // on_error = raise, throws the error of a rebalance that failed at this step (abandoned
  // consistently already; later calls go on serving).
  void step_end();
  // Writes the recorded window ([steps][layers][experts]) in any load format stats writes
  // (eplb's, SGLang's, vLLM's, CSV), so a run can seed the next one.
  void save_stats(const std::string& path, stats::LoadFormat format = stats::LoadFormat::kEplb)
      const;

  // The cost model Config::min_gain's check predicts with from the next trigger on (replaces
  // Config::cost); the same on every rank at the same step (the ranks decide with the mean of
  // their models). Forward thread. InvalidArgument for a bad model (CostModel::validate).
  void set_cost_model(const placement::CostModel& model);

  // ---- external agreement (Config::agreement = kExternal) ----
  // The value this rank contributes to the agreement of step(): read it after step_end(),
  // min-reduce it over the ranks on a collective the engine runs anyway, and hand the minimum
  // to agreement_result(step, min) on every rank. kNoAgreement when no rebalance runs at
  // step() (handing that result in is then optional). Forward thread, or any thread the
  // engine orders after the step_end() of that step.
  int64_t agreement_contribution() const;
  // The minimum over all ranks of their agreement_contribution() at `step`, before the
  // step_end() that makes step() == step + lag; that one waits at most `timeout` for it, then
  // fails the rebalance as a failed collective would (control_broken()). Results of steps with
  // no rebalance are ignored. Any thread. InvalidArgument with an internal agreement, or for a
  // step after step().
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
  // Host memory eplb holds on this rank now, in bytes: the arena or staging layer (unless in
  // device memory), the load window, the placement in force and every layer's dispatch tables;
  // not the engine's weights, a rebalance in flight's plan, stacks or backends' buffers.
  // Forward thread, after connect().
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
