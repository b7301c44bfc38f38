#include "transport/cuda/transport.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/descriptor.h"
#include "transport/memfd.h"
#include "transport/process.h"

namespace eplb::transport::cuda {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kBackend = "cuda";
constexpr std::uint16_t kVersion = 1;
constexpr std::uint64_t kControlMagic = 0x4144554342504c45ull;  // "EPLBCUDA"
// Allocations are whole multiples of the GPU's large page, so that an exported handle maps only
// the bytes of its own region.
constexpr std::size_t kGranularity = std::size_t{2} << 20;

// ---- CUDA errors -------------------------------------------------------------------------------

std::string describe(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) + ")";
}

// Clears the runtime's record of a failed call (non-sticky errors only stay there), so it does
// not surface later in the caller's own error checks on this thread.
void forget(cudaError_t error) {
  if (error != cudaSuccess) (void)cudaGetLastError();
}

// The one wrapper of CUDA return codes in this backend: IoError naming the call.
void check(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  forget(error);
  fail<IoError>("cuda: ", call, " failed: ", describe(error));
}

// The runtime's worker calls the transport while the engine may be capturing a CUDA graph on
// another thread in the default (global) mode, which forbids "unsafe" calls (event queries and
// synchronizes among them) on every thread whose own mode is global, and invalidates the
// capture. These calls take no part in any capture: thread-local mode for their duration.
class CaptureModeGuard {
 public:
  CaptureModeGuard() { forget(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~CaptureModeGuard() { forget(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  CaptureModeGuard(const CaptureModeGuard&) = delete;
  CaptureModeGuard& operator=(const CaptureModeGuard&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeThreadLocal;
};

// Makes `device` current on this thread for one call of the Transport, and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device_) check(cudaSetDevice(device_), "cudaSetDevice");
  }
  // For destructors: never throws; a failed switch leaves the caller's device in place.
  DeviceGuard(int device, std::nothrow_t) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) forget(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_) forget(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  CaptureModeGuard capture_;  // first: in place before any call below
  int device_;
  int previous_ = -1;
};

// ---- GPUs --------------------------------------------------------------------------------------

// Which GPU a descriptor's memory lives on: the UUID decides, the PCI address is for messages.
struct GpuIdentity {
  unsigned char uuid[16] = {};
  char pci_bus_id[32] = {};  // "0000:3b:00.0"

  bool operator==(const GpuIdentity& other) const {
    return std::memcmp(uuid, other.uuid, sizeof uuid) == 0;
  }
};

std::string uuid_text(const unsigned char (&uuid)[16]) {
  // The form nvidia-smi prints: GPU-8-4-4-4-12 hex digits.
  std::string text = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    std::snprintf(hex, sizeof hex, "%02x", uuid[i]);
    text += hex;
  }
  return text;
}

std::string name_of(const GpuIdentity& gpu) {
  std::string pci(gpu.pci_bus_id, strnlen(gpu.pci_bus_id, sizeof gpu.pci_bus_id));
  for (char& c : pci) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return pci + " (" + uuid_text(gpu.uuid) + ")";
}

GpuIdentity identity_of(int device) {
  GpuIdentity gpu;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  static_assert(sizeof prop.uuid == sizeof gpu.uuid);
  std::memcpy(gpu.uuid, &prop.uuid, sizeof gpu.uuid);
  check(cudaDeviceGetPCIBusId(gpu.pci_bus_id, sizeof gpu.pci_bus_id - 1, device),
        "cudaDeviceGetPCIBusId");
  return gpu;
}

// ---- Regions and peers -------------------------------------------------------------------------

struct OwnRegion {
  std::byte* data = nullptr;  // device memory, the base of its own cudaMalloc allocation
  std::size_t bytes = 0;      // the region's size (the allocation is rounded up)
  cudaIpcMemHandle_t handle{};
};

// What this rank knows of a peer after importing its descriptor. Batches hold the views they read
// from, so a view (and the peer's memory mapped in it) outlives a re-import until those batches
// are gone.
struct PeerView {
  int rank = -1;
  bool self = false;
  int device = -1;  // this rank's device: the context the handles are open in
  Segment control;  // the owner's control page, mapped read-only
  PeerProcess process;
  std::vector<std::byte*> regions;   // [region id] the peer's memory mapped here
  std::vector<std::uint64_t> bytes;  // [region id]

  PeerView() = default;
  PeerView(const PeerView&) = delete;
  PeerView& operator=(const PeerView&) = delete;
  ~PeerView() {
    if (regions.empty()) return;
    DeviceGuard guard(device, std::nothrow);
    for (std::byte* p : regions) forget(cudaIpcCloseMemHandle(p));
  }

  bool open() const { return control_page(control)->open.load(std::memory_order_acquire) != 0; }
};

using PeerViews = std::vector<std::shared_ptr<const PeerView>>;

// After a batch's copies have landed: every owner read from must still be open and alive.
// "" when they are. Owners are checked with one poll() over their pidfds.
std::string check_owners(const PeerViews& owners) {
  std::vector<const PeerProcess*> watched;
  for (const auto& v : owners) {
    if (!v->open()) return "cuda: rank " + std::to_string(v->rank) + " closed its transport";
    watched.push_back(&v->process);
  }
  if (all_alive(watched)) return "";
  for (const auto& v : owners) {
    if (!v->process.alive()) {
      return "cuda: rank " + std::to_string(v->rank) + " is gone (its process exited)";
    }
  }
  return "";
}

std::string rank_list(const PeerViews& owners, bool self) {
  std::string out;
  for (const auto& v : owners) out += (out.empty() ? "" : ",") + std::to_string(v->rank);
  if (self) out += out.empty() ? "self" : ",self";
  return out;
}

// ---- Batches -----------------------------------------------------------------------------------

class CudaBatch final : public Batch {
 public:
  CudaBatch(cudaEvent_t event, PeerViews owners, bool self, std::size_t reads)
      : event_(event), owners_(std::move(owners)), self_(self), reads_(reads) {}

  ~CudaBatch() override {
    CaptureModeGuard capture;
    // A copy cannot be cancelled: wait for it, so nothing lands in a destination after this.
    if (state_ == State::kPending) forget(cudaEventSynchronize(event_));
    forget(cudaEventDestroy(event_));
  }

  Progress poll() override {
    if (state_ == State::kDone) return Progress::kDone;
    if (state_ == State::kFailed) fail<IoError>(error_);
    CaptureModeGuard capture;
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return Progress::kPending;
    if (status != cudaSuccess) {
      forget(status);
      settle("cuda: a batch of " + std::to_string(reads_) + " reads from rank(s) " +
             rank_list(owners_, self_) + " failed on the device: " + describe(status));
    } else {
      settle(check_owners(owners_));
    }
    if (state_ == State::kFailed) fail<IoError>(error_);
    return Progress::kDone;
  }

  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto pause = std::chrono::microseconds(10);
    while (poll() == Progress::kPending) {
      const auto now = Clock::now();
      if (now >= deadline) {
        fail<Timeout>("cuda: a batch of ", reads_, " reads from rank(s) ",
                      rank_list(owners_, self_), " not done after ", timeout.count(), " ms");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  enum class State { kPending, kDone, kFailed };

  void settle(std::string error) {
    error_ = std::move(error);
    state_ = error_.empty() ? State::kDone : State::kFailed;
  }

  cudaEvent_t event_;
  PeerViews owners_;  // peers read (not this rank), each once
  bool self_;
  std::size_t reads_;
  State state_ = State::kPending;
  std::string error_;
};

// ---- The transport -----------------------------------------------------------------------------

// How post() issues its copies (EPLB_CUDA_COPY): kAuto one cudaMemcpyBatchAsync per batch with the
// overlap-with-compute hint, read by read where the driver refuses it; kBatch that call only;
// kMemcpy one cudaMemcpyAsync per read.
enum class CopyPath { kAuto, kBatch, kMemcpy };

CopyPath copy_path_from_environment() {
  const char* value = std::getenv("EPLB_CUDA_COPY");
  if (value == nullptr || *value == '\0' || std::string_view(value) == "auto") {
    return CopyPath::kAuto;
  }
  if (std::string_view(value) == "batch") return CopyPath::kBatch;
  if (std::string_view(value) == "memcpy") return CopyPath::kMemcpy;
  fail<InvalidArgument>("EPLB_CUDA_COPY=", value, " is not a copy path of the cuda transport ",
                        "(auto, batch or memcpy)");
}

class CudaTransport final : public Transport {
 public:
  CudaTransport(const Options& options, int device, CopyPath copy_path)
      : rank_(options.rank),
        device_(device),
        identity_(ProcessIdentity::self()),
        copy_path_(copy_path) {
    DeviceGuard guard(device_);
    gpu_ = identity_of(device_);
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    for (int d = 0; d < count; ++d) visible_.push_back(identity_of(d));
    // The lowest priority: the engine's kernels go first wherever the GPU orders work.
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, least),
          "cudaStreamCreateWithPriority");
    try {
      control_ = create_segment(kBackend, "eplb-cuda-control", sizeof(ControlPage));
      new (control_.data) ControlPage{kControlMagic, {1}};
    } catch (...) {
      forget(cudaStreamDestroy(stream_));
      throw;
    }
  }
  ~CudaTransport() override { close(); }

  std::string_view backend() const override { return kBackend; }
  int rank() const override { return rank_; }
  Capabilities capabilities() const override {
    return {
        .device_memory = true, .one_sided = true, .register_memory = false, .cross_node = false};
  }

  Region allocate(std::size_t bytes) override {
    EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate() needs a positive size");
    check_open();
    if (bytes > SIZE_MAX - kGranularity) {
      fail<InvalidArgument>("cuda: cannot allocate ", bytes, " bytes (too large)");
    }
    const std::size_t rounded = (bytes + kGranularity - 1) / kGranularity * kGranularity;
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, rounded);
    if (status != cudaSuccess) {
      forget(status);
      std::size_t free_bytes = 0, total = 0;
      forget(cudaMemGetInfo(&free_bytes, &total));
      fail<IoError>("cuda: cannot allocate a region of ", bytes, " bytes on GPU ", name_of(gpu_),
                    ": ", describe(status), " (", free_bytes, " of ", total, " bytes free)");
    }
    OwnRegion region;
    region.data = static_cast<std::byte*>(p);
    region.bytes = bytes;
    try {
      check(cudaMemsetAsync(p, 0, rounded, stream_), "cudaMemsetAsync (zero-fill a region)");
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (zero-fill a region)");
      check(cudaIpcGetMemHandle(&region.handle, p), "cudaIpcGetMemHandle");
    } catch (...) {
      forget(cudaFree(p));
      throw;
    }
    regions_.push_back(region);
    return {static_cast<int>(regions_.size()) - 1, region.data, region.bytes};
  }

  Region register_memory(void*, std::size_t) override {
    fail<NotSupported>("cuda cannot serve reads from caller memory (CUDA IPC exports only whole ",
                       "allocations it can vouch for): use allocate(), which returns device ",
                       "memory, and place the data there");
  }

  std::vector<std::byte> export_descriptor() const override {
    check_open();
    DescriptorWriter out(kBackend, kVersion, rank_);
    out.put(identity_);
    out.put(static_cast<std::int32_t>(control_.fd));
    out.put(control_.inode);
    out.put(gpu_);
    out.put(static_cast<std::uint32_t>(regions_.size()));
    for (const OwnRegion& r : regions_) {
      out.put(r.handle);
      out.put(static_cast<std::uint64_t>(r.bytes));
    }
    return std::move(out).finish();
  }

  void import_descriptor(int peer, std::span<const std::byte> descriptor) override {
    EPLB_CHECK_GE(peer, 0, "import_descriptor(): peer rank must be >= 0");
    check_open();
    // Step 1: read and check the whole descriptor before touching anything.
    DescriptorReader in(descriptor, kBackend, kVersion);
    if (in.rank() != peer) {
      fail<InvalidArgument>("descriptor of rank ", in.rank(), " imported as peer ", peer,
                            ": hand each rank's descriptor to its own slot");
    }
    const auto identity = in.get<ProcessIdentity>("process identity");
    const auto control_fd = in.get<std::int32_t>("control fd");
    const auto control_inode = in.get<std::uint64_t>("control inode");
    const auto gpu = in.get<GpuIdentity>("GPU identity");
    const auto count = in.get<std::uint32_t>("region count");
    struct Entry {
      cudaIpcMemHandle_t handle;
      std::uint64_t bytes;
    };
    std::vector<Entry> entries;
    entries.reserve(std::min<std::uint32_t>(count, 4096));  // a corrupt count fails below
    for (std::uint32_t i = 0; i < count; ++i) {
      Entry e;
      e.handle = in.get<cudaIpcMemHandle_t>("region IPC handle");
      e.bytes = in.get<std::uint64_t>("region size");
      entries.push_back(e);
    }
    in.expect_end();
    if (!identity.same_machine_as(identity_)) {
      fail<InvalidArgument>("cuda descriptor of rank ", peer, " comes from another machine or ",
                            "pid namespace: cuda connects processes of one machine; use ucx");
    }

    auto view = std::make_shared<PeerView>();
    view->rank = peer;
    for (const Entry& e : entries) view->bytes.push_back(e.bytes);
    if (identity == identity_) {
      // Step 2a: this process. CUDA IPC cannot open a process's own handles: own regions are
      // read through their local pointers.
      if (peer != rank_ || control_inode != control_.inode) {
        fail<InvalidArgument>("cuda descriptor imported as peer ", peer, " comes from this ",
                              "process, which is rank ", rank_, " (CUDA IPC cannot open a ",
                              "process's own memory: cuda ranks are separate processes)");
      }
      view->self = true;
    } else {
      // Step 2b: the owner's GPU must be one this rank's GPU can read.
      const int owner_device = device_of(gpu);
      if (owner_device < 0) {
        fail<InvalidArgument>("cuda descriptor of rank ", peer, " is for GPU ", name_of(gpu),
                              ", which this process cannot see (this rank uses GPU ", name_of(gpu_),
                              "): it comes from another machine, or ",
                              "CUDA_VISIBLE_DEVICES hides that GPU here");
      }
      if (owner_device != device_) {
        int can = 0;
        check(cudaDeviceCanAccessPeer(&can, device_, owner_device), "cudaDeviceCanAccessPeer");
        if (can == 0) {
          fail<InvalidArgument>("cuda descriptor of rank ", peer, " is for GPU ", name_of(gpu),
                                ", which GPU ", name_of(gpu_), " of this rank cannot access ",
                                "(no peer access between them); use ucx between these ranks");
        }
      }
      // Step 3: the owner must be alive and open; then map its memory, once.
      view->process = PeerProcess(identity);
      view->control = map_peer_segment(kBackend, peer, identity.pid, control_fd, control_inode,
                                       sizeof(ControlPage));
      if (control_page(view->control)->magic != kControlMagic) {
        fail<InvalidArgument>("cuda descriptor of rank ", peer, " points at memory that is not ",
                              "an eplb cuda control page");
      }
      if (!view->open()) fail<IoError>("cuda: rank ", peer, " closed its transport");
      DeviceGuard guard(device_);
      view->device = device_;
      for (std::size_t i = 0; i < entries.size(); ++i) {
        void* p = nullptr;
        const cudaError_t status =
            cudaIpcOpenMemHandle(&p, entries[i].handle, cudaIpcMemLazyEnablePeerAccess);
        if (status != cudaSuccess) {
          forget(status);
          fail_open(peer, i, *view, status);
        }
        view->regions.push_back(static_cast<std::byte*>(p));
      }
    }
    if (peers_.size() <= static_cast<std::size_t>(peer)) peers_.resize(peer + 1);
    peers_[peer] = std::move(view);
  }

  bool one_sided_to(int) const override { return true; }

  std::unique_ptr<Batch> post(std::span<const Read> reads) override {
    check_open();
    // Step 1: check every read; start none if one is bad.
    std::vector<std::uint64_t> own_bytes;
    for (const OwnRegion& r : regions_) own_bytes.push_back(r.bytes);
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const Read& r = reads[i];
      check_read(r, i,
                 is_self(r.peer) ? std::span<const std::uint64_t>(own_bytes)
                                 : std::span<const std::uint64_t>(view_of(r, i).bytes));
    }
    // Step 2: an owner already closed or gone fails the batch before any copy touches its
    // memory (a closed owner has freed it); the same check runs again once the copies landed.
    PeerViews owners;
    bool self = false;
    for (const Read& r : reads) {
      if (is_self(r.peer)) {
        self = true;
        continue;
      }
      const auto& view = peers_[static_cast<std::size_t>(r.peer)];
      if (std::find(owners.begin(), owners.end(), view) == owners.end()) owners.push_back(view);
    }
    if (std::string error = check_owners(owners); !error.empty()) {
      return std::make_unique<SettledBatch>(std::move(error));
    }
    // Step 3: the copies on this rank's stream, then the batch's event.
    DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (!copy_batched(reads, event)) copy_one_by_one(reads, event);
    const cudaError_t status = cudaEventRecord(event, stream_);
    if (status != cudaSuccess) {
      forget(status);
      abandon(event);
      fail<IoError>("cuda: cudaEventRecord failed: ", describe(status));
    }
    return std::make_unique<CudaBatch>(event, std::move(owners), self, reads.size());
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    // Readers learn of the close before any memory goes.
    if (control_.data != nullptr) control_page(control_)->open.store(0, std::memory_order_release);
    DeviceGuard guard(device_, std::nothrow);
    // This rank's own reads land before the memory they read from or write to is released.
    forget(cudaStreamSynchronize(stream_));
    peers_.clear();
    for (const OwnRegion& r : regions_) forget(cudaFree(r.data));
    regions_.clear();
    forget(cudaStreamDestroy(stream_));
    stream_ = nullptr;
    control_ = Segment();
  }

