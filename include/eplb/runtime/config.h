#pragma once
// The runtime's configuration and the descriptions an engine gives it: Config (the layout, when
// and how to rebalance, timeouts, metrics, the backup of lost experts), the weight spec (the
// engine's tensors or an arena's), Membership (who serves after a reconfigure), and the enums
// with their parsers. docs/runtime.md, "Config", lists every field with its default.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/installer.h"
#include "eplb/runtime/record.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace eplb::runtime {

enum class Mode { kAsync, kSync };
// "async" | "sync"; else InvalidArgument listing them.
Mode parse_mode(std::string_view name);
std::string_view mode_name(Mode mode);

// Where the per-step agreement of an async rebalance runs (docs/design.md, "The runtime protocol",
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

enum class OnError { kLog, kRaise };
OnError parse_on_error(std::string_view name);  // "log" | "raise"

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

// Where an expert comes from when every slot that held it was on a lost rank (docs/design.md, "The
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
  // How a rebalance places (placement/policy.h): policy (default sticky, from the placement
  // in force), hierarchical, tolerance, thorough. `previous` and `live_ranks` are left empty:
  // the runtime gives them at each rebalance.
  placement::PolicyOptions placement{.policy = placement::Policy::kSticky};
  // Skip a rebalance whose new placement's predicted balancedness on the window's load gains
  // less than this over the placement in force, in [-1, 1]; -1 never skips for it.
  double min_balancedness_gain = 0;
  // A rebalance only when it pays (placement/gain.h; docs/runtime.md, "A rebalance only when it
  // pays"): skip it when the MoE time it saves over the next `interval` steps, predicted by
  // `cost` on the window's load, is below min_gain times its price (the bytes it moves at the
  // group's pull bandwidth measured on the last rebalance, plus that rebalance's stall). 0: no
  // such check (every trigger that passes min_balancedness_gain rebalances). Finite, >= 0.
  double min_gain = 0;
  // The model of what a step's MoE layers cost (placement/cost.h) that min_gain's check predicts
  // with; none: the `tokens` preset (1 us per token). Rebalancer::set_cost_model() replaces it
  // while serving (a model the engine fits from its own timings).
  std::optional<placement::CostModel> cost;
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

  void validate() const;  // InvalidArgument naming the bad value and the rule
};

}  // namespace eplb::runtime
