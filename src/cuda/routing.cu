#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/cuda/routing.h"
#include "eplb/routing/adaptive.h"

namespace eplb::cuda {

namespace {

// Launch shape. The entries (token, k) of a batch are spread over blocks of kThreads, about
// kEntriesPerThread each: a pass of a few hundred tokens is a handful of blocks, so each
// block's shared histogram is flushed to the ring with few global atomics.
constexpr int kThreads = 256;
constexpr int kEntriesPerThread = 4;
constexpr int kMaxBlocks = 1024;
constexpr int kAdvanceThreads = 1024;
// Experts whose int32 histogram fits the default 48 KiB of dynamic shared memory; above it
// the kernel adds to the ring directly.
constexpr int64_t kMaxSharedHistogramExperts = (48 * 1024) / sizeof(int32_t);

// Wraps the return codes of the CUDA runtime: a failed call throws eplb::Error naming it.
void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // a later launch check must not see this error again
    fail<Error>("CUDA ", what, " failed: ", cudaGetErrorName(status), " (",
                cudaGetErrorString(status), ")");
  }
}

void check_not_capturing(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone) {
    fail(what,
         " was called on a stream that is being captured: it copies from host memory "
         "the graph would read again at every replay; call it before the replay instead");
  }
}

// The mixer of eplb/core/hash.h and the hash of routing::dispatch_hash, restated for the
// device bit for bit (tested against them by kernel_dispatch_hash).
__host__ __device__ inline uint64_t device_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

__host__ __device__ inline uint32_t device_dispatch_hash(uint64_t token_index, uint32_t rank) {
  return static_cast<uint32_t>(
      device_mix64(token_index + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(rank) + 1)));
}

// routing::choose_slot for kHash: replica (hash * count) >> 32 of the expert's replicas, a
// multiply-shift that is always < count. Invalid ids and counts give -1 instead of a read, and
// so does count 0 (no usable replica), as routing::choose_slot does.
__host__ __device__ inline int32_t device_choose_slot(const int32_t* log2phy,
                                                      const int32_t* replica_count, int32_t experts,
                                                      int32_t max_replicas, int32_t expert,
                                                      uint64_t token_index, uint32_t rank) {
  if (expert < 0 || expert >= experts) return -1;
  const int32_t count = replica_count[expert];
  if (count < 1 || count > max_replicas) return -1;
  const uint64_t u = device_dispatch_hash(token_index, rank);
  const int64_t replica = static_cast<int64_t>((u * static_cast<uint64_t>(count)) >> 32);
  return log2phy[static_cast<int64_t>(expert) * max_replicas + replica];
}

// The choice of split (shares == nullptr) or adaptive for the entry with ordinal `ordinal`
// among the batch's entries of `expert`: routing::split_replica or routing::adaptive_replica,
// the functions the CPU routes with. Invalid ids and counts give -1 instead of a read, and so
// does count 0 (no usable replica), as routing::route and route_adaptive do.
__host__ __device__ inline int32_t device_ordered_slot(
    const int32_t* log2phy, const int32_t* replica_count, int32_t experts, int32_t max_replicas,
    int32_t expert, int64_t ordinal, uint32_t rank, const int64_t* shares, const int64_t* prefix) {
  if (expert < 0 || expert >= experts) return -1;
  const int32_t count = replica_count[expert];
  if (count < 1 || count > max_replicas) return -1;
  const int64_t row = static_cast<int64_t>(expert) * max_replicas;
  const int32_t replica =
      shares == nullptr ? routing::split_replica(ordinal, rank, expert, count)
                        : routing::adaptive_replica(shares + row, count, prefix[expert] + ordinal);
  return log2phy[row + replica];
}

