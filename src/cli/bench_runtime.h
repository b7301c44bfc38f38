#pragma once
// `eplb bench runtime`, shared by its two ways of running the ranks: forked processes (shm or
// ucx; bench_runtime.cc) and, with --threads, threads of this one process (inproc control and
// transport; bench_runtime_threads.cc). bench_runtime.cc parses and validates the arguments;
// the runners take them as they are.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "eplb/runtime/rebalancer.h"

namespace eplb::cli {

struct BenchRuntimeArgs {
  // Processes: exactly one count. Threads: one run per count, in the order given.
  std::vector<int> ranks = {4};
  std::string ranks_text = "4";  // --ranks as given: parse_int_list fills `ranks`
  int64_t layers = 58;
  int64_t slots_per_rank = 9;
  int64_t experts = 0;  // 0: one redundant slot per rank (for each rank count)
  int64_t expert_bytes = 1 << 20;
  int64_t steps = 400;
  int64_t interval = 20;
  int64_t window = 10;
  int64_t lag = 2;
  double forward_ms = 5;
  std::string mode = "both";
  std::string transport = "shm";
  std::string policy = "balanced";
  // arena: the runtime allocates them (what the protocol's own stall is measured on); engine:
  // each rank allocates them and the runtime registers them (installs then copy).
  std::string weights = "arena";
  int64_t timeout_ms = 60'000;
  bool json = false;
  bool verbose = false;
  // --threads: the ranks are threads, the invariants are checked at every step, and random
  // delays (seeded) are put into the fake forward pass, before step_end and into the runtime's
  // own threads (RebalancerTesting::set_delay_hook, runtime/testing.h).
  bool threads = false;
  uint64_t seed = 0;
  int64_t max_delay_us = 200;
};

// The logical experts of a run with `ranks` ranks (--experts, or one redundant slot per rank).
int64_t experts_for(const BenchRuntimeArgs& args, int ranks);

// The weights of one rank: one tensor "w" of --expert-bytes per slot; with --weights engine
// the rank's own buffers (`own`, [layers], kept alive by the caller) registered with the runtime.
runtime::WeightSpec weight_spec(const BenchRuntimeArgs& args, std::vector<std::vector<std::byte>>& own);

// This step's load: two very different skews, flipped by `phase` (the rebalances so far, the
// same on every rank at every step), so that every rebalance moves many experts of every layer.
void record_load(runtime::Rebalancer& rb, int64_t layers, int64_t experts, int64_t phase);

// The q-quantile (nearest rank) of `values`; 0 when empty.
double percentile(std::vector<double> values, double q);

// --threads: one run per rank count and mode, figures printed (or one JSON object).
void run_bench_runtime_threads(const BenchRuntimeArgs& args);

}  // namespace eplb::cli
