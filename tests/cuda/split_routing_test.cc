// Dispatches split and adaptive on the device: the kernels' per-entry choices compiled for the
// host against routing::route and routing::route_adaptive (everywhere), then the kernels
// themselves, the device's shares against the CPU's, and a captured graph replayed with new
// counts (with a device).

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/routing_testing.h"
#include "eplb/core/error.h"
#include "eplb/cuda/routing.h"
#include "eplb/routing/dispatch.h"

namespace eplb::cuda {
namespace {

const Shape kShapes[] = {
    {256, 288, 32, 4, 8}, {8, 12, 4, 2, 2}, {64, 128, 8, 1, 6}, {16, 64, 4, 1, 4}, {1, 4, 1, 1, 1}};

DispatchTablesView host_view(const DispatchTables& t) {
  DispatchTablesView v;
  v.log2phy = t.log2phy.data();
  v.replica_count = t.replica_count.data();
  v.experts = static_cast<int32_t>(t.experts);
  v.max_replicas = static_cast<int32_t>(t.max_replicas);
  return v;
}

// A step of `ranks` senders: every sender's ids, the global counts and each one's prefix.
struct Step {
  std::vector<std::vector<int32_t>> ids;     // [ranks][tokens * top_k]
  std::vector<int64_t> global;               // [experts]
  std::vector<std::vector<int64_t>> prefix;  // [ranks][experts]
};

Step random_step(const Shape& shape, int64_t tokens, std::mt19937_64& rng) {
  Step s;
  s.global.assign(static_cast<size_t>(shape.experts), 0);
  for (int64_t g = 0; g < shape.ranks; ++g) {
    s.prefix.push_back(s.global);
    s.ids.push_back(random_ids(tokens * shape.top_k, shape.experts, rng));
    routing::count_experts(s.ids.back(), shape.experts, s.global);
  }
  return s;
}

TEST(CudaSplitRoutingHost, KernelChoicesMatchTheCpuRouters) {
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    std::mt19937_64 rng(seed);
    for (const Shape& shape : kShapes) {
      // Odd seeds: one rank's slots unusable, its lone experts routed to -1.
      const DispatchTables t =
          seed % 2 == 1 ? random_tables_without_a_rank(shape, rng) : random_tables(shape, rng);
      const Step step = random_step(shape, 1 + static_cast<int64_t>(rng() % 300), rng);
      routing::AdaptiveShares shares;
      routing::adaptive_shares(t, step.global, shares);
      for (int64_t g = 0; g < shape.ranks; ++g) {
        const std::vector<int32_t>& ids = step.ids[g];
        std::vector<int32_t> want(ids.size()), got(ids.size());
        uint64_t state = 1;
        routing::route(t, DispatchPolicy::kSplit, ids, shape.top_k, want, 0, g, state);
        kernel_route_ordered(host_view(t), ids.data(), static_cast<int64_t>(ids.size()),
                             static_cast<uint32_t>(g), nullptr, nullptr, got.data());
        ASSERT_EQ(got, want) << "split, seed " << seed << " experts " << shape.experts;
        routing::route_adaptive(t, shares, step.prefix[g], ids, shape.top_k, want);
        kernel_route_ordered(host_view(t), ids.data(), static_cast<int64_t>(ids.size()),
                             static_cast<uint32_t>(g), shares.share.data(), step.prefix[g].data(),
                             got.data());
        ASSERT_EQ(got, want) << "adaptive, seed " << seed << " experts " << shape.experts;
      }
    }
  }
  // Invalid ids get -1, like the hash kernel.
  std::mt19937_64 rng(3);
  const DispatchTables t = random_tables(kShapes[1], rng);
  const int32_t ids[] = {-1, 8, 0};
  int32_t slots[3];
  kernel_route_ordered(host_view(t), ids, 3, 0, nullptr, nullptr, slots);
  EXPECT_EQ(slots[0], -1);
  EXPECT_EQ(slots[1], -1);
  EXPECT_GE(slots[2], 0);
}

TEST(CudaSplitRoutingHost, LaunchesRejectBadArgumentsBeforeLaunching) {
  std::vector<int32_t> i32(64, 0);
  std::vector<int64_t> i64(64, 0);
  DispatchTablesView tables{i32.data(), i32.data(), 20000, 1};
  LoadRingView ring{i64.data(), i32.data(), 1, 1, 20000};
  uint64_t first = 0;
  const RouteBatch batch{.expert_ids = i32.data(),
                         .slots = i32.data(),
                         .tokens = 1,
                         .top_k = 1,
                         .valid_tokens = i32.data(),
                         .first_token = &first,
                         .rank = 0,
                         .layer = 0};
  EXPECT_THROW(route_split_and_record(tables, batch, ring, nullptr), InvalidArgument);
  EXPECT_THROW(DeviceAdaptiveShares(0, 1, RankShape{1, 1}), InvalidArgument);
  EXPECT_THROW(DeviceAdaptiveShares(4, 1, RankShape{0, 1}), InvalidArgument);
}

// ---- On the device ----

class CudaSplitRouting : public CudaRouting {};

TEST_F(CudaSplitRouting, KernelsMatchTheCpuAndTheSharesAreTheCpus) {
  for (uint64_t seed : {21u, 22u, 23u}) {
    std::mt19937_64 rng(seed);
    for (const Shape& shape : kShapes) {
      // Seed 23: one rank's slots unusable, its lone experts routed to -1.
      const DispatchTables t =
          seed == 23 ? random_tables_without_a_rank(shape, rng) : random_tables(shape, rng);
      const int64_t tokens = 1 + static_cast<int64_t>(rng() % 500);
      const Step step = random_step(shape, tokens, rng);
      routing::AdaptiveShares cpu;
      routing::adaptive_shares(t, step.global, cpu);

      DeviceDispatchTables tables(t, t.max_replicas, stream_);
      DeviceStepInputs inputs(stream_);
      const auto valid = static_cast<int32_t>(rng() % static_cast<uint64_t>(tokens + 1));
      inputs.set(0, valid, stream_);
      DeviceArray<int64_t> d_global(step.global.size());
      d_global.copy_in(step.global, stream_);
      DeviceAdaptiveShares shares(
          t.experts, t.max_replicas,
          RankShape{static_cast<int32_t>(shape.ranks), static_cast<int32_t>(t.slots_per_rank)});
      compute_adaptive_shares(tables.view(), d_global.get(), shares, stream_);
      std::vector<int64_t> got_shares(cpu.share.size());
      EPLB_ASSERT_CUDA(cudaMemcpyAsync(got_shares.data(), shares.shares(),
                                       got_shares.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                       stream_));
      int64_t got_max = -2;
      EPLB_ASSERT_CUDA(cudaMemcpyAsync(&got_max, shares.max_rank_load(), sizeof(int64_t),
                                       cudaMemcpyDeviceToHost, stream_));
      EPLB_ASSERT_CUDA(cudaStreamSynchronize(stream_));
      ASSERT_EQ(got_shares, cpu.share) << "seed " << seed << " experts " << shape.experts;
      ASSERT_EQ(got_max, cpu.max_rank_load);

      for (int64_t g = 0; g < shape.ranks; g += std::max<int64_t>(1, shape.ranks / 4)) {
        const std::vector<int32_t>& ids = step.ids[g];
        DeviceArray<int32_t> d_ids(ids.size()), d_slots(ids.size());
        DeviceArray<int64_t> d_prefix(step.prefix[g].size());
        d_ids.copy_in(ids, stream_);
        d_prefix.copy_in(step.prefix[g], stream_);
        for (const bool adaptive : {false, true}) {
          DeviceLoadRing ring(1, t.experts, 1, stream_);
          const RouteBatch batch{.expert_ids = d_ids.get(),
                                 .slots = d_slots.get(),
                                 .tokens = tokens,
                                 .top_k = shape.top_k,
                                 .valid_tokens = inputs.valid_tokens(),
                                 .first_token = inputs.first_token(),
                                 .rank = g,
                                 .layer = 0};
          std::vector<int32_t> want(ids.size());
          if (adaptive) {
            route_adaptive_and_record(tables.view(), shares, d_prefix.get(), batch, ring.view(),
                                      stream_);
            routing::route_adaptive(t, cpu, step.prefix[g], ids, shape.top_k, want);
          } else {
            route_split_and_record(tables.view(), batch, ring.view(), stream_);
            uint64_t state = 1;
            routing::route(t, DispatchPolicy::kSplit, ids, shape.top_k, want, 0, g, state);
          }
          ASSERT_EQ(d_slots.copy_out(stream_), want)
              << (adaptive ? "adaptive" : "split") << " seed " << seed << " rank " << g;
          std::vector<int64_t> counts(static_cast<size_t>(t.experts), 0);
          routing::count_experts({ids.data(), static_cast<size_t>(valid * shape.top_k)}, t.experts,
                                 counts);
          std::vector<int64_t> got(counts.size());
          ring.read(got, stream_);
          ASSERT_EQ(got, counts) << "counts of the valid rows";
        }
      }
    }
  }
}

TEST_F(CudaSplitRouting, GraphReplayFollowsNewCounts) {
  std::mt19937_64 rng(31);
  const Shape shape = kShapes[0];
  const DispatchTables t = random_tables(shape, rng);
  const int64_t tokens = 64;
  DeviceDispatchTables tables(t, t.max_replicas, stream_);
  DeviceStepInputs inputs(stream_);
  inputs.set(0, static_cast<int32_t>(tokens), stream_);
  DeviceAdaptiveShares shares(
      t.experts, t.max_replicas,
      RankShape{static_cast<int32_t>(shape.ranks), static_cast<int32_t>(t.slots_per_rank)});
  DeviceArray<int64_t> d_global(static_cast<size_t>(t.experts)),
      d_prefix(static_cast<size_t>(t.experts));
  DeviceArray<int32_t> d_ids(static_cast<size_t>(tokens * shape.top_k)),
      d_slots(static_cast<size_t>(tokens * shape.top_k));
  DeviceLoadRing ring(1, t.experts, 2, stream_);
  const RouteBatch batch{.expert_ids = d_ids.get(),
                         .slots = d_slots.get(),
                         .tokens = tokens,
                         .top_k = shape.top_k,
                         .valid_tokens = inputs.valid_tokens(),
                         .first_token = inputs.first_token(),
                         .rank = 3,
                         .layer = 0};
  EPLB_ASSERT_CUDA(cudaStreamSynchronize(stream_));
  cudaGraph_t graph = nullptr;
  EPLB_ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  compute_adaptive_shares(tables.view(), d_global.get(), shares, stream_);
  route_adaptive_and_record(tables.view(), shares, d_prefix.get(), batch, ring.view(), stream_);
  advance_window(ring.view(), stream_);
  EPLB_ASSERT_CUDA(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  EPLB_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    const Step step = random_step(shape, tokens, rng);
    d_global.copy_in(step.global, stream_);
    d_prefix.copy_in(step.prefix[3], stream_);
    d_ids.copy_in(step.ids[3], stream_);
    EPLB_ASSERT_CUDA(cudaGraphLaunch(exec, stream_));
    routing::AdaptiveShares cpu;
    routing::adaptive_shares(t, step.global, cpu);
    std::vector<int32_t> want(step.ids[3].size());
    routing::route_adaptive(t, cpu, step.prefix[3], step.ids[3], shape.top_k, want);
    ASSERT_EQ(d_slots.copy_out(stream_), want) << "replay " << replay;
  }
  EPLB_ASSERT_CUDA(cudaGraphExecDestroy(exec));
  EPLB_ASSERT_CUDA(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace eplb::cuda