// Everything one launch needs, by value (kernel parameters are captured with the graph; the
// pointed-to values are read at run time).
struct KernelArgs {
  const int32_t* log2phy;
  const int32_t* replica_count;
  int32_t experts;
  int32_t max_replicas;
  const int32_t* expert_ids;
  int32_t* slots;
  uint32_t entries;  // tokens * top_k < 2^31
  uint32_t top_k;
  const int32_t* valid_tokens;
  const uint64_t* first_token;
  uint32_t rank;
  int64_t* counts;  // the ring
  int32_t* window_slot;
  int32_t window;
  int64_t layer_offset;  // layer * experts
  int64_t step_size;     // layers * experts
};

// The one kernel body, three instances: fused (map and count), map only, count only.
// kSharedHistogram: count into a per-block histogram in shared memory, then add each non-zero
// bin to the ring with one global atomic (experts <= kMaxSharedHistogramExperts).
template <bool kMap, bool kCount, bool kSharedHistogram>
__global__ void __launch_bounds__(kThreads) route_kernel(KernelArgs a) {
  extern __shared__ int32_t histogram[];  // [experts] when kSharedHistogram
  int32_t valid = 0;
  int64_t* counts = nullptr;  // the current step's row of this layer
  if constexpr (kCount) {
    valid = *a.valid_tokens;
    const int32_t step = *a.window_slot;
    if (step >= 0 && step < a.window) {
      counts = a.counts + static_cast<int64_t>(step) * a.step_size + a.layer_offset;
    }
    if constexpr (kSharedHistogram) {
      for (int32_t e = static_cast<int32_t>(threadIdx.x); e < a.experts;
           e += static_cast<int32_t>(blockDim.x)) {
        histogram[e] = 0;
      }
      __syncthreads();
    }
  }
  uint64_t first_token = 0;
  if constexpr (kMap) first_token = *a.first_token;

  // entries < 2^31 and the stride < 2^31, so i + stride never wraps a uint32.
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.entries; i += stride) {
    const int32_t expert = a.expert_ids[i];
    const uint32_t row = i / a.top_k;
    if constexpr (kMap) {
      a.slots[i] = device_choose_slot(a.log2phy, a.replica_count, a.experts, a.max_replicas, expert,
                                      first_token + row, a.rank);
    }
    if constexpr (kCount) {
      // row < 2^31, so the signed comparison is exact; a negative `valid` counts nothing.
      if (counts != nullptr && static_cast<int32_t>(row) < valid && expert >= 0 &&
          expert < a.experts) {
        if constexpr (kSharedHistogram) {
          atomicAdd(&histogram[expert], 1);
        } else {
          atomicAdd(reinterpret_cast<unsigned long long*>(counts + expert), 1ull);
        }
      }
    }
  }

  if constexpr (kCount && kSharedHistogram) {
    __syncthreads();
    if (counts != nullptr) {
      for (int32_t e = static_cast<int32_t>(threadIdx.x); e < a.experts;
           e += static_cast<int32_t>(blockDim.x)) {
        const int32_t c = histogram[e];
        // Two's complement: adding as unsigned is adding as int64.
        if (c != 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(counts + e),
                    static_cast<unsigned long long>(c));
        }
      }
    }
  }
}

// One block: every thread reads the current step before the barrier, thread 0 writes the next
// one after it, so no thread reads a step index another has already moved.
__global__ void __launch_bounds__(kAdvanceThreads)
    advance_window_kernel(int64_t* counts, int32_t* window_slot, int32_t window,
                          int64_t step_size) {
  const int32_t step = *window_slot;
  const int32_t next = (step >= 0 && step < window - 1) ? step + 1 : 0;
  int64_t* row = counts + static_cast<int64_t>(next) * step_size;
  for (int64_t j = threadIdx.x; j < step_size; j += blockDim.x) row[j] = 0;
  __syncthreads();
  if (threadIdx.x == 0) *window_slot = next;
}

// split and adaptive: one warp walks the batch 32 entries at a time in order. The lanes of one
// expert find each other (__match_any_sync); the lowest of them reads the expert's running
// count and adds the group's size, and each lane's ordinal is that count plus the lanes of its
// group below it: the order routing::route counts in.
constexpr int kMaxOrderedExperts = 12288;  // int32 running counts in the default shared memory

