#pragma once
// Routing and load recording on the device: one kernel, launched on the engine's stream, that
// maps each token's top-k logical experts to physical slots (hash dispatch, the same choice as
// routing::choose_slot bit for bit) and adds each token to its experts' load counters in the
// current step of a device ring of `window` steps. docs/cuda-routing.md has the protocol.
//
// Graph replay: everything that changes from one forward pass to the next (how many rows are
// real, the index of the first token, the ring's current step, the tables after an install) is
// read from device memory whose address never changes, so a CUDA graph captured once replays
// correctly with new values. The launch functions allocate nothing, never synchronize and are
// safe to call while the stream is being captured; the owners' update functions are stream-
// ordered copies from pinned memory and must be called outside capture (outside any capture
// in the process when one runs in cudaStreamCaptureModeGlobal).
//
// Threads: the owners are not thread-safe; one thread (the engine's forward thread) owns them
// and the stream they are used on. Device memory belongs to the device current at construction.
// Errors: bad arguments throw InvalidArgument before anything is enqueued; a failed CUDA call
// throws eplb::Error naming the call and the CUDA error.
//
// Unusable slots (dispatch.h): tables built with `usable` may give an expert replica_count 0;
// every kernel routes its tokens to slot -1 (and still counts them, by expert), padding rows
// included, so an engine's expert kernels must skip slot -1 (drop that expert's contribution)
// once it serves with such tables.
//
// This header is plain C++: it is included by .cc files compiled by the host compiler.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "eplb/routing/dispatch.h"

namespace eplb::cuda {

// One layer's dispatch tables in device memory (what the kernel reads). Built by
// DeviceDispatchTables, or by an engine over tables it already keeps on the device.
struct DispatchTablesView {
  const int32_t* log2phy = nullptr;        // device [experts][max_replicas], padded with -1
  const int32_t* replica_count = nullptr;  // device [experts], each in [0, max_replicas]
  int32_t experts = 0;
  int32_t max_replicas = 0;  // the row stride of log2phy
};

// Owns one layer's tables on the device at a fixed address. upload() replaces them with a
// stream-ordered copy from a pinned staging buffer: kernels launched on `stream` before the
// upload read the old tables, kernels launched after read the new ones (a kernel on another
// stream must be ordered by the caller, e.g. with an event). `max_replicas` is the capacity:
// any later tables of the layer may have up to that many replicas per expert (at most
// physical - experts + 1); rows are repacked to it and padded with -1.
class DeviceDispatchTables {
 public:
  // Allocates (device and pinned memory) and uploads `tables` on `stream`. Not during capture.
  DeviceDispatchTables(const routing::DispatchTables& tables, int64_t max_replicas,
                       cudaStream_t stream);
  ~DeviceDispatchTables();  // waits for its last copy and frees: not on the forward path
  DeviceDispatchTables(const DeviceDispatchTables&) = delete;
  DeviceDispatchTables& operator=(const DeviceDispatchTables&) = delete;

  // Copies `tables` (same experts, at most max_replicas replicas each; a count of 0 is an
  // expert without a usable replica, routed to -1) into the staging buffer and enqueues one
  // cudaMemcpyAsync on `stream`. Blocks the host only if the previous upload's copy has not yet
  // left the staging buffer. InvalidArgument for tables that do not fit or when `stream` is
  // capturing.
  void upload(const routing::DispatchTables& tables, cudaStream_t stream);

  DispatchTablesView view() const;
  int64_t experts() const { return experts_; }
  int64_t max_replicas() const { return max_replicas_; }

 private:
  int64_t experts_;
  int64_t max_replicas_;
  int32_t* device_ = nullptr;   // [experts][max_replicas] log2phy, then [experts] replica_count
  int32_t* staging_ = nullptr;  // pinned, same layout
  cudaEvent_t staging_free_ = nullptr;  // recorded after the copy that last read staging_
};

// A device ring of per-step load counts, the device side of stats::LoadRecorder's ring. int64,
// like the recorder's open step: a step left open however long cannot overflow, and a closed
// step goes into record_counts() as it is (which refuses one expert above 2^31 - 1 tokens in
// one layer in one step, the recorder's per-step limit).
struct LoadRingView {
  int64_t* counts = nullptr;       // device [window][layers][experts]
  int32_t* window_slot = nullptr;  // device: the ring step being counted, in [0, window)
  int32_t window = 0;
  int32_t layers = 0;
  int32_t experts = 0;
};

// Owns a zeroed ring and its step index (0 at construction). The route kernels add to step
// *window_slot; advance_window() closes that step. Steps other than the current one are not
// written until advance_window() reaches them again, so the host may copy a closed step
// (stream-ordered after the advance) while later passes run.
class DeviceLoadRing {
 public:
  DeviceLoadRing(int64_t layers, int64_t experts, int64_t window, cudaStream_t stream);
  ~DeviceLoadRing();  // frees: not on the forward path
  DeviceLoadRing(const DeviceLoadRing&) = delete;
  DeviceLoadRing& operator=(const DeviceLoadRing&) = delete;

