#include "eplb/cuda/routing.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/types.h"
#include "eplb/routing/dispatch.h"
#include "cuda/routing_testing.h"

namespace eplb::cuda {
namespace {

using routing::DispatchPolicy;
using routing::DispatchTables;

struct Expected {
  std::vector<int32_t> slots;   // [tokens][top_k]
  std::vector<int64_t> counts;  // [experts]
};

// What the kernel must produce: routing::choose_slot (hash) for valid ids, -1 for the others;
// counts over rows < valid only.
Expected expected(const DispatchTables& t, const std::vector<int32_t>& ids, int64_t top_k,
                  uint64_t first_token, int64_t rank, int64_t valid) {
  Expected out;
  out.slots.resize(ids.size());
  out.counts.assign(static_cast<size_t>(t.experts), 0);
  uint64_t state = 1;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t e = ids[i];
    const int64_t row = static_cast<int64_t>(i) / top_k;
    if (e < 0 || e >= t.experts) {
      out.slots[i] = -1;
      continue;
    }
    out.slots[i] = routing::choose_slot(t, DispatchPolicy::kHash, e,
                                        first_token + static_cast<uint64_t>(row), rank, state);
    if (row < valid) ++out.counts[static_cast<size_t>(e)];
  }
  return out;
}

// ---- Host-compiled device code: runs without a GPU ----

TEST(CudaRoutingHost, KernelHashMatchesDispatchHash) {
  const uint64_t edges[] = {0, 1, 2, 0x7FFFFFFFull, 0xFFFFFFFFull, 0x100000000ull,
                            0x9E3779B97F4A7C15ull, std::numeric_limits<uint64_t>::max() - 1,
                            std::numeric_limits<uint64_t>::max()};
  const uint32_t ranks[] = {0, 1, 7, 31, 255, 0x7FFFFFFFu, 0xFFFFFFFFu};
  for (uint64_t token : edges) {
    for (uint32_t rank : ranks) {
      ASSERT_EQ(kernel_dispatch_hash(token, rank), routing::dispatch_hash(token, rank))
          << "token " << token << " rank " << rank;
    }
  }
  const uint64_t seed = 20240611;
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t token = rng();
    const auto rank = static_cast<uint32_t>(rng());
    ASSERT_EQ(kernel_dispatch_hash(token, rank), routing::dispatch_hash(token, rank))
        << "seed " << seed << " token " << token << " rank " << rank;
  }
}

TEST(CudaRoutingHost, KernelChooseSlotMatchesChooseSlot) {
  const Shape shapes[] = {{256, 288, 32, 4, 8}, {8, 12, 4, 2, 2}, {16, 64, 4, 1, 4},
                          {1, 4, 1, 1, 1}};
  for (uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    for (const Shape& shape : shapes) {
      const DispatchTables t = random_tables(shape, rng);
      DispatchTablesView host;  // pointers into host memory: the host-compiled kernel code
      host.log2phy = t.log2phy.data();
      host.replica_count = t.replica_count.data();
      host.experts = static_cast<int32_t>(t.experts);
      host.max_replicas = static_cast<int32_t>(t.max_replicas);
      uint64_t state = 1;
      for (int i = 0; i < 20000; ++i) {
        const auto e = static_cast<int32_t>(rng() % static_cast<uint64_t>(t.experts));
        const uint64_t token = rng();
        const int64_t rank = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape.ranks));
        ASSERT_EQ(kernel_choose_slot(host, e, token, static_cast<uint32_t>(rank)),
                  routing::choose_slot(t, DispatchPolicy::kHash, e, token, rank, state))
            << "seed " << seed << " experts " << shape.experts << " expert " << e;
      }
      for (int32_t bad : {-1, static_cast<int32_t>(t.experts), std::numeric_limits<int32_t>::min(),
                          std::numeric_limits<int32_t>::max()}) {
        EXPECT_EQ(kernel_choose_slot(host, bad, 5, 0), -1) << "expert " << bad;
      }
    }
  }
  // A replica count the kernel cannot use gives -1, not a read past the row.
  const int32_t log2phy[] = {3, -1};
  for (int32_t count : {0, -4, 3}) {
    const int32_t counts[] = {count};
    const DispatchTablesView host{log2phy, counts, 1, 2};
    EXPECT_EQ(kernel_choose_slot(host, 0, 9, 0), -1) << "replica count " << count;
  }
}

