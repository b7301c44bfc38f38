// Fused routing + load recording against the two-kernel sequence (map, then count), for the
// batch sizes of a decode step: 256 logical -> 288 physical experts, top-8, hash dispatch.
//
//   eplb_cuda_routing_bench [--json] [--iterations N] [--warmup N]
//
// Two timings per kernel, both from CUDA events around many calls after a warm-up:
//   stream  back-to-back launches on one stream (what an eager engine pays, launch included);
//   graph   one CUDA graph holding kGraphCalls calls, replayed (the device time of the calls
//           when launch overhead is amortized, as in an engine that captures its forward pass).
// Each ratio is two-kernel / fused (> 1: the fused kernel is faster). Then the kernels of split
// and adaptive dispatch (routing/dispatch.h) on the same batches, launched on a stream: the
// split route, the step's adaptive shares (one thread running the CPU's solver) and the adaptive
// route, each checked against the CPU's slots. Without a CUDA device the program says so and
// exits 0, so scripts can run it anywhere.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/cuda/routing.h"
#include "eplb/routing/dispatch.h"

namespace eplb::cuda {
namespace {

constexpr int64_t kExperts = 256;
constexpr int64_t kPhysical = 288;
constexpr int64_t kRanks = 32;
constexpr int64_t kNodes = 4;
constexpr int64_t kTopK = 8;
constexpr int64_t kRank = 3;
constexpr int64_t kWindow = 100;
constexpr int kGraphCalls = 100;
constexpr int64_t kTokenCounts[] = {432, 768};

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "eplb_cuda_routing_bench: %s failed: %s\n", what,
                 cudaGetErrorString(status));
    std::exit(1);
  }
}

struct Options {
  bool json = false;
  int iterations = 2000;
  int warmup = 200;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto count = [&](const char* name) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value (a positive number of calls)\n", name);
        std::exit(2);
      }
      const int v = std::atoi(argv[++i]);
      if (v < 1) {
        std::fprintf(stderr, "%s %s must be a positive number of calls\n", name, argv[i]);
        std::exit(2);
      }
      return v;
    };
    if (arg == "--json") {
      o.json = true;
    } else if (arg == "--iterations") {
      o.iterations = count("--iterations");
    } else if (arg == "--warmup") {
      o.warmup = count("--warmup");
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: eplb_cuda_routing_bench [--json] [--iterations N] [--warmup N]\n");
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown argument '%s' (expected --json, --iterations N, --warmup N)\n",
                   arg.c_str());
      std::exit(2);
    }
  }
  return o;
}

// A skewed placement: the 32 redundant slots go to the hottest experts of a Zipf-like load.
Placement bench_placement() {
  Placement p(1, kExperts, kPhysical);
  for (int64_t s = 0; s < kExperts; ++s)
    p.phy2log[static_cast<size_t>(s)] = static_cast<int32_t>(s);
  for (int64_t s = kExperts; s < kPhysical; ++s) {
    p.phy2log[static_cast<size_t>(s)] = static_cast<int32_t>((s - kExperts) % 16);
  }
  p.derive_from_phy2log();
  return p;
}

std::vector<int32_t> skewed_ids(int64_t tokens, std::mt19937_64& rng) {
  std::vector<double> weights(static_cast<size_t>(kExperts));
  for (int64_t e = 0; e < kExperts; ++e)
    weights[static_cast<size_t>(e)] = 1.0 / static_cast<double>(e + 1);
  std::discrete_distribution<int32_t> pick(weights.begin(), weights.end());
  std::vector<int32_t> ids(static_cast<size_t>(tokens * kTopK));
  for (auto& e : ids) e = pick(rng);
  return ids;
}

struct Row {
  int64_t tokens = 0;
  double fused_us = 0, split_us = 0;              // stream launches
  double fused_graph_us = 0, split_graph_us = 0;  // graph replay
  // Dispatches split and adaptive (stream launches), and whether their slots are the CPU's.
  double split_dispatch_us = 0, adaptive_shares_us = 0, adaptive_route_us = 0;
  bool agree = false;
};