  LoadRingView view() const;
  // Copies the whole ring into `out` ([window][layers][experts]) and returns the current step.
  // Waits for `stream`: for tests and tools, never the forward path.
  int32_t read(std::span<int64_t> out, cudaStream_t stream) const;

 private:
  LoadRingView view_;
};

// The per-pass inputs the route kernels read from device memory: the number of real rows and
// the index of the first token (row t is token first_token + t, what hash dispatch hashes).
// set() is a stream-ordered copy from a small ring of pinned buffers, so the host may run many
// passes ahead of the device without overwriting a value not yet copied. An engine that already
// keeps these values on the device passes its own pointers instead.
class DeviceStepInputs {
 public:
  explicit DeviceStepInputs(cudaStream_t stream);  // valid_tokens 0, first_token 0
  ~DeviceStepInputs();
  DeviceStepInputs(const DeviceStepInputs&) = delete;
  DeviceStepInputs& operator=(const DeviceStepInputs&) = delete;

  // Enqueues the copy of both values on `stream`. Not while `stream` is capturing.
  void set(uint64_t first_token, int32_t valid_tokens, cudaStream_t stream);

  const int32_t* valid_tokens() const;  // device
  const uint64_t* first_token() const;  // device

 private:
  static constexpr int kStaging = 16;
  struct Values;
  Values* device_ = nullptr;
  Values* staging_ = nullptr;  // pinned [kStaging]
  cudaEvent_t copied_[kStaging] = {};
  int64_t next_ = 0;
};

// One batch of one layer. Rows are tokens; under graph capture `tokens` is the captured
// capacity and *valid_tokens says how many rows of this pass are real.
struct RouteBatch {
  const int32_t* expert_ids = nullptr;  // device [tokens][top_k], logical expert ids
  int32_t* slots = nullptr;             // device [tokens][top_k], written; must not overlap
  int64_t tokens = 0;                   // rows; tokens * top_k < 2^31
  int64_t top_k = 1;
  const int32_t* valid_tokens = nullptr;  // device: rows t < *valid_tokens are counted
  const uint64_t* first_token = nullptr;  // device: row t is token *first_token + t
  int64_t rank = 0;                       // this rank (hash dispatch offsets by it)
  int64_t layer = 0;                      // the ring's layer to count into
};

// One kernel launch on `stream`. For every row t < tokens and every k < top_k, with
// e = expert_ids[t][k]:
//   slots[t][k] = routing::choose_slot(tables, kHash, e, *first_token + t, rank) for e in
//                 [0, experts), else -1. Rows t >= *valid_tokens get their slots too (an
//                 engine's expert kernels run padding rows; a -1 there would be an
//                 out-of-bounds slot for them), they are only not counted.
//   counts[*window_slot][layer][e] += 1 when t < *valid_tokens and e is in [0, experts).
// Nothing is counted when *window_slot is outside [0, window). A replica count of 0 (no usable
// replica) or outside [0, max_replicas] in the tables gives slot -1 (never an out-of-bounds
// read). Counting uses
// atomics: any number of launches (layers, streams) may add to the same step concurrently.
// Host checks only (InvalidArgument); no synchronization, no allocation: capturable.
void route_and_record(const DispatchTablesView& tables, const RouteBatch& batch,
                      const LoadRingView& ring, cudaStream_t stream);

// The same results from two launches, a map kernel then a count kernel that reads the expert
// ids again: the baseline the benchmark compares the fused kernel with.
void route_then_record(const DispatchTablesView& tables, const RouteBatch& batch,
                       const LoadRingView& ring, cudaStream_t stream);

// Closes the current step: one small kernel on `stream` that moves *window_slot to the next
// step (0 after window - 1, or after a value outside the ring) and zeroes that step's counts.
// Capturable; call it once per forward pass, after the pass's route launches.
void advance_window(const LoadRingView& ring, cudaStream_t stream);

// ---- Dispatches `split` and `adaptive` on the device (routing/dispatch.h, routing/adaptive.h)
// ----
//
// Both need each token's ordinal among the batch's tokens of its expert, in token order, so
// one warp walks the batch 32 entries at a time, grouping the lanes of one expert with
// __match_any_sync (sm_70 and later) and keeping a running count per expert in shared memory:
// the slots are those of routing::route (split) and routing::route_adaptive (adaptive) over
// all `tokens` rows of the batch, bit for bit (padding rows come after the valid ones, so
// they never change a valid row's slot). Counting is that of route_and_record. One launch per
// layer batch (its time: scripts/gpu-check.sh, routing-bench). Capturable: the
// per-pass values and the shares are read from device memory at fixed addresses.

// The placement's shape the adaptive split needs beyond the tables.
struct RankShape {
  int32_t ranks = 0;
  int32_t slots_per_rank = 0;  // slot p is on rank p / slots_per_rank
};

// The device memory of the step's adaptive shares of one layer: shares ([experts][max_replicas]
// int64, aligned with log2phy) and the solver's workspace, allocated once at construction.
class DeviceAdaptiveShares {
 public:
  DeviceAdaptiveShares(int64_t experts, int64_t max_replicas, const RankShape& shape);
  ~DeviceAdaptiveShares();
  DeviceAdaptiveShares(const DeviceAdaptiveShares&) = delete;
  DeviceAdaptiveShares& operator=(const DeviceAdaptiveShares&) = delete;