// Tables without one rank's slots: experts left without a usable replica get -1 on the device
// as on the CPU.
TEST(CudaRoutingHost, KernelChooseSlotMatchesChooseSlotWithoutARank) {
  const Shape shapes[] = {{256, 288, 32, 4, 8}, {8, 12, 4, 2, 2}, {16, 64, 4, 1, 4},
                          {1, 4, 1, 1, 1}};
  for (uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    for (const Shape& shape : shapes) {
      const DispatchTables t = random_tables_without_a_rank(shape, rng);
      const DispatchTablesView host{t.log2phy.data(), t.replica_count.data(),
                                    static_cast<int32_t>(t.experts),
                                    static_cast<int32_t>(t.max_replicas)};
      uint64_t state = 1;
      for (int32_t e = 0; e < t.experts; ++e) {
        for (uint64_t token = 0; token < 64; ++token) {
          const auto rank = static_cast<uint32_t>(token % static_cast<uint64_t>(shape.ranks));
          const int32_t slot = kernel_choose_slot(host, e, token, rank);
          ASSERT_EQ(slot, routing::choose_slot(t, DispatchPolicy::kHash, e, token, rank, state))
              << "seed " << seed << " experts " << shape.experts << " expert " << e;
          if (t.replica_count[e] == 0) {
            ASSERT_EQ(slot, -1);
          }
        }
      }
    }
  }
}

// The launch checks run on the host before anything touches the device: a bad argument is an
// InvalidArgument, never a launch. The pointers are host memory the kernel would never get.
TEST(CudaRoutingHost, LaunchesRejectBadArgumentsBeforeLaunching) {
  std::vector<int32_t> i32(64, 0);
  std::vector<int64_t> i64(64, 0);
  uint64_t first = 0;
  const DispatchTablesView tables{i32.data(), i32.data(), 4, 2};
  const LoadRingView ring{i64.data(), i32.data(), 2, 2, 4};
  const RouteBatch good{.expert_ids = i32.data(), .slots = i32.data() + 32, .tokens = 4,
                        .top_k = 2, .valid_tokens = i32.data(), .first_token = &first,
                        .rank = 0, .layer = 1};
  auto expect_invalid = [&](const DispatchTablesView& t, const RouteBatch& b,
                            const LoadRingView& r, const std::string& what) {
    EXPECT_THROW(route_and_record(t, b, r, nullptr), InvalidArgument) << what;
    EXPECT_THROW(route_then_record(t, b, r, nullptr), InvalidArgument) << what;
  };
  RouteBatch b = good;
  b.top_k = 0;
  expect_invalid(tables, b, ring, "top_k 0");
  b = good;
  b.tokens = -1;
  expect_invalid(tables, b, ring, "negative tokens");
  b = good;
  b.tokens = int64_t{1} << 28;
  b.top_k = 8;
  expect_invalid(tables, b, ring, "2^31 entries");
  b = good;
  b.layer = 2;
  expect_invalid(tables, b, ring, "layer outside the ring");
  b = good;
  b.rank = -1;
  expect_invalid(tables, b, ring, "negative rank");
  b = good;
  b.valid_tokens = nullptr;
  expect_invalid(tables, b, ring, "no valid_tokens");
  b = good;
  b.first_token = nullptr;
  expect_invalid(tables, b, ring, "no first_token");
  LoadRingView r = ring;
  r.experts = 5;
  expect_invalid(tables, good, r, "ring of other experts");
  r = ring;
  r.window = 0;
  expect_invalid(tables, good, r, "empty window");
  r = ring;
  r.window_slot = nullptr;
  expect_invalid(tables, good, r, "no window slot");
  DispatchTablesView t = tables;
  t.max_replicas = 0;
  expect_invalid(t, good, ring, "tables without replicas");
  r = ring;
  r.counts = nullptr;
  EXPECT_THROW(advance_window(r, nullptr), InvalidArgument);
}