template <typename Call>
double time_stream(Call call, const Options& o, cudaStream_t stream) {
  for (int i = 0; i < o.warmup; ++i) call();
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < o.iterations; ++i) call();
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * ms / o.iterations;
}

template <typename Call>
double time_graph(Call call, const Options& o, cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  for (int i = 0; i < kGraphCalls; ++i) call();
  check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  const int replays = std::max(1, o.iterations / kGraphCalls);
  Options per_replay = o;
  per_replay.iterations = replays;
  per_replay.warmup = std::max(1, o.warmup / kGraphCalls);
  const double us = time_stream([&] { check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); },
                                per_replay, stream);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us / kGraphCalls;
}

Row measure(int64_t tokens, const routing::DispatchTables& host_tables, const Options& o,
            cudaStream_t stream) {
  std::mt19937_64 rng(static_cast<uint64_t>(tokens));
  const std::vector<int32_t> ids = skewed_ids(tokens, rng);
  const size_t entries = ids.size();

  DeviceDispatchTables tables(host_tables, kPhysical - kExperts + 1, stream);
  DeviceStepInputs inputs(stream);
  // Padding rows are part of a captured batch: count all but the last 16.
  inputs.set(1'000'000, static_cast<int32_t>(tokens - 16), stream);
  DeviceLoadRing fused_ring(1, kExperts, kWindow, stream);
  DeviceLoadRing split_ring(1, kExperts, kWindow, stream);
  int32_t* d_ids = nullptr;
  int32_t* d_fused = nullptr;
  int32_t* d_split = nullptr;
  check(cudaMalloc(&d_ids, entries * sizeof(int32_t)), "cudaMalloc");
  check(cudaMalloc(&d_fused, entries * sizeof(int32_t)), "cudaMalloc");
  check(cudaMalloc(&d_split, entries * sizeof(int32_t)), "cudaMalloc");
  check(
      cudaMemcpyAsync(d_ids, ids.data(), entries * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync");

  const RouteBatch fused{.expert_ids = d_ids,
                         .slots = d_fused,
                         .tokens = tokens,
                         .top_k = kTopK,
                         .valid_tokens = inputs.valid_tokens(),
                         .first_token = inputs.first_token(),
                         .rank = kRank,
                         .layer = 0};
  RouteBatch split = fused;
  split.slots = d_split;

  Row row;
  row.tokens = tokens;
  // One call each on fresh rings: the same slots and the same counts.
  route_and_record(tables.view(), fused, fused_ring.view(), stream);
  route_then_record(tables.view(), split, split_ring.view(), stream);
  std::vector<int32_t> a(entries), b(entries);
  std::vector<int64_t> ra(static_cast<size_t>(kWindow * kExperts)), rb(ra.size());
  check(
      cudaMemcpyAsync(a.data(), d_fused, entries * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync");
  check(
      cudaMemcpyAsync(b.data(), d_split, entries * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync");
  fused_ring.read(ra, stream);
  split_ring.read(rb, stream);
  row.agree = a == b && ra == rb;

  const LoadRingView fv = fused_ring.view();
  const LoadRingView sv = split_ring.view();
  auto call_fused = [&] { route_and_record(tables.view(), fused, fv, stream); };
  auto call_split = [&] { route_then_record(tables.view(), split, sv, stream); };
  row.fused_us = time_stream(call_fused, o, stream);
  row.split_us = time_stream(call_split, o, stream);
  row.fused_graph_us = time_graph(call_fused, o, stream);
  row.split_graph_us = time_graph(call_split, o, stream);

  // Split and adaptive: this rank's batch, the step's counts of 32 such batches (this one and
  // 31 more drawn alike), this rank's prefix; slots checked against the CPU's.
  std::vector<int64_t> global(static_cast<size_t>(kExperts), 0), prefix(global.size(), 0);
  for (int64_t g = 0; g < kRanks; ++g) {
    const std::vector<int32_t> other = g == kRank ? ids : skewed_ids(tokens, rng);
    routing::count_experts(other, kExperts, global);
    if (g < kRank) routing::count_experts(other, kExperts, prefix);
  }
  int64_t* d_counts = nullptr;
  int64_t* d_prefix = nullptr;
  check(cudaMalloc(&d_counts, global.size() * sizeof(int64_t)), "cudaMalloc");
  check(cudaMalloc(&d_prefix, prefix.size() * sizeof(int64_t)), "cudaMalloc");
  check(cudaMemcpyAsync(d_counts, global.data(), global.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
  check(cudaMemcpyAsync(d_prefix, prefix.data(), prefix.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
  // Shares are aligned with the device tables' rows, whose stride is their capacity.
  routing::DispatchTables wide = host_tables;
  const int64_t capacity = kPhysical - kExperts + 1;
  wide.log2phy.assign(static_cast<size_t>(kExperts * capacity), -1);
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int64_t i = 0; i < host_tables.replica_count[e]; ++i) {
      wide.log2phy[e * capacity + i] = host_tables.log2phy[e * host_tables.max_replicas + i];
    }
  }
  wide.max_replicas = capacity;
  DeviceAdaptiveShares shares(
      kExperts, capacity,
      RankShape{static_cast<int32_t>(kRanks), static_cast<int32_t>(kPhysical / kRanks)});
  route_split_and_record(tables.view(), fused, fv, stream);
  std::vector<int32_t> want(entries);
  uint64_t state = 1;
  routing::route(host_tables, routing::DispatchPolicy::kSplit, ids, kTopK, want, 0, kRank, state);
  check(
      cudaMemcpyAsync(a.data(), d_fused, entries * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  row.agree = row.agree && a == want;
  compute_adaptive_shares(tables.view(), d_counts, shares, stream);
  route_adaptive_and_record(tables.view(), shares, d_prefix, fused, fv, stream);
  routing::AdaptiveShares cpu;
  routing::adaptive_shares(wide, global, cpu);
  routing::route_adaptive(wide, cpu, prefix, ids, kTopK, want);
  check(
      cudaMemcpyAsync(a.data(), d_fused, entries * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  row.agree = row.agree && a == want;
  row.split_dispatch_us =
      time_stream([&] { route_split_and_record(tables.view(), fused, fv, stream); }, o, stream);
  row.adaptive_shares_us = time_stream(
      [&] { compute_adaptive_shares(tables.view(), d_counts, shares, stream); }, o, stream);
  row.adaptive_route_us = time_stream(
      [&] { route_adaptive_and_record(tables.view(), shares, d_prefix, fused, fv, stream); }, o,
      stream);

  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaFree(d_counts);
  cudaFree(d_prefix);
  cudaFree(d_ids);
  cudaFree(d_fused);
  cudaFree(d_split);
  return row;
}

void print_no_device(const Options& o, const char* why) {
  if (o.json) {
    std::printf(
        "{\"benchmark\": \"cuda_routing\", \"skipped\": \"no CUDA device\", "
        "\"reason\": \"%s\", \"rows\": []}\n",
        why);
  } else {
    std::printf("eplb_cuda_routing_bench: no CUDA device (%s): nothing to measure; exiting 0\n",
                why);
  }
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    print_no_device(o, status != cudaSuccess ? cudaGetErrorString(status)
                                             : "cudaGetDeviceCount found 0 devices");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

    const Layout layout{
        .experts = kExperts, .physical = kPhysical, .ranks = kRanks, .nodes = kNodes, .groups = 1};
    const routing::DispatchTables tables =
        routing::build_dispatch_tables(bench_placement(), 0, layout);
    std::vector<Row> rows;
    for (int64_t tokens : kTokenCounts) rows.push_back(measure(tokens, tables, o, stream));
    check(cudaStreamDestroy(stream), "cudaStreamDestroy");

    bool all_agree = true;
    for (const Row& r : rows) all_agree = all_agree && r.agree;
    if (o.json) {
      std::printf(
          "{\"benchmark\": \"cuda_routing\", \"device\": \"%s\", \"experts\": %lld, "
          "\"physical\": %lld, \"top_k\": %lld, \"iterations\": %d, \"graph_calls\": %d, "
          "\"results_agree\": %s, \"rows\": [",
          prop.name, static_cast<long long>(kExperts), static_cast<long long>(kPhysical),
          static_cast<long long>(kTopK), o.iterations, kGraphCalls, all_agree ? "true" : "false");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::printf(
            "%s{\"tokens\": %lld, \"fused_us\": %.3f, \"two_kernel_us\": %.3f, "
            "\"ratio\": %.3f, \"fused_graph_us\": %.3f, \"two_kernel_graph_us\": %.3f, "
            "\"graph_ratio\": %.3f, \"split_dispatch_us\": %.3f, "
            "\"adaptive_shares_us\": %.3f, \"adaptive_route_us\": %.3f, "
            "\"agree\": %s}",
            i == 0 ? "" : ", ", static_cast<long long>(r.tokens), r.fused_us, r.split_us,
            r.split_us / r.fused_us, r.fused_graph_us, r.split_graph_us,
            r.split_graph_us / r.fused_graph_us, r.split_dispatch_us, r.adaptive_shares_us,
            r.adaptive_route_us, r.agree ? "true" : "false");
      }
      std::printf("]}\n");
    } else {
      std::printf("eplb CUDA routing + load recording on %s\n", prop.name);
      std::printf(
          "%lld logical -> %lld physical experts, top-%lld, hash dispatch, rank %lld; "
          "%d calls after %d warm-up; graph: %d calls per replay\n",
          static_cast<long long>(kExperts), static_cast<long long>(kPhysical),
          static_cast<long long>(kTopK), static_cast<long long>(kRank), o.iterations, o.warmup,
          kGraphCalls);
      std::printf("microseconds per call; ratio = two-kernel / fused (> 1: fused is faster)\n\n");
      std::printf("%8s | %-32s | %-32s |\n", "", "launched on a stream",
                  "replayed from a CUDA graph");
      std::printf("%8s | %10s %12s %8s | %10s %12s %8s | %s\n", "tokens", "fused", "two-kernel",
                  "ratio", "fused", "two-kernel", "ratio", "agree");
      for (const Row& r : rows) {
        std::printf("%8lld | %10.2f %12.2f %8.2f | %10.2f %12.2f %8.2f | %s\n",
                    static_cast<long long>(r.tokens), r.fused_us, r.split_us,
                    r.split_us / r.fused_us, r.fused_graph_us, r.split_graph_us,
                    r.split_graph_us / r.fused_graph_us, r.agree ? "yes" : "NO");
      }
      std::printf(
          "\nsplit and adaptive dispatch, microseconds per launch on a stream (the "
          "shares: one thread runs the CPU's solver)\n");
      std::printf("%8s | %12s %16s %16s\n", "tokens", "split route", "adaptive shares",
                  "adaptive route");
      for (const Row& r : rows) {
        std::printf("%8lld | %12.2f %16.2f %16.2f\n", static_cast<long long>(r.tokens),
                    r.split_dispatch_us, r.adaptive_shares_us, r.adaptive_route_us);
      }
    }
    if (!all_agree) {
      std::fprintf(stderr,
                   "eplb_cuda_routing_bench: fused and two-kernel results differ, or "
                   "split/adaptive slots differ from the CPU's\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eplb_cuda_routing_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace eplb::cuda

int main(int argc, char** argv) { return eplb::cuda::run(argc, argv); }