__global__ void __launch_bounds__(32)
    ordered_route_kernel(KernelArgs a, const int64_t* shares, const int64_t* prefix) {
  extern __shared__ int32_t seen[];  // [experts]
  const unsigned lane = threadIdx.x;
  for (int32_t e = static_cast<int32_t>(lane); e < a.experts; e += 32) seen[e] = 0;
  __syncwarp();
  const int32_t valid = *a.valid_tokens;
  int64_t* counts = nullptr;
  const int32_t step = *a.window_slot;
  if (step >= 0 && step < a.window) {
    counts = a.counts + static_cast<int64_t>(step) * a.step_size + a.layer_offset;
  }
  for (uint32_t base = 0; base < a.entries; base += 32) {
    const uint32_t i = base + lane;
    const bool active = i < a.entries;
    const int32_t expert = active ? a.expert_ids[i] : -1;
    const bool known = active && expert >= 0 && expert < a.experts;
    const unsigned group = __match_any_sync(0xFFFFFFFFu, known ? expert : -1);
    const int leader = __ffs(group) - 1;
    int32_t before = 0;
    if (known && static_cast<int>(lane) == leader) before = seen[expert];
    before = __shfl_sync(0xFFFFFFFFu, before, leader);
    __syncwarp();
    if (known && static_cast<int>(lane) == leader) seen[expert] = before + __popc(group);
    __syncwarp();
    if (!active) continue;
    const int64_t ordinal = before + __popc(group & ((1u << lane) - 1u));
    a.slots[i] = device_ordered_slot(a.log2phy, a.replica_count, a.experts, a.max_replicas, expert,
                                     ordinal, a.rank, shares, prefix);
    if (counts != nullptr && known && static_cast<int32_t>(i / a.top_k) < valid) {
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + expert), 1ull);
    }
  }
}

// adaptive's shares: one thread runs the CPU's solver on the step's counts. work[0] receives
// the busiest rank's load; the solver's words follow.
__global__ void adaptive_shares_kernel(routing::AdaptiveLayer layer, const int64_t* counts,
                                       int64_t* shares, int64_t* work) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    work[0] = routing::adaptive_split(layer, counts, shares, work + 1);
  }
}

// Step 1 of a launch: check the arguments on the host (no device access) and pack them.
KernelArgs pack(const DispatchTablesView& tables, const RouteBatch& batch, const LoadRingView& ring,
                const char* what) {
  EPLB_CHECK(batch.tokens >= 0, what, ": tokens ", batch.tokens, " must be >= 0");
  EPLB_CHECK(batch.top_k >= 1, what, ": top_k ", batch.top_k, " must be >= 1");
  const int64_t max_entries = std::numeric_limits<int32_t>::max();
  EPLB_CHECK(batch.tokens <= max_entries / batch.top_k, what, ": tokens ", batch.tokens,
             " x top_k ", batch.top_k, " must be below 2^31 entries");
  EPLB_CHECK(tables.experts >= 1 && tables.max_replicas >= 1, what, ": tables of ", tables.experts,
             " experts x ", tables.max_replicas, " replicas (upload the tables first)");
  EPLB_CHECK(ring.experts == tables.experts, what, ": the load ring counts ", ring.experts,
             " experts but the tables have ", tables.experts);
  EPLB_CHECK(ring.window >= 1 && ring.layers >= 1, what, ": load ring of window ", ring.window,
             " and ", ring.layers, " layers (both must be >= 1)");
  EPLB_CHECK(batch.layer >= 0 && batch.layer < ring.layers, what, ": layer ", batch.layer,
             " is outside [0, ", ring.layers, ")");
  EPLB_CHECK(batch.rank >= 0 && batch.rank <= std::numeric_limits<uint32_t>::max(), what, ": rank ",
             batch.rank, " is outside [0, 2^32)");
  const bool empty = batch.tokens == 0;
  EPLB_CHECK(empty || (batch.expert_ids != nullptr && batch.slots != nullptr &&
                       batch.valid_tokens != nullptr && batch.first_token != nullptr),
             what,
             ": expert_ids, slots, valid_tokens and first_token must all be device "
             "pointers");
  EPLB_CHECK(empty || (tables.log2phy != nullptr && tables.replica_count != nullptr &&
                       ring.counts != nullptr && ring.window_slot != nullptr),
             what, ": the tables and the load ring must be device pointers");

  KernelArgs a{};
  a.log2phy = tables.log2phy;
  a.replica_count = tables.replica_count;
  a.experts = tables.experts;
  a.max_replicas = tables.max_replicas;
  a.expert_ids = batch.expert_ids;
  a.slots = batch.slots;
  a.entries = static_cast<uint32_t>(batch.tokens * batch.top_k);
  a.top_k = static_cast<uint32_t>(batch.top_k);
  a.valid_tokens = batch.valid_tokens;
  a.first_token = batch.first_token;
  a.rank = static_cast<uint32_t>(batch.rank);
  a.counts = ring.counts;
  a.window_slot = ring.window_slot;
  a.window = ring.window;
  a.layer_offset = batch.layer * static_cast<int64_t>(ring.experts);
  a.step_size = static_cast<int64_t>(ring.layers) * ring.experts;
  return a;
}