// ---- On the device ----

// One batch through the fused kernel and through the two-kernel sequence, each into its own
// ring, checked against the CPU. Expected counts land in [step][layer] only.
void run_and_check(cudaStream_t stream, const DispatchTables& t, const std::vector<int32_t>& ids,
                   int64_t top_k, uint64_t first_token, int64_t rank, int32_t valid,
                   int64_t layers, int64_t layer, int64_t window, int32_t step,
                   const std::string& label) {
  const int64_t tokens = static_cast<int64_t>(ids.size()) / top_k;
  const Expected want = expected(t, ids, top_k, first_token, rank, valid);
  const bool all_valid = std::all_of(ids.begin(), ids.end(),
                                     [&](int32_t e) { return e >= 0 && e < t.experts; });
  if (all_valid) {  // the kernel's reference is routing::route itself
    std::vector<int32_t> routed(ids.size());
    uint64_t state = 1;
    routing::route(t, DispatchPolicy::kHash, ids, top_k, routed, first_token, rank, state);
    ASSERT_EQ(routed, want.slots) << label;
  }

  DeviceDispatchTables tables(t, t.max_replicas + 1, stream);  // spare capacity: stride != width
  DeviceStepInputs inputs(stream);
  inputs.set(first_token, valid, stream);
  DeviceArray<int32_t> d_ids(ids.size());
  d_ids.copy_in(ids, stream);

  for (bool fused : {true, false}) {
    const std::string which = label + (fused ? " fused" : " two kernels");
    DeviceLoadRing ring(layers, t.experts, window, stream);
    const LoadRingView rv = ring.view();
    ASSERT_EQ(cudaMemcpyAsync(rv.window_slot, &step, sizeof(step), cudaMemcpyHostToDevice,
                              stream),
              cudaSuccess);
    DeviceArray<int32_t> d_slots(ids.size());
    const RouteBatch batch{.expert_ids = d_ids.get(), .slots = d_slots.get(), .tokens = tokens,
                           .top_k = top_k, .valid_tokens = inputs.valid_tokens(),
                           .first_token = inputs.first_token(), .rank = rank, .layer = layer};
    if (fused) {
      route_and_record(tables.view(), batch, rv, stream);
    } else {
      route_then_record(tables.view(), batch, rv, stream);
    }
    const std::vector<int32_t> slots = d_slots.copy_out(stream);
    ASSERT_EQ(slots.size(), want.slots.size()) << which;
    for (size_t i = 0; i < slots.size(); ++i) {
      ASSERT_EQ(slots[i], want.slots[i]) << which << ": entry " << i << " (row "
                                         << static_cast<int64_t>(i) / top_k << ", expert "
                                         << ids[i] << ")";
    }
    std::vector<int64_t> got(static_cast<size_t>(window * layers * t.experts));
    EXPECT_EQ(ring.read(got, stream), step) << which;
    for (int64_t w = 0; w < window; ++w) {
      for (int64_t l = 0; l < layers; ++l) {
        for (int64_t e = 0; e < t.experts; ++e) {
          const int64_t want_count =
              (w == step && l == layer) ? want.counts[static_cast<size_t>(e)] : 0;
          ASSERT_EQ(got[static_cast<size_t>((w * layers + l) * t.experts + e)], want_count)
              << which << ": step " << w << " layer " << l << " expert " << e;
        }
      }
    }
  }
}

