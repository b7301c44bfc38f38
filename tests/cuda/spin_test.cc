// The proof that a cuda transfer needs no SM: a kernel occupies every SM of the reading rank's GPU
// and spins until the host says the migration finished, while that rank pulls a full layer of
// experts from another process through the cuda transport. A transfer that needed an SM (a copy
// kernel, a device-wide synchronize) could not start until the kernel left, and the kernel does
// not leave until the transfer is done: a deadlock, which the bounded waits turn into a failure
// that says which side did not finish.
//
// Ranks are forked processes sharing one GPU: rank 0 owns the layer (fills it, exports it, then
// only waits), rank 1 launches the spinning kernel and pulls. The spinning kernel and the copies
// run in the same process, so they share one CUDA context: no time-slicing between processes can
// give the copies SMs the kernel holds.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_testing.h"
#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "transport/multi_rank.h"

namespace eplb::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using cuda_testing::ok;
using testing::RankContext;
using testing::RunOptions;

// A layer of one rank: 36 slots x 3 weight tensors (gate, up, down) of 20 MiB, about the size
// of a DeepSeek-V3 expert in FP8 (2.1 GiB in all).
constexpr int kSlots = 36;
constexpr int kTensors = 3;
constexpr std::size_t kTensorBytes = std::size_t{20} << 20;
constexpr std::size_t kLayerBytes = kSlots * kTensors * kTensorBytes;
constexpr std::uint32_t kSeed = 0x5eed1234u;
constexpr int kThreads = 256;

// Generous bounds: they only turn a hang into a failure, they never measure speed.
constexpr auto kStartTimeout = 20s;     // every block of the kernel resident and spinning
constexpr auto kTransferTimeout = 30s;  // the layer pulled (it takes milliseconds)
constexpr auto kStopTimeout = 20s;      // the kernel gone after its flag is set
constexpr std::uint64_t kKernelLimitNs = 100'000'000'000ull;  // the kernel leaves by itself

struct DeviceBuffer {
  void* data = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { EPLB_TEST_CUDA(cudaMalloc(&data, bytes)); }
  ~DeviceBuffer() { (void)cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Rank 1: spin every SM, pull the layer, release the SMs, check the bytes.
void pull_while_spinning(Transport& transport) {
  // Step 1: everything that may allocate, free or wait for the device happens before the kernel
  // starts (cudaMalloc and cudaFree may synchronize the device).
  DeviceBuffer staging(kLayerBytes);
  DeviceBuffer counter(sizeof(unsigned long long));
  EPLB_TEST_CUDA(cudaMemset(counter.data, 0, sizeof(unsigned long long)));
  int device = 0, sms = 0, can_map = 0, per_sm = 0;
  EPLB_TEST_CUDA(cudaGetDevice(&device));
  EPLB_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  EPLB_TEST_CUDA(cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device));
  if (can_map == 0) cuda_testing::skip_ranks("the GPU cannot map host memory");
  EPLB_TEST_CUDA(cuda_testing::spin_blocks_per_sm(kThreads, &per_sm));
  ASSERT_GT(per_sm, 0) << "the spin kernel fits no block on an SM";
  const int blocks = per_sm * sms;
  cuda_testing::SpinFlags flags(blocks);
  cudaStream_t spin_stream = nullptr;
  EPLB_TEST_CUDA(cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking));

  // The layer's tensors, each read from the owner's slot s into staging slot kSlots-1-s (a
  // placement change moves experts between slots).
  std::vector<Read> reads;
  auto* dst = static_cast<std::byte*>(staging.data);
  for (int s = 0; s < kSlots; ++s) {
    for (int k = 0; k < kTensors; ++k) {
      const std::size_t from = (static_cast<std::size_t>(s) * kTensors + k) * kTensorBytes;
      const std::size_t to =
          (static_cast<std::size_t>(kSlots - 1 - s) * kTensors + k) * kTensorBytes;
      reads.push_back({0, 0, from, dst + to, kTensorBytes});
    }
  }
  // Warm the path up once (first-use costs stay out of the proof).
  transport.post(std::span(reads.data(), 1))->wait(60s);
  EPLB_TEST_CUDA(cudaDeviceSynchronize());

  // Step 2: occupy every SM, and wait until every block is resident.
  EPLB_TEST_CUDA(cuda_testing::launch_spin(blocks, kThreads, flags.device, flags.device + 2,
                                           flags.device + 1, kKernelLimitNs, spin_stream));
  const auto start_deadline = Clock::now() + kStartTimeout;
  while (flags.started() < blocks && Clock::now() < start_deadline) {
    std::this_thread::sleep_for(1ms);
  }
  const int started = flags.started();

  // Step 3: pull the layer while the kernel holds every SM.
  bool transfer_done = false, kernel_spun_throughout = false;
  std::string transfer_error;
  double seconds = 0;
  std::unique_ptr<Batch> batch;
  if (started == blocks) {
    const auto t0 = Clock::now();
    try {
      batch = transport.post(reads);
      batch->wait(std::chrono::duration_cast<std::chrono::milliseconds>(kTransferTimeout));
      transfer_done = true;
    } catch (const Timeout&) {
    } catch (const Error& e) {
      transfer_done = true;
      transfer_error = e.what();
    }
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    kernel_spun_throughout = cudaStreamQuery(spin_stream) == cudaErrorNotReady && !flags.gave_up();
  }

