#pragma once
// Helpers of the routing kernels' tests (routing_test.cc, split_routing_test.cc): random
// placements and batches on the host, device buffers, and the fixture of the tests that need a
// device (skipped without one; a failure with EPLB_REQUIRE_GPU=1).

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/cuda/routing.h"
#include "eplb/routing/dispatch.h"

namespace eplb::cuda {
namespace {

using routing::DispatchPolicy;
using routing::DispatchTables;

#define EPLB_ASSERT_CUDA(expr)                                                                 \
  do {                                                                                         \
    const cudaError_t eplb_status_ = (expr);                                                   \
    ASSERT_EQ(eplb_status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(eplb_status_); \
  } while (0)

// Why there is no usable device, or "" when there is one.
std::string no_device_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(status) + ")";
  }
  return count > 0 ? "" : "no CUDA device (cudaGetDeviceCount found 0)";
}

// EPLB_REQUIRE_GPU=1 (a run on a GPU machine) turns a skip for want of a device into a failure.
bool gpu_required() {
  const char* require = std::getenv("EPLB_REQUIRE_GPU");
  return require != nullptr && std::string(require) == "1";
}

// ---- Host-side model of the batch: placements, ids, and the expected slots and counts ----

struct Shape {
  int64_t experts;
  int64_t physical;
  int64_t ranks;
  int64_t nodes;
  int64_t top_k;
};

// Every expert once, the redundant slots skewed towards a few hot experts (so replica counts
// range from 1 to several), slots shuffled.
Placement random_placement(const Shape& shape, std::mt19937_64& rng) {
  Placement p(1, shape.experts, shape.physical);
  std::vector<int32_t> phy2log(static_cast<size_t>(shape.physical));
  for (int64_t e = 0; e < shape.experts; ++e)
    phy2log[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  const int64_t hot = std::min<int64_t>(shape.experts, 4);
  for (int64_t s = shape.experts; s < shape.physical; ++s) {
    const bool to_hot = rng() % 2 == 0;
    phy2log[static_cast<size_t>(s)] = static_cast<int32_t>(
        to_hot ? rng() % static_cast<uint64_t>(hot) : rng() % static_cast<uint64_t>(shape.experts));
  }
  std::shuffle(phy2log.begin(), phy2log.end(), rng);
  std::copy(phy2log.begin(), phy2log.end(), p.phy2log.begin());
  p.derive_from_phy2log();
  return p;
}

DispatchTables random_tables(const Shape& shape, std::mt19937_64& rng) {
  const Layout layout{.experts = shape.experts,
                      .physical = shape.physical,
                      .ranks = shape.ranks,
                      .nodes = shape.nodes,
                      .groups = 1};
  return routing::build_dispatch_tables(random_placement(shape, rng), 0, layout);
}

// random_tables with the slots of one random rank unusable (elastic serving: a lost rank), so
// the experts that lived only there have replica_count 0 and are routed to -1.
DispatchTables random_tables_without_a_rank(const Shape& shape, std::mt19937_64& rng) {
  const Layout layout{.experts = shape.experts,
                      .physical = shape.physical,
                      .ranks = shape.ranks,
                      .nodes = shape.nodes,
                      .groups = 1};
  const Placement p = random_placement(shape, rng);
  const int64_t lost = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape.ranks));
  std::vector<uint8_t> usable(static_cast<size_t>(shape.physical), 1);
  for (int64_t s = 0; s < shape.physical; ++s) {
    if (layout.rank_of_slot(s) == lost) usable[static_cast<size_t>(s)] = 0;
  }
  return routing::build_dispatch_tables(p, 0, layout, {}, usable);
}

std::vector<int32_t> random_ids(int64_t entries, int64_t experts, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(entries));
  for (auto& e : ids) e = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
  return ids;
}

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : size_(n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error("cudaMalloc failed in the test");
    }
    data_ = static_cast<T*>(p);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  // Stream-ordered copies; `from` is pageable, so the call returns once it has been staged.
  void copy_in(const std::vector<T>& from, cudaStream_t stream) {
    if (from.empty()) return;
    if (cudaMemcpyAsync(data_, from.data(), from.size() * sizeof(T), cudaMemcpyHostToDevice,
                        stream) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpyAsync to the device failed in the test");
    }
  }
  std::vector<T> copy_out(cudaStream_t stream) const {
    std::vector<T> out(size_);
    if (size_ == 0) return out;
    if (cudaMemcpyAsync(out.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost, stream) !=
            cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpyAsync to the host failed in the test");
    }
    return out;
  }

 private:
  T* data_ = nullptr;
  size_t size_;
};

class CudaRouting : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = no_device_reason();
    if (!reason.empty()) {
      if (gpu_required()) GTEST_FAIL() << reason << " and EPLB_REQUIRE_GPU=1 needs one";
      GTEST_SKIP() << reason;
    }
    EPLB_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ == nullptr) return;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error was left behind";
  }

  void set_window_slot(const LoadRingView& ring, int32_t step) {
    ASSERT_EQ(
        cudaMemcpyAsync(ring.window_slot, &step, sizeof(step), cudaMemcpyHostToDevice, stream_),
        cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  std::vector<int64_t> read_ring(const DeviceLoadRing& ring, int32_t* step = nullptr) {
    const LoadRingView v = ring.view();
    std::vector<int64_t> out(static_cast<size_t>(v.window) * static_cast<size_t>(v.layers) *
                             static_cast<size_t>(v.experts));
    const int32_t s = ring.read(out, stream_);
    if (step != nullptr) *step = s;
    return out;
  }

  cudaStream_t stream_ = nullptr;
};

}  // namespace
}  // namespace eplb::cuda