TEST_F(CudaRouting, MatchesHashRouteAndCpuCountsOnRandomBatches) {
  const Shape shapes[] = {{256, 288, 32, 4, 8}, {8, 12, 4, 2, 2}, {64, 128, 8, 1, 6},
                          {16, 64, 4, 1, 4}, {1, 4, 1, 1, 1}};
  for (uint64_t seed : {11u, 12u, 13u}) {
    std::mt19937_64 rng(seed);
    for (const Shape& shape : shapes) {
      const DispatchTables t = random_tables(shape, rng);
      for (int batch = 0; batch < 4; ++batch) {
        const int64_t tokens = batch == 0 ? 1 : batch == 1 ? 800 : 1 + static_cast<int64_t>(rng() % 800);
        const std::vector<int32_t> ids = random_ids(tokens * shape.top_k, shape.experts, rng);
        const int64_t rank = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape.ranks));
        // Token indices near 2^64 wrap exactly as on the host.
        const uint64_t first_token = batch == 3 ? std::numeric_limits<uint64_t>::max() - 5 : rng();
        const int32_t valid_choices[] = {static_cast<int32_t>(rng() % static_cast<uint64_t>(tokens + 1)),
                                         static_cast<int32_t>(tokens), 0,
                                         static_cast<int32_t>(tokens + 7), -3};
        const int32_t valid = valid_choices[rng() % 5];
        const int64_t layer = static_cast<int64_t>(rng() % 3);
        const auto step = static_cast<int32_t>(rng() % 4);
        run_and_check(stream_, t, ids, shape.top_k, first_token, rank, valid, 3, layer, 4, step,
                      "seed " + std::to_string(seed) + " experts " + std::to_string(shape.experts) +
                          " tokens " + std::to_string(tokens) + " valid " +
                          std::to_string(valid) + " rank " + std::to_string(rank));
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(CudaRouting, InvalidIdsGetSlotMinusOneAndAreNotCounted) {
  std::mt19937_64 rng(5);
  const Shape shape{256, 288, 32, 4, 8};
  const DispatchTables t = random_tables(shape, rng);
  std::vector<int32_t> ids = random_ids(300 * 8, 256, rng);
  const int32_t bad[] = {-1, 256, 1000, std::numeric_limits<int32_t>::max(),
                         std::numeric_limits<int32_t>::min()};
  for (size_t i = 0; i < ids.size(); i += 7) ids[i] = bad[i % 5];
  run_and_check(stream_, t, ids, 8, 77, 3, 250, 2, 1, 2, 1, "invalid ids");
}

// Tables without one rank's slots (count 0 for the experts that lived only there) upload, and
// those experts' tokens get -1 and are still counted.
TEST_F(CudaRouting, TablesWithoutARankRouteToMinusOneAndStillCount) {
  const Shape shapes[] = {{256, 288, 32, 4, 8}, {8, 12, 4, 2, 2}, {1, 4, 1, 1, 1}};
  std::mt19937_64 rng(15);
  for (const Shape& shape : shapes) {
    const DispatchTables t = random_tables_without_a_rank(shape, rng);
    const std::vector<int32_t> ids = random_ids(300 * shape.top_k, shape.experts, rng);
    run_and_check(stream_, t, ids, shape.top_k, 9, 0, 280, 2, 1, 2, 1,
                  "without a rank, experts " + std::to_string(shape.experts));
    if (HasFatalFailure()) return;
  }
}

TEST_F(CudaRouting, CountsManyExpertsWithoutTheSharedHistogram) {
  // 13000 experts' int32 bins do not fit 48 KiB of shared memory: the kernel adds to the ring
  // directly.
  std::mt19937_64 rng(9);
  const Shape shape{13000, 13312, 1, 1, 8};
  const DispatchTables t = random_tables(shape, rng);
  std::vector<int32_t> ids = random_ids(500 * 8, 13000, rng);
  for (size_t i = 0; i < 64; ++i) ids[i] = static_cast<int32_t>(i % 3);  // a few collisions
  run_and_check(stream_, t, ids, 8, 1234, 0, 480, 1, 0, 2, 1, "13000 experts");
}

TEST_F(CudaRouting, StepOutsideTheRingCountsNothingButStillRoutes) {
  std::mt19937_64 rng(21);
  const DispatchTables t = random_tables({256, 288, 32, 4, 8}, rng);
  const std::vector<int32_t> ids = random_ids(64 * 8, 256, rng);
  DeviceDispatchTables tables(t, t.max_replicas, stream_);
  DeviceStepInputs inputs(stream_);
  inputs.set(40, 64, stream_);
  DeviceLoadRing ring(1, 256, 3, stream_);
  DeviceArray<int32_t> d_ids(ids.size());
  DeviceArray<int32_t> d_slots(ids.size());
  d_ids.copy_in(ids, stream_);
  const RouteBatch batch{.expert_ids = d_ids.get(), .slots = d_slots.get(), .tokens = 64,
                         .top_k = 8, .valid_tokens = inputs.valid_tokens(),
                         .first_token = inputs.first_token(), .rank = 5, .layer = 0};
  const Expected want = expected(t, ids, 8, 40, 5, 64);
  for (int32_t step : {-1, 3, std::numeric_limits<int32_t>::max()}) {
    set_window_slot(ring.view(), step);
    route_and_record(tables.view(), batch, ring.view(), stream_);
    route_then_record(tables.view(), batch, ring.view(), stream_);
    EXPECT_EQ(d_slots.copy_out(stream_), want.slots) << "step " << step;
    for (int64_t c : read_ring(ring)) ASSERT_EQ(c, 0) << "step " << step;
  }
}

TEST_F(CudaRouting, EmptyBatchLaunchesNothing) {
  std::mt19937_64 rng(4);
  const DispatchTables t = random_tables({8, 12, 4, 2, 2}, rng);
  DeviceDispatchTables tables(t, t.max_replicas, stream_);
  DeviceLoadRing ring(1, 8, 2, stream_);
  const RouteBatch empty{.tokens = 0, .top_k = 2};  // no buffers at all
  EXPECT_NO_THROW(route_and_record(tables.view(), empty, ring.view(), stream_));
  EXPECT_NO_THROW(route_then_record(tables.view(), empty, ring.view(), stream_));
  for (int64_t c : read_ring(ring)) EXPECT_EQ(c, 0);
}

TEST_F(CudaRouting, UploadRejectsTablesThatDoNotFitAndKeepsTheAddress) {
  std::mt19937_64 rng(6);
  const DispatchTables t = random_tables({64, 128, 8, 1, 6}, rng);
  EXPECT_THROW(DeviceDispatchTables(t, t.max_replicas - 1, stream_), InvalidArgument);
  DeviceDispatchTables tables(t, 128 - 64 + 1, stream_);
  const DispatchTablesView before = tables.view();
  DispatchTables other = random_tables({64, 128, 8, 1, 6}, rng);
  tables.upload(other, stream_);
  EXPECT_EQ(tables.view().log2phy, before.log2phy);
  EXPECT_EQ(tables.view().replica_count, before.replica_count);
  DispatchTables broken = other;
  broken.replica_count[3] = -1;
  EXPECT_THROW(tables.upload(broken, stream_), InvalidArgument);
  broken = other;
  broken.log2phy[0] = -1;
  EXPECT_THROW(tables.upload(broken, stream_), InvalidArgument);
  const DispatchTables wrong_experts = random_tables({8, 12, 4, 2, 2}, rng);
  EXPECT_THROW(tables.upload(wrong_experts, stream_), InvalidArgument);
}

TEST_F(CudaRouting, UpdatesRefuseACapturingStream) {
  std::mt19937_64 rng(8);
  const DispatchTables t = random_tables({8, 12, 4, 2, 2}, rng);
  DeviceDispatchTables tables(t, t.max_replicas, stream_);
  DeviceStepInputs inputs(stream_);
  EPLB_ASSERT_CUDA(cudaStreamSynchronize(stream_));
  EPLB_ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  EXPECT_THROW(inputs.set(1, 1, stream_), InvalidArgument);
  EXPECT_THROW(tables.upload(t, stream_), InvalidArgument);
  cudaGraph_t graph = nullptr;
  EPLB_ASSERT_CUDA(cudaStreamEndCapture(stream_, &graph));
  if (graph != nullptr) cudaGraphDestroy(graph);
}

// The engine's pattern: capture once at the largest batch, then per pass set the inputs, maybe
// install new tables, and replay. Here the host also moves the ring's step between replays.
TEST_F(CudaRouting, GraphReplayFollowsValidRowsStepAndTablesChangedBetweenReplays) {
  constexpr int64_t kTokens = 800;
  constexpr int64_t kTopK = 8;
  constexpr int64_t kWindow = 3;
  constexpr int64_t kLayers = 2;
  constexpr int64_t kRank = 7;
  const Shape shape{256, 288, 32, 4, kTopK};
  const uint64_t seed = 31;
  std::mt19937_64 rng(seed);
  const DispatchTables t0 = random_tables(shape, rng);
  const DispatchTables t1 = random_tables(shape, rng);
  const DispatchTables t1_new = random_tables(shape, rng);
  const int64_t capacity = shape.physical - shape.experts + 1;

  DeviceDispatchTables tables0(t0, capacity, stream_);
  DeviceDispatchTables tables1(t1, capacity, stream_);
  DeviceStepInputs inputs(stream_);
  DeviceLoadRing ring(kLayers, shape.experts, kWindow, stream_);
  const size_t entries = static_cast<size_t>(kTokens * kTopK);
  DeviceArray<int32_t> ids0(entries), ids1(entries), slots0(entries), slots1(entries);
  RouteBatch b0{.expert_ids = ids0.get(), .slots = slots0.get(), .tokens = kTokens,
                .top_k = kTopK, .valid_tokens = inputs.valid_tokens(),
                .first_token = inputs.first_token(), .rank = kRank, .layer = 0};
  RouteBatch b1 = b0;
  b1.expert_ids = ids1.get();
  b1.slots = slots1.get();
  b1.layer = 1;
  EPLB_ASSERT_CUDA(cudaStreamSynchronize(stream_));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPLB_ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  route_and_record(tables0.view(), b0, ring.view(), stream_);
  route_and_record(tables1.view(), b1, ring.view(), stream_);
  EPLB_ASSERT_CUDA(cudaStreamEndCapture(stream_, &graph));
  EPLB_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  struct Pass {
    int32_t valid;
    int32_t step;
    uint64_t first_token;
    int tables1;  // 0: t1, 1: t1_new
  };
  const Pass passes[] = {{800, 0, 0, 0},   {1, 2, 800, 0},     {0, 1, 801, 1},
                         {432, 2, 5000, 1}, {799, -1, 9000, 0}, {123, 0, 1ull << 40, 1}};
  std::vector<int64_t> want_ring(static_cast<size_t>(kWindow * kLayers * shape.experts), 0);
  int pass_index = 0;
  for (const Pass& pass : passes) {
    const std::vector<int32_t> h0 = random_ids(kTokens * kTopK, shape.experts, rng);
    const std::vector<int32_t> h1 = random_ids(kTokens * kTopK, shape.experts, rng);
    ids0.copy_in(h0, stream_);
    ids1.copy_in(h1, stream_);
    inputs.set(pass.first_token, pass.valid, stream_);
    const DispatchTables& layer1 = pass.tables1 == 0 ? t1 : t1_new;
    tables1.upload(layer1, stream_);
    set_window_slot(ring.view(), pass.step);
    EPLB_ASSERT_CUDA(cudaGraphLaunch(exec, stream_));

    const std::string label = "seed " + std::to_string(seed) + " pass " +
                              std::to_string(pass_index++) + " valid " +
                              std::to_string(pass.valid) + " step " + std::to_string(pass.step);
    const Expected w0 = expected(t0, h0, kTopK, pass.first_token, kRank, pass.valid);
    const Expected w1 = expected(layer1, h1, kTopK, pass.first_token, kRank, pass.valid);
    ASSERT_EQ(slots0.copy_out(stream_), w0.slots) << label << " layer 0";
    ASSERT_EQ(slots1.copy_out(stream_), w1.slots) << label << " layer 1";
    if (pass.step >= 0 && pass.step < kWindow) {
      for (int64_t e = 0; e < shape.experts; ++e) {
        want_ring[static_cast<size_t>((pass.step * kLayers + 0) * shape.experts + e)] +=
            w0.counts[static_cast<size_t>(e)];
        want_ring[static_cast<size_t>((pass.step * kLayers + 1) * shape.experts + e)] +=
            w1.counts[static_cast<size_t>(e)];
      }
    }
    int32_t step = -2;
    ASSERT_EQ(read_ring(ring, &step), want_ring) << label;
    EXPECT_EQ(step, pass.step) << label;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// advance_window inside the graph: the ring moves one step per replay and zeroes the step it
// enters; fused and two-kernel graphs fill identical rings.
TEST_F(CudaRouting, GraphReplayAdvancesTheWindow) {
  constexpr int64_t kTokens = 432;
  constexpr int64_t kTopK = 8;
  constexpr int64_t kWindow = 3;
  constexpr int64_t kRank = 30;
  const Shape shape{256, 288, 32, 4, kTopK};
  const uint64_t seed = 41;
  std::mt19937_64 rng(seed);
  const DispatchTables t = random_tables(shape, rng);
  DeviceDispatchTables tables(t, shape.physical - shape.experts + 1, stream_);
  DeviceStepInputs inputs(stream_);
  DeviceLoadRing fused_ring(1, shape.experts, kWindow, stream_);
  DeviceLoadRing split_ring(1, shape.experts, kWindow, stream_);
  const size_t entries = static_cast<size_t>(kTokens * kTopK);
  DeviceArray<int32_t> ids(entries), fused_slots(entries), split_slots(entries);
  const RouteBatch fused{.expert_ids = ids.get(), .slots = fused_slots.get(), .tokens = kTokens,
                         .top_k = kTopK, .valid_tokens = inputs.valid_tokens(),
                         .first_token = inputs.first_token(), .rank = kRank, .layer = 0};
  RouteBatch split = fused;
  split.slots = split_slots.get();
  EPLB_ASSERT_CUDA(cudaStreamSynchronize(stream_));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPLB_ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  route_and_record(tables.view(), fused, fused_ring.view(), stream_);
  route_then_record(tables.view(), split, split_ring.view(), stream_);
  advance_window(fused_ring.view(), stream_);
  advance_window(split_ring.view(), stream_);
  EPLB_ASSERT_CUDA(cudaStreamEndCapture(stream_, &graph));
  EPLB_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<int64_t> want_ring(static_cast<size_t>(kWindow * shape.experts), 0);
  int64_t step = 0;
  for (int pass = 0; pass < 7; ++pass) {
    const int32_t valid = static_cast<int32_t>(rng() % (kTokens + 1));
    const uint64_t first_token = 1000 + static_cast<uint64_t>(pass) * kTokens;
    const std::vector<int32_t> h = random_ids(kTokens * kTopK, shape.experts, rng);
    ids.copy_in(h, stream_);
    inputs.set(first_token, valid, stream_);
    EPLB_ASSERT_CUDA(cudaGraphLaunch(exec, stream_));

    const Expected w = expected(t, h, kTopK, first_token, kRank, valid);
    for (int64_t e = 0; e < shape.experts; ++e) {
      want_ring[static_cast<size_t>(step * shape.experts + e)] += w.counts[static_cast<size_t>(e)];
    }
    step = (step + 1) % kWindow;
    std::fill_n(want_ring.begin() + step * shape.experts, shape.experts, 0);

    const std::string label = "seed " + std::to_string(seed) + " pass " + std::to_string(pass);
    ASSERT_EQ(fused_slots.copy_out(stream_), w.slots) << label;
    ASSERT_EQ(split_slots.copy_out(stream_), w.slots) << label;
    int32_t fused_step = -2;
    int32_t split_step = -2;
    ASSERT_EQ(read_ring(fused_ring, &fused_step), want_ring) << label << " fused";
    ASSERT_EQ(read_ring(split_ring, &split_step), want_ring) << label << " two kernels";
    EXPECT_EQ(fused_step, step) << label;
    EXPECT_EQ(split_step, step) << label;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace eplb::cuda
