#pragma once
// Helpers of the cuda tests whose ranks are forked processes (tests/transport/multi_rank.h), and
// the launchers of the kernels in spin_kernels.cu.
//
// CUDA must not be initialised in a process before it forks children that use CUDA. So the
// parent (the gtest process) never calls CUDA in these tests: it only checks, without calling
// CUDA, that nothing else in the process did (cuda_initialised_here), and the ranks look for a
// device themselves (create_transport), skipping the test when there is none, or failing it
// where a GPU is required.

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "transport/multi_rank.h"

namespace eplb::transport::cuda_testing {

// Whether this process has initialised CUDA already (the driver library is mapped), in which
// case forked ranks could not use it. Reads /proc/self/maps; calls no CUDA function.
inline bool cuda_initialised_here() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcuda.so") != std::string::npos) return true;
  }
  return false;
}

inline constexpr const char* kInitialisedBeforeFork =
    "CUDA was initialised in the test process before it forked its ranks (another test of this "
    "program ran on the GPU first); run this test on its own (ctest, or --gtest_filter)";

// EPLB_REQUIRE_GPU=1 (scripts/gpu-check.sh): a skip is a failure.
inline bool gpu_required() {
  const char* require = std::getenv("EPLB_REQUIRE_GPU");
  return require != nullptr && std::string(require) == "1";
}

// Skips the test from inside a rank; with EPLB_REQUIRE_GPU=1 (set by scripts/gpu-check.sh) fails
// it instead, so that a GPU machine never reports a skipped test as a pass.
[[noreturn]] inline void skip_ranks(const std::string& reason) {
  const char* require = std::getenv("EPLB_REQUIRE_GPU");
  if (require != nullptr && std::string(require) == "1") {
    throw std::runtime_error(reason + " (EPLB_REQUIRE_GPU=1: this run needs a GPU)");
  }
  throw testing::SkipRanks{reason};
}

inline std::string describe(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
}

// Why this process cannot use CUDA, or "" when a device is there.
inline std::string device_problem() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return "";
  (void)cudaGetLastError();
  return "no CUDA device (cudaGetDeviceCount: " +
         (status == cudaSuccess ? std::string("0 devices") : describe(status)) + ")";
}

// Every rank's cuda Transport, or the whole test skipped when there is no device here. Rank 0
// looks first and tells the others: the harness's skip marker is written by one rank only (two
// ranks skipping at the same moment would race on it), and the others leave with the skip exit
// code without writing it.
inline std::unique_ptr<Transport> create_transport(testing::RankContext& ctx) {
  std::unique_ptr<Transport> transport;
  std::string problem;
  if (ctx.rank == 0) {
    problem = device_problem();
    if (problem.empty()) {
      try {
        transport = create("cuda", Options{.rank = 0});
      } catch (const IoError& e) {
        problem = std::string("the cuda transport cannot start here: ") + e.what();
      }
    }
  }
  const auto* first = reinterpret_cast<const std::byte*>(problem.data());
  const auto verdicts =
      ctx.all_gather("cuda-device", testing::Bytes(first, first + problem.size()));
  const std::string verdict(reinterpret_cast<const char*>(verdicts[0].data()), verdicts[0].size());
  if (!verdict.empty()) {
    if (ctx.rank == 0) skip_ranks(verdict);
    std::fflush(nullptr);
    std::_Exit(77);  // the multi_rank harness's exit code for a skipped rank
  }
  // Rank 0 could: any other rank of this machine failing now is an error, not a skip.
  if (ctx.rank != 0) transport = create("cuda", Options{.rank = ctx.rank});
  return transport;
}

// Runs the rank body (the variadic part, so that its commas need no parentheses) on forked
// ranks, or skips the calling test with the ranks' reason.
#define EPLB_RUN_RANKS(options, ...)                                                       \
  do {                                                                                     \
    if (::eplb::transport::cuda_testing::cuda_initialised_here()) {                        \
      if (::eplb::transport::cuda_testing::gpu_required()) {                               \
        FAIL() << ::eplb::transport::cuda_testing::kInitialisedBeforeFork;                 \
      }                                                                                    \
      GTEST_SKIP() << ::eplb::transport::cuda_testing::kInitialisedBeforeFork;             \
    }                                                                                      \
    std::string eplb_skip_;                                                                \
    if (::eplb::transport::testing::run_ranks((options), __VA_ARGS__, &eplb_skip_)) {      \
      GTEST_SKIP() << eplb_skip_;                                                          \
    }                                                                                      \
  } while (0)

// Throws (failing the rank, with the call named) unless `status` is cudaSuccess.
inline void ok(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(call) + " failed: " + describe(status));
  }
}
#define EPLB_TEST_CUDA(call) ::eplb::transport::cuda_testing::ok((call), #call)

// Words the host and the spinning kernel share: host-mapped, pinned memory.
struct SpinFlags {
  int* host = nullptr;  // [0] stop, [1] gave up, [2..] started, one per block
  int* device = nullptr;
  int blocks = 0;

  explicit SpinFlags(int n) : blocks(n) {
    const std::size_t bytes = sizeof(int) * static_cast<std::size_t>(2 + n);
    EPLB_TEST_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes, cudaHostAllocMapped));
    std::memset(host, 0, bytes);
    EPLB_TEST_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0));
  }
  ~SpinFlags() { (void)cudaFreeHost(host); }
  SpinFlags(const SpinFlags&) = delete;
  SpinFlags& operator=(const SpinFlags&) = delete;

  int started() const {
    int n = 0;
    for (int b = 0; b < blocks; ++b) n += static_cast<const volatile int*>(host)[2 + b] != 0;
    return n;
  }
  bool gave_up() const { return static_cast<const volatile int*>(host)[1] != 0; }
  void release() {
    static_cast<volatile int*>(host)[0] = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
};

// Polls `stream` until its work is done or `timeout` passes; never blocks on the device.
inline bool finishes_within(cudaStream_t stream, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) ok(status, "cudaStreamQuery (spinning kernel)");
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- spin_kernels.cu ----------------------------------------------------------------------------

// Blocks of the spin kernel that fit on one SM at once, with `threads` threads per block.
cudaError_t spin_blocks_per_sm(int threads, int* blocks);

// Launches `blocks` blocks of `threads` threads that occupy their SMs until released: each block
// sets started[block] = 1, then its first thread polls *stop (host-mapped memory, written by the
// host) while the others wait at a barrier, so every thread slot stays taken. A block leaves
// once *stop != 0, or after `limit_ns` of GPU time, when it sets *gave_up = 1 (a bound of last
// resort: the host releases the kernel long before).
cudaError_t launch_spin(int blocks, int threads, const int* stop, int* started, int* gave_up,
                        std::uint64_t limit_ns, cudaStream_t stream);

// words[i] = pattern_word(seed, i) for i in [0, count).
cudaError_t launch_fill(std::uint32_t* words, std::size_t count, std::uint32_t seed,
                        cudaStream_t stream);

// *mismatches += the number of i in [0, count) with words[i] != pattern_word(seed, first + i).
cudaError_t launch_count_mismatches(const std::uint32_t* words, std::size_t count,
                                    std::uint32_t seed, std::uint64_t first,
                                    unsigned long long* mismatches, cudaStream_t stream);

}  // namespace eplb::transport::cuda_testing