unsigned blocks_for(uint32_t entries) {
  const uint64_t per_block = static_cast<uint64_t>(kThreads) * kEntriesPerThread;
  const uint64_t blocks = (entries + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<uint64_t>(blocks, 1, kMaxBlocks));
}

template <bool kMap, bool kCount>
void launch(const KernelArgs& a, cudaStream_t stream, const char* what) {
  const unsigned blocks = blocks_for(a.entries);
  if constexpr (kCount) {
    if (a.experts <= kMaxSharedHistogramExperts) {
      const size_t shared = static_cast<size_t>(a.experts) * sizeof(int32_t);
      route_kernel<kMap, kCount, true><<<blocks, kThreads, shared, stream>>>(a);
    } else {
      route_kernel<kMap, kCount, false><<<blocks, kThreads, 0, stream>>>(a);
    }
  } else {
    route_kernel<kMap, kCount, false><<<blocks, kThreads, 0, stream>>>(a);
  }
  check(cudaGetLastError(), what);
}

void* device_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, bytes);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    fail<Error>("cudaMalloc of ", bytes, " bytes for ", what, " failed: ", cudaGetErrorName(status),
                " (", cudaGetErrorString(status), ")");
  }
  return p;
}

void* pinned_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t status = cudaMallocHost(&p, bytes);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    fail<Error>("cudaMallocHost of ", bytes, " bytes for ", what,
                " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  }
  return p;
}

}  // namespace

// ---- DeviceDispatchTables ----