 private:
  void check_open() const {
    if (closed_) fail<InvalidArgument>("cuda transport of rank ", rank_, " is closed");
  }

  const std::byte* source_of(const Read& r) const {
    const std::byte* base =
        is_self(r.peer)
            ? regions_[static_cast<std::size_t>(r.region)].data
            : peers_[static_cast<std::size_t>(r.peer)]->regions[static_cast<std::size_t>(r.region)];
    return base + r.offset;
  }

  // The whole batch in one cudaMemcpyBatchAsync, with the hint that asks the driver to keep the
  // copies off the SMs (cudaMemcpyFlagPreferOverlapWithCompute). Returns false when this path is
  // off, or (CopyPath::kAuto) when the driver refuses the call: then the caller copies read by
  // read, and a copy the refused call may have started is merely done twice.
  bool copy_batched(std::span<const Read> reads, cudaEvent_t event) {
    if (copy_path_ == CopyPath::kMemcpy) return false;
#if CUDART_VERSION >= 13000
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (const Read& r : reads) {
      if (r.bytes == 0) continue;
      dsts_.push_back(r.dst);
      srcs_.push_back(source_of(r));
      sizes_.push_back(r.bytes);
    }
    if (dsts_.empty()) return true;
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t first = 0;
    const cudaError_t status = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(),
                                                    dsts_.size(), &attributes, &first, 1, stream_);
    if (status == cudaSuccess) return true;
    forget(status);
    if (copy_path_ == CopyPath::kAuto) return false;
    abandon(event);
    fail<IoError>("cuda: cudaMemcpyBatchAsync of ", dsts_.size(),
                  " reads failed: ", describe(status),
                  " (EPLB_CUDA_COPY=batch allows no other path)");
#else
    (void)reads;
    if (copy_path_ == CopyPath::kAuto) return false;
    abandon(event);
    fail<IoError>("cuda: EPLB_CUDA_COPY=batch needs a CUDA 13 runtime (cudaMemcpyBatchAsync)");
#endif
  }

  void copy_one_by_one(std::span<const Read> reads, cudaEvent_t event) {
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const Read& r = reads[i];
      if (r.bytes == 0) continue;
      const cudaError_t status =
          cudaMemcpyAsync(r.dst, source_of(r), r.bytes, cudaMemcpyDefault, stream_);
      if (status == cudaSuccess) continue;
      forget(status);
      abandon(event);
      if (status == cudaErrorInvalidValue) {
        fail<InvalidArgument>("read ", i, " of ", r.bytes, " bytes from rank ", r.peer,
                              " cannot be written to its destination ", r.dst, ": ",
                              describe(status), " (the reads before it have landed)");
      }
      fail<IoError>("cuda: read ", i, " of ", r.bytes, " bytes from rank ", r.peer,
                    " could not start: ", describe(status), " (the reads before it have landed)");
    }
  }

  bool is_self(int peer) const {
    return peer == rank_ && (static_cast<std::size_t>(peer) >= peers_.size() ||
                             peers_[peer] == nullptr || peers_[peer]->self);
  }

  const PeerView& view_of(const Read& r, std::size_t index) const {
    if (r.peer < 0 || static_cast<std::size_t>(r.peer) >= peers_.size() ||
        peers_[r.peer] == nullptr) {
      fail_unknown_peer(r, index, peers_.size());
    }
    return *peers_[r.peer];
  }

  int device_of(const GpuIdentity& gpu) const {
    for (std::size_t d = 0; d < visible_.size(); ++d) {
      if (visible_[d] == gpu) return static_cast<int>(d);
    }
    return -1;
  }

  // Nothing of a failed post() stays in flight: its started copies land before the throw.
  void abandon(cudaEvent_t event) {
    forget(cudaStreamSynchronize(stream_));
    forget(cudaEventDestroy(event));
  }

  [[noreturn]] static void fail_open(int peer, std::size_t region, const PeerView& view,
                                     cudaError_t status) {
    if (!view.process.alive()) {
      fail<IoError>("cuda: rank ", peer, " is gone (its process exited) before its memory ",
                    "could be opened");
    }
    if (!view.open()) fail<IoError>("cuda: rank ", peer, " closed its transport");
    if (status == cudaErrorInvalidValue || status == cudaErrorInvalidResourceHandle) {
      fail<InvalidArgument>("cuda descriptor of rank ", peer, " is malformed: the IPC handle of ",
                            "region ", region, " does not open (", describe(status), ")");
    }
    fail<IoError>("cuda: cannot open region ", region, " of rank ", peer, ": ", describe(status));
  }

  int rank_;
  int device_;
  ProcessIdentity identity_;
  GpuIdentity gpu_;
  std::vector<GpuIdentity> visible_;  // [device ordinal in this process]
  cudaStream_t stream_ = nullptr;
  Segment control_;  // this rank's control page
  bool closed_ = false;
  std::vector<OwnRegion> regions_;                      // [region id]
  std::vector<std::shared_ptr<const PeerView>> peers_;  // [peer rank], null where not imported
  CopyPath copy_path_;
  std::vector<void*> dsts_;  // scratch of copy_batched()
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
};

}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  EPLB_CHECK_GE(options.rank, 0, "transport rank must be >= 0");
  const CopyPath copy_path = copy_path_from_environment();
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    forget(status);
    fail<IoError>("cuda transport cannot start: no usable CUDA device (cudaGetDeviceCount: ",
                  status == cudaSuccess ? std::string("0 devices") : describe(status),
                  "); it needs an NVIDIA GPU and its driver on this machine");
  }
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int unified = 0, ipc = 0;
  check(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device),
        "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&ipc, cudaDevAttrIpcEventSupport, device), "cudaDeviceGetAttribute");
  if (unified == 0 || ipc == 0) {
    fail<IoError>("cuda transport cannot start: device ", device, " lacks ",
                  unified == 0 ? "unified addressing" : "CUDA IPC",
                  ", which reads between processes need");
  }
  return std::make_unique<CudaTransport>(options, device, copy_path);
}

}  // namespace eplb::transport::cuda