  const int64_t* shares() const { return shares_; }  // device
  int64_t* shares() { return shares_; }
  int64_t* workspace() { return work_; }  // device
  int64_t experts() const { return experts_; }
  int64_t max_replicas() const { return max_replicas_; }
  const RankShape& shape() const { return shape_; }
  // The busiest rank's load under the last shares (the optimum), or -1 for inconsistent
  // tables: device memory, written by compute_adaptive_shares.
  const int64_t* max_rank_load() const { return work_; }

 private:
  int64_t experts_, max_replicas_;
  RankShape shape_;
  int64_t* shares_ = nullptr;
  int64_t* work_ = nullptr;  // [0]: max rank load, then the solver's words
};

// One single-thread kernel on `stream`: routing::adaptive_split of `global_counts` (device
// [experts], the step's counts summed over all ranks, e.g. by the engine's all-reduce or its
// all-to-all layout exchange) over `tables`, into out.shares(). The same code as the CPU's
// routing::adaptive_shares, so every rank and device gets the same shares bit for bit. The
// tables must have at most out.max_replicas() replicas per expert.
void compute_adaptive_shares(const DispatchTablesView& tables, const int64_t* global_counts,
                             DeviceAdaptiveShares& out, cudaStream_t stream);

// Maps the batch under `split` (rank batch.rank) and counts it like route_and_record.
// InvalidArgument for more than 12288 experts (the running counts live in shared memory).
void route_split_and_record(const DispatchTablesView& tables, const RouteBatch& batch,
                            const LoadRingView& ring, cudaStream_t stream);

// Maps the batch under `adaptive` with the shares of compute_adaptive_shares and `prefix`
// (device [experts]: the tokens of each expert on the ranks below this one), and counts it.
void route_adaptive_and_record(const DispatchTablesView& tables, const DeviceAdaptiveShares& shares,
                               const int64_t* prefix, const RouteBatch& batch,
                               const LoadRingView& ring, cudaStream_t stream);

// The kernels' per-entry choices of split and adaptive, compiled for the host from the device
// source, for tests without a GPU: the slots of a whole batch (host pointers), entry by entry
// as the warp assigns them. `shares` and `prefix` are null for split.
void kernel_route_ordered(const DispatchTablesView& tables, const int32_t* expert_ids,
                          int64_t entries, uint32_t rank, const int64_t* shares,
                          const int64_t* prefix, int32_t* slots);

// The kernel's hash and per-entry choice, compiled for the host from the same source as the
// device code, so they can be checked against routing::dispatch_hash and routing::choose_slot
// without a GPU. kernel_choose_slot reads `tables` through its pointers: here they point to
// host memory.
uint32_t kernel_dispatch_hash(uint64_t token_index, uint32_t rank);
int32_t kernel_choose_slot(const DispatchTablesView& tables, int32_t expert, uint64_t token_index,
                           uint32_t rank);

}  // namespace eplb::cuda