DeviceDispatchTables::DeviceDispatchTables(const routing::DispatchTables& tables,
                                           int64_t max_replicas, cudaStream_t stream)
    : experts_(tables.experts), max_replicas_(max_replicas) {
  EPLB_CHECK(experts_ >= 1 && experts_ <= std::numeric_limits<int32_t>::max(),
             "device dispatch tables: experts ", experts_, " must be in [1, 2^31)");
  EPLB_CHECK(max_replicas_ >= 1 && max_replicas_ >= tables.max_replicas,
             "device dispatch tables: capacity of ", max_replicas_,
             " replicas per expert is below the tables' ", tables.max_replicas,
             " (give the most any placement of the layer can have: physical - experts + 1)");
  EPLB_CHECK(max_replicas_ < std::numeric_limits<int32_t>::max() / experts_ - 1,
             "device dispatch tables: ", experts_, " experts x ", max_replicas_,
             " replicas is too large");
  check_not_capturing(stream, "DeviceDispatchTables");
  const size_t bytes = static_cast<size_t>(experts_ * (max_replicas_ + 1)) * sizeof(int32_t);
  device_ = static_cast<int32_t*>(device_alloc(bytes, "dispatch tables"));
  try {
    staging_ = static_cast<int32_t*>(pinned_alloc(bytes, "dispatch table staging"));
    check(cudaEventCreateWithFlags(&staging_free_, cudaEventDisableTiming), "cudaEventCreate");
    upload(tables, stream);
  } catch (...) {
    if (staging_free_ != nullptr) cudaEventDestroy(staging_free_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
    cudaFree(device_);
    throw;
  }
}

DeviceDispatchTables::~DeviceDispatchTables() {
  // The last copy may still be reading the staging buffer.
  if (staging_free_ != nullptr) {
    cudaEventSynchronize(staging_free_);
    cudaEventDestroy(staging_free_);
  }
  if (staging_ != nullptr) cudaFreeHost(staging_);
  if (device_ != nullptr) cudaFree(device_);
}

void DeviceDispatchTables::upload(const routing::DispatchTables& tables, cudaStream_t stream) {
  // Step 1: the tables fit the capacity and every count is one the kernel can use.
  EPLB_CHECK(tables.experts == experts_, "upload: tables of ", tables.experts,
             " experts into device tables of ", experts_);
  EPLB_CHECK(tables.max_replicas >= 1 && tables.max_replicas <= max_replicas_,
             "upload: ", tables.max_replicas,
             " replicas per expert, the device tables hold at most ", max_replicas_);
  const int64_t width = tables.max_replicas;
  EPLB_CHECK(static_cast<int64_t>(tables.log2phy.size()) == experts_ * width &&
                 static_cast<int64_t>(tables.replica_count.size()) == experts_,
             "upload: log2phy has ", tables.log2phy.size(), " entries and replica_count ",
             tables.replica_count.size(), ", expected ", experts_ * width, " and ", experts_);
  // A count of 0 is an expert without a usable replica (dispatch.h): the kernels route it to -1.
  for (int64_t e = 0; e < experts_; ++e) {
    const int32_t count = tables.replica_count[static_cast<size_t>(e)];
    if (count < 0 || count > width) {
      fail("upload: expert ", e, " has ", count, " replicas, expected 0 to ", width);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int32_t slot = tables.log2phy[static_cast<size_t>(e * width + i)];
      if (slot < 0) fail("upload: expert ", e, " replica ", i, " is slot ", slot);
    }
  }
  check_not_capturing(stream, "DeviceDispatchTables::upload");

  // Step 2: wait until the previous copy has left the staging buffer (normally long ago),
  // then repack the rows to the capacity's stride, padded with -1.
  check(cudaEventSynchronize(staging_free_), "cudaEventSynchronize");
  int32_t* log2phy = staging_;
  int32_t* counts = staging_ + experts_ * max_replicas_;
  for (int64_t e = 0; e < experts_; ++e) {
    int32_t* row = log2phy + e * max_replicas_;
    std::fill(row, row + max_replicas_, -1);
    std::memcpy(row, tables.log2phy.data() + e * width,
                static_cast<size_t>(width) * sizeof(int32_t));
    counts[e] = tables.replica_count[static_cast<size_t>(e)];
  }

  // Step 3: one stream-ordered copy, and the event the next upload waits on.
  const size_t bytes = static_cast<size_t>(experts_ * (max_replicas_ + 1)) * sizeof(int32_t);
  check(cudaMemcpyAsync(device_, staging_, bytes, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (dispatch tables)");
  check(cudaEventRecord(staging_free_, stream), "cudaEventRecord");
}

DispatchTablesView DeviceDispatchTables::view() const {
  DispatchTablesView v;
  v.log2phy = device_;
  v.replica_count = device_ + experts_ * max_replicas_;
  v.experts = static_cast<int32_t>(experts_);
  v.max_replicas = static_cast<int32_t>(max_replicas_);
  return v;
}

// ---- DeviceLoadRing ----

DeviceLoadRing::DeviceLoadRing(int64_t layers, int64_t experts, int64_t window,
                               cudaStream_t stream) {
  const int64_t int32_max = std::numeric_limits<int32_t>::max();
  EPLB_CHECK(layers >= 1 && layers <= int32_max && experts >= 1 && experts <= int32_max,
             "device load ring: layers ", layers, " and experts ", experts, " must be >= 1");
  EPLB_CHECK(window >= 1 && window <= int32_max, "device load ring: window ", window,
             " must be at least 1 step");
  EPLB_CHECK(layers * experts <= (int64_t{1} << 40) / window, "device load ring: ", window,
             " steps x ", layers, " layers x ", experts, " experts is too large");
  check_not_capturing(stream, "DeviceLoadRing");
  view_.window = static_cast<int32_t>(window);
  view_.layers = static_cast<int32_t>(layers);
  view_.experts = static_cast<int32_t>(experts);
  const size_t count_bytes = static_cast<size_t>(window * layers * experts) * sizeof(int64_t);
  // One allocation: the counts, then the step index (int64 alignment is kept).
  char* memory = static_cast<char*>(device_alloc(count_bytes + sizeof(int64_t), "load ring"));
  view_.counts = reinterpret_cast<int64_t*>(memory);
  view_.window_slot = reinterpret_cast<int32_t*>(memory + count_bytes);
  const cudaError_t status = cudaMemsetAsync(memory, 0, count_bytes + sizeof(int64_t), stream);
  if (status != cudaSuccess) {
    cudaFree(memory);
    check(status, "cudaMemsetAsync (load ring)");
  }
}

DeviceLoadRing::~DeviceLoadRing() {
  if (view_.counts != nullptr) cudaFree(view_.counts);
}

LoadRingView DeviceLoadRing::view() const { return view_; }

int32_t DeviceLoadRing::read(std::span<int64_t> out, cudaStream_t stream) const {
  const size_t cells = static_cast<size_t>(view_.window) * static_cast<size_t>(view_.layers) *
                       static_cast<size_t>(view_.experts);
  EPLB_CHECK_EQ(out.size(), cells, "DeviceLoadRing::read: out must hold window x layers x experts");
  int32_t step = -1;
  check(cudaMemcpyAsync(out.data(), view_.counts, cells * sizeof(int64_t), cudaMemcpyDeviceToHost,
                        stream),
        "cudaMemcpyAsync (load ring)");
  check(cudaMemcpyAsync(&step, view_.window_slot, sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (window slot)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return step;
}

// ---- DeviceStepInputs ----

struct DeviceStepInputs::Values {
  uint64_t first_token;
  int32_t valid_tokens;
  int32_t unused;
};

DeviceStepInputs::DeviceStepInputs(cudaStream_t stream) {
  check_not_capturing(stream, "DeviceStepInputs");
  device_ = static_cast<Values*>(device_alloc(sizeof(Values), "step inputs"));
  try {
    staging_ = static_cast<Values*>(pinned_alloc(sizeof(Values) * kStaging, "step inputs"));
    for (cudaEvent_t& event : copied_) {
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    }
    set(0, 0, stream);
  } catch (...) {
    for (cudaEvent_t event : copied_) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (staging_ != nullptr) cudaFreeHost(staging_);
    cudaFree(device_);
    throw;
  }
}

DeviceStepInputs::~DeviceStepInputs() {
  for (cudaEvent_t event : copied_) {
    if (event != nullptr) {
      cudaEventSynchronize(event);
      cudaEventDestroy(event);
    }
  }
  if (staging_ != nullptr) cudaFreeHost(staging_);
  if (device_ != nullptr) cudaFree(device_);
}

void DeviceStepInputs::set(uint64_t first_token, int32_t valid_tokens, cudaStream_t stream) {
  check_not_capturing(stream, "DeviceStepInputs::set");
  // Each pass uses the next staging buffer; it is reused kStaging passes later, once the copy
  // that read it has run (the wait only blocks a host that is kStaging passes ahead).
  const int64_t i = next_ % kStaging;
  check(cudaEventSynchronize(copied_[i]), "cudaEventSynchronize");
  staging_[i] = Values{first_token, valid_tokens, 0};
  check(cudaMemcpyAsync(device_, &staging_[i], sizeof(Values), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (step inputs)");
  check(cudaEventRecord(copied_[i], stream), "cudaEventRecord");
  ++next_;
}

const int32_t* DeviceStepInputs::valid_tokens() const { return &device_->valid_tokens; }
const uint64_t* DeviceStepInputs::first_token() const { return &device_->first_token; }

// ---- Launches ----

void route_and_record(const DispatchTablesView& tables, const RouteBatch& batch,
                      const LoadRingView& ring, cudaStream_t stream) {
  const KernelArgs a = pack(tables, batch, ring, "route_and_record");
  if (a.entries == 0) return;
  launch<true, true>(a, stream, "route_and_record launch");
}

void route_then_record(const DispatchTablesView& tables, const RouteBatch& batch,
                       const LoadRingView& ring, cudaStream_t stream) {
  const KernelArgs a = pack(tables, batch, ring, "route_then_record");
  if (a.entries == 0) return;
  launch<true, false>(a, stream, "route_then_record map launch");
  launch<false, true>(a, stream, "route_then_record count launch");
}

void advance_window(const LoadRingView& ring, cudaStream_t stream) {
  EPLB_CHECK(ring.counts != nullptr && ring.window_slot != nullptr && ring.window >= 1 &&
                 ring.layers >= 1 && ring.experts >= 1,
             "advance_window: load ring of window ", ring.window, ", ", ring.layers, " layers and ",
             ring.experts, " experts (none may be empty)");
  const int64_t step_size = static_cast<int64_t>(ring.layers) * ring.experts;
  advance_window_kernel<<<1, kAdvanceThreads, 0, stream>>>(ring.counts, ring.window_slot,
                                                           ring.window, step_size);
  check(cudaGetLastError(), "advance_window launch");
}

// ---- split and adaptive ----

DeviceAdaptiveShares::DeviceAdaptiveShares(int64_t experts, int64_t max_replicas,
                                           const RankShape& shape)
    : experts_(experts), max_replicas_(max_replicas), shape_(shape) {
  EPLB_CHECK(experts >= 1 && experts <= std::numeric_limits<int32_t>::max() && max_replicas >= 1 &&
                 max_replicas <= std::numeric_limits<int32_t>::max() &&
                 experts <= std::numeric_limits<int64_t>::max() / max_replicas,
             "device adaptive shares: ", experts, " experts x ", max_replicas,
             " replicas (both must be in [1, 2^31))");
  EPLB_CHECK(shape.ranks >= 1 && shape.slots_per_rank >= 1, "device adaptive shares: ", shape.ranks,
             " ranks of ", shape.slots_per_rank, " slots (both must be >= 1)");
  const int64_t words = routing::adaptive_workspace_words(
      experts, shape.ranks, static_cast<int64_t>(shape.ranks) * shape.slots_per_rank);
  shares_ = static_cast<int64_t*>(device_alloc(
      static_cast<size_t>(experts * max_replicas) * sizeof(int64_t), "adaptive shares"));
  try {
    work_ = static_cast<int64_t*>(
        device_alloc(static_cast<size_t>(words + 1) * sizeof(int64_t), "adaptive workspace"));
  } catch (...) {
    cudaFree(shares_);
    throw;
  }
}

DeviceAdaptiveShares::~DeviceAdaptiveShares() {
  if (work_ != nullptr) cudaFree(work_);
  if (shares_ != nullptr) cudaFree(shares_);
}

void compute_adaptive_shares(const DispatchTablesView& tables, const int64_t* global_counts,
                             DeviceAdaptiveShares& out, cudaStream_t stream) {
  EPLB_CHECK(tables.experts == out.experts() && tables.max_replicas == out.max_replicas(),
             "compute_adaptive_shares: tables of ", tables.experts, " experts x ",
             tables.max_replicas, " replicas, shares sized for ", out.experts(), " x ",
             out.max_replicas());
  EPLB_CHECK(
      tables.log2phy != nullptr && tables.replica_count != nullptr && global_counts != nullptr,
      "compute_adaptive_shares: the tables and the counts must be device pointers");
  const routing::AdaptiveLayer layer{.log2phy = tables.log2phy,
                                     .replica_count = tables.replica_count,
                                     .experts = tables.experts,
                                     .max_replicas = tables.max_replicas,
                                     .ranks = out.shape().ranks,
                                     .slots_per_rank = out.shape().slots_per_rank};
  adaptive_shares_kernel<<<1, 1, 0, stream>>>(layer, global_counts, out.shares(), out.workspace());
  check(cudaGetLastError(), "compute_adaptive_shares launch");
}

namespace {

void launch_ordered(const KernelArgs& a, const int64_t* shares, const int64_t* prefix,
                    cudaStream_t stream, const char* what) {
  EPLB_CHECK(a.experts <= kMaxOrderedExperts, what, ": ", a.experts,
             " experts; split and adaptive dispatch keep a running count per expert in shared "
             "memory, at most ",
             kMaxOrderedExperts);
  if (a.entries == 0) return;
  const size_t shared = static_cast<size_t>(a.experts) * sizeof(int32_t);
  ordered_route_kernel<<<1, 32, shared, stream>>>(a, shares, prefix);
  check(cudaGetLastError(), what);
}

}  // namespace

void route_split_and_record(const DispatchTablesView& tables, const RouteBatch& batch,
                            const LoadRingView& ring, cudaStream_t stream) {
  const KernelArgs a = pack(tables, batch, ring, "route_split_and_record");
  launch_ordered(a, nullptr, nullptr, stream, "route_split_and_record");
}

void route_adaptive_and_record(const DispatchTablesView& tables, const DeviceAdaptiveShares& shares,
                               const int64_t* prefix, const RouteBatch& batch,
                               const LoadRingView& ring, cudaStream_t stream) {
  const KernelArgs a = pack(tables, batch, ring, "route_adaptive_and_record");
  EPLB_CHECK(tables.experts == shares.experts() && tables.max_replicas == shares.max_replicas(),
             "route_adaptive_and_record: shares of ", shares.experts(), " x ",
             shares.max_replicas(), " for tables of ", tables.experts, " x ", tables.max_replicas);
  EPLB_CHECK(prefix != nullptr, "route_adaptive_and_record: prefix must be a device pointer");
  launch_ordered(a, shares.shares(), prefix, stream, "route_adaptive_and_record");
}

void kernel_route_ordered(const DispatchTablesView& tables, const int32_t* expert_ids,
                          int64_t entries, uint32_t rank, const int64_t* shares,
                          const int64_t* prefix, int32_t* slots) {
  std::vector<int64_t> seen(static_cast<size_t>(std::max<int32_t>(tables.experts, 0)), 0);
  for (int64_t i = 0; i < entries; ++i) {
    const int32_t e = expert_ids[i];
    const bool known = e >= 0 && e < tables.experts;
    slots[i] =
        device_ordered_slot(tables.log2phy, tables.replica_count, tables.experts,
                            tables.max_replicas, e, known ? seen[e] : 0, rank, shares, prefix);
    if (known) ++seen[e];
  }
}

uint32_t kernel_dispatch_hash(uint64_t token_index, uint32_t rank) {
  return device_dispatch_hash(token_index, rank);
}

int32_t kernel_choose_slot(const DispatchTablesView& tables, int32_t expert, uint64_t token_index,
                           uint32_t rank) {
  return device_choose_slot(tables.log2phy, tables.replica_count, tables.experts,
                            tables.max_replicas, expert, token_index, rank);
}

}  // namespace eplb::cuda