  // Step 4: release the kernel; it must leave.
  flags.release();
  if (!cuda_testing::finishes_within(spin_stream, kStopTimeout)) {
    ADD_FAILURE() << "the KERNEL did not finish: still running " << kStopTimeout.count()
                  << " s after its flag was set (the transfer "
                  << (transfer_done ? "had finished" : "had not finished either") << ")";
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);  // a context with a kernel that never ends: leave without waiting for it
  }
  ASSERT_EQ(started, blocks) << "only " << started << " of " << blocks << " blocks (" << per_sm
                             << " per SM x " << sms
                             << " SMs) of the spinning kernel started within "
                             << kStartTimeout.count() << " s: the GPU is shared with other work?";
  if (!transfer_done) {
    // Now that the SMs are free, a transfer that needed one can go on: say which case it was.
    bool late = false;
    try {
      batch->wait(std::chrono::duration_cast<std::chrono::milliseconds>(kTransferTimeout));
      late = true;
    } catch (const Error&) {
    }
    FAIL() << "the TRANSFER did not finish within " << kTransferTimeout.count()
           << " s while every SM was busy; "
           << (late ? "it finished once the kernel released the SMs, so it needed an SM"
                    : "it did not finish even after the kernel released the SMs");
  }
  ASSERT_TRUE(transfer_error.empty()) << "the transfer failed: " << transfer_error;
  EXPECT_TRUE(kernel_spun_throughout)
      << "the kernel stopped spinning before the transfer finished (it gave up on its own "
      << "deadline?), so this run proves nothing";
  batch.reset();

  // Step 5: the bytes are the owner's, every tensor in its new slot.
  for (const Read& r : reads) {
    EPLB_TEST_CUDA(cuda_testing::launch_count_mismatches(
        static_cast<const std::uint32_t*>(r.dst), r.bytes / 4, kSeed, r.offset / 4,
        static_cast<unsigned long long*>(counter.data), spin_stream));
  }
  unsigned long long mismatches = 0;
  EPLB_TEST_CUDA(cudaMemcpyAsync(&mismatches, counter.data, sizeof mismatches,
                                 cudaMemcpyDeviceToHost, spin_stream));
  EPLB_TEST_CUDA(cudaStreamSynchronize(spin_stream));
  EXPECT_EQ(mismatches, 0u) << "words of the pulled layer differ from the owner's";
  EPLB_TEST_CUDA(cudaStreamDestroy(spin_stream));
  std::printf(
      "[   INFO   ] EPLB_CUDA_COPY=%s: pulled %d tensors, %.0f MiB, in %.2f ms (%.1f GB/s) while "
      "%d blocks "
      "x %d threads (%d per SM) held all %d SMs\n",
      std::getenv("EPLB_CUDA_COPY") ? std::getenv("EPLB_CUDA_COPY") : "auto",
      static_cast<int>(reads.size()), static_cast<double>(kLayerBytes) / (1 << 20), seconds * 1e3,
      static_cast<double>(kLayerBytes) / seconds / 1e9, blocks, kThreads, per_sm, sms);
}

// Each of the transport's two ways to issue copies, forced (EPLB_CUDA_COPY): "batch", one
// cudaMemcpyBatchAsync with the overlap-with-compute hint (the default path), and "memcpy", one
// cudaMemcpyAsync per read (the fallback where the driver refuses a batch).
class CudaSpin : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaSpin, FullLayerPullFinishesWhileEverySmSpins) {
  if (cuda_testing::cuda_initialised_here()) {
    if (cuda_testing::gpu_required()) FAIL() << cuda_testing::kInitialisedBeforeFork;
    GTEST_SKIP() << cuda_testing::kInitialisedBeforeFork;
  }
  RunOptions options;
  options.world = 2;
  options.processes = true;
  options.deadline = 170s;
  options.env.emplace_back("EPLB_CUDA_COPY", GetParam());
  std::string skip;
  const bool skipped = testing::run_ranks(
      options,
      [&](RankContext& ctx) {
        auto transport = cuda_testing::create_transport(ctx);
        if (ctx.rank == 0) {
          // The owner: fill the layer, export it, then only wait; it takes no part in the transfer.
          const Region layer = transport->allocate(kLayerBytes);
          EPLB_TEST_CUDA(cuda_testing::launch_fill(reinterpret_cast<std::uint32_t*>(layer.data),
                                                   kLayerBytes / 4, kSeed, nullptr));
          EPLB_TEST_CUDA(cudaDeviceSynchronize());
        }
        const auto descriptors = ctx.all_gather("descriptors", transport->export_descriptor());
        if (ctx.rank == 1) {
          transport->import_descriptor(0, descriptors[0]);
          pull_while_spinning(*transport);
        }
        ctx.barrier("done");  // the owner keeps its memory until the reader is through
      },
      &skip);
  if (skipped) GTEST_SKIP() << skip;
}

std::string copy_name(const ::testing::TestParamInfo<std::string>& param) { return param.param; }

INSTANTIATE_TEST_SUITE_P(Copy, CudaSpin, ::testing::Values("batch", "memcpy"), copy_name);

}  // namespace
}  // namespace eplb::transport
