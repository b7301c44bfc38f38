// `eplb bench runtime`: the forward thread's stall (time inside step_end) per step and per
// rebalance, async against sync, in the same run. Ranks are forked processes (shm control
// plane, shm transport) running a fixed-duration fake forward pass; the load alternates
// between two very different skews after every rebalance, so every rebalance moves many
// experts of every layer. With --threads the ranks are threads of this process instead
// (bench_runtime_threads.cc), which takes 64-256 ranks on one machine.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli/bench_runtime.h"
#include "cli/commands.h"
#include "cli/option_checks.h"
#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"

namespace eplb::cli {

int64_t experts_for(const BenchRuntimeArgs& args, int ranks) {
  return args.experts != 0 ? args.experts : ranks * (args.slots_per_rank - 1);
}

runtime::WeightSpec weight_spec(const BenchRuntimeArgs& args,
                                std::vector<std::vector<std::byte>>& own) {
  runtime::WeightSpec spec{.layers = args.layers, .tensors = {{"w", args.expert_bytes}}};
  if (args.weights == "engine") {
    own.reserve(static_cast<size_t>(args.layers));  // the bases stay where they are
    for (int64_t l = 0; l < args.layers; ++l) {
      own.emplace_back(static_cast<size_t>(args.slots_per_rank * args.expert_bytes));
      spec.engine.push_back({.base = own.back().data(), .stride = 0});
    }
  }
  return spec;
}

// Hot experts at the low ids, then at the high ids (shifted per layer so that layers differ).
void record_load(runtime::Rebalancer& rb, int64_t layers, int64_t experts, int64_t phase) {
  std::vector<int64_t> counts(static_cast<size_t>(experts));
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t position = (e + l * 5) % experts;
      const int64_t r = phase % 2 == 0 ? position : experts - 1 - position;
      counts[e] = 64000 / (1 + r);
    }
    rb.record_counts(l, counts);
  }
}

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto index = static_cast<size_t>(q * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

namespace {

using Clock = std::chrono::steady_clock;

struct ModeFigures {
  double p50 = 0, p99 = 0, max = 0, total_per_rebalance = 0;
  int64_t rebalances = 0;
  double steps_per_rebalance = 0;
  int64_t slots_per_rebalance = 0;
};

// One rank's run; writes its step_end times and completed rebalances to `out`.
int run_rank(const BenchRuntimeArgs& args, runtime::Mode mode, const std::string& rendezvous,
             int rank, const std::string& out) {
  control::Options options;
  options.rank = rank;
  options.size = args.ranks.front();
  options.rendezvous = rendezvous;
  options.timeout = std::chrono::milliseconds(args.timeout_ms);
  std::unique_ptr<control::Communicator> comm = control::connect("shm", options);
  // The bench's own communicator: the barrier that ends each fake forward pass stands for the
  // all-to-alls that keep expert-parallel ranks in step in a real engine.
  options.rendezvous = rendezvous + "-forward";
  options.group = "forward";
  std::unique_ptr<control::Communicator> lockstep = control::connect("shm", options);
  std::unique_ptr<transport::Transport> transport =
      transport::create(args.transport, transport::Options{.rank = rank});

  runtime::Config config;
  config.layout = Layout{.experts = args.experts,
                         .physical = args.ranks.front() * args.slots_per_rank,
                         .ranks = args.ranks.front(),
                         .nodes = 1,
                         .groups = 1};
  config.interval = args.interval;
  config.window = args.window;
  config.lag = args.lag;
  config.mode = mode;
  config.placement.policy = placement::parse_policy(args.policy);
  config.min_balancedness_gain = -1;  // forced: every trigger rebalances
  config.timeout = std::chrono::milliseconds(args.timeout_ms);
  std::vector<std::vector<std::byte>> own;  // --weights engine: [layers], this rank's slots
  const runtime::WeightSpec spec = weight_spec(args, own);
  runtime::Rebalancer rb(config, *comm, *transport, spec,
                         trivial_placement(args.layers, args.experts, config.layout.physical));
  rb.connect();

  std::vector<double> stall_ms;
  stall_ms.reserve(static_cast<size_t>(args.steps));
  const auto forward = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(args.forward_ms));
  auto next = Clock::now();
  for (int64_t step = 0; step < args.steps; ++step) {
    // The phase flips after every rebalance: the same step on every rank.
    record_load(rb, args.layers, args.experts, static_cast<int64_t>(rb.history().size()));
    next += forward;
    std::this_thread::sleep_until(next);  // the fake forward pass ...
    lockstep->barrier();                  // ... whose all-to-alls keep the ranks in step
    const auto start = Clock::now();
    rb.step_end();
    stall_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    next = std::max(next, Clock::now());
  }
  rb.shutdown();
  nlohmann::json result = {{"stall_ms", stall_ms}};
  nlohmann::json records = nlohmann::json::array();
  for (const runtime::RebalanceRecord& r : rb.history()) {
    if (r.outcome != runtime::Outcome::kCompleted) continue;
    records.push_back({{"stall_total_ms", r.stall_total_ms},
                       {"steps", r.steps},
                       {"slots_moved", r.slots_moved}});
  }
  result["rebalances"] = records;
  std::ofstream(out) << result.dump();
  return 0;
}

ModeFigures run_mode(const BenchRuntimeArgs& args, runtime::Mode mode) {
  const control::ScratchFolder scratch("eplb-bench-runtime");
  const std::string& dir = scratch.path();
  const std::string rendezvous =
      fmt::format("eplb-bench-runtime-{}-{}", ::getpid(), runtime::mode_name(mode));
  control::ForkOptions fork_options;
  fork_options.timeout = std::chrono::milliseconds(
      static_cast<int64_t>(static_cast<double>(args.steps) * args.forward_ms) + 600'000);
  const auto exits = control::fork_ranks(
      args.ranks.front(),
      [&](int rank) {
        return run_rank(args, mode, rendezvous, rank, fmt::format("{}/rank{}.json", dir, rank));
      },
      fork_options);
  control::check_all_ok(exits);

  ModeFigures figures;
  std::vector<double> all_steps;
  double total = 0;
  double steps = 0;
  int64_t records = 0;
  int64_t slots = 0;
  for (int rank = 0; rank < args.ranks.front(); ++rank) {
    std::ifstream in(fmt::format("{}/rank{}.json", dir, rank));
    const nlohmann::json result = nlohmann::json::parse(in);
    for (const double ms : result["stall_ms"]) all_steps.push_back(ms);
    const auto& rebalances = result["rebalances"];
    if (rank == 0) figures.rebalances = static_cast<int64_t>(rebalances.size());
    for (const auto& r : rebalances) {
      total += r["stall_total_ms"].get<double>();
      steps += r["steps"].get<double>();
      slots += r["slots_moved"].get<int64_t>();
      ++records;
    }
  }
  figures.p50 = percentile(all_steps, 0.50);
  figures.p99 = percentile(all_steps, 0.99);
  figures.max = all_steps.empty() ? 0 : *std::max_element(all_steps.begin(), all_steps.end());
  if (records > 0) {
    figures.total_per_rebalance = total / static_cast<double>(records);
    figures.steps_per_rebalance = steps / static_cast<double>(records);
    figures.slots_per_rebalance = slots / records;
  }
  return figures;
}

// The most thread ranks one process takes: each runs four threads (forward, control, worker,
// monitor), and the process limit (ulimit -u) counts threads.
int max_thread_ranks() {
  constexpr long kMaxThreadRanks = 1024;
  long most = kMaxThreadRanks;
  rlimit limit{};
  if (getrlimit(RLIMIT_NPROC, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    most = std::min<long>(most, static_cast<long>(limit.rlim_cur / 5));
  }
  return static_cast<int>(std::max(2L, most));
}

// What every rank count of the run must satisfy; `threads` says what the ranks are.
void check_shape(const BenchRuntimeArgs& args, int ranks) {
  const int most = args.threads ? max_thread_ranks() : control::max_local_ranks();
  if (ranks < 2 || ranks > most) {
    fail("--ranks ", ranks, " is outside [2, ", most, "] (",
         args.threads ? "rank threads one process takes: 4 threads each, within ulimit -u"
                      : "rank processes this machine takes",
         ")");
  }
  if (args.slots_per_rank < 1 || args.slots_per_rank > kMaxPhysical / ranks) {
    fail("--slots-per-rank ", args.slots_per_rank, " is outside [1, ", kMaxPhysical / ranks,
         "] with --ranks ", ranks, " (at most ", kMaxPhysical, " physical slots per layer)");
  }
  // Every rank holds its slots of every layer and one staging layer.
  const int64_t rank_bytes = checked_mul(
      checked_mul(args.layers + 1, args.slots_per_rank, "--layers x --slots-per-rank"),
      args.expert_bytes, "the weights of one rank (--layers x --slots-per-rank x --expert-bytes)");
  check_fits_in_memory(checked_mul(rank_bytes, ranks, "the weights of all ranks"),
                       detail::concat("the weights of ", ranks, " ranks"),
                       "lower --layers, --slots-per-rank or --expert-bytes");
  // Thread ranks share this process's memory: each holds its own load window and dispatch
  // tables ([ranks][experts] int32 per layer, twice while a rebalance builds new ones).
  if (args.threads) {
    const int64_t experts = std::max<int64_t>(experts_for(args, ranks), 1);
    const int64_t window = stats::LoadRecorder::bytes_for(args.layers, experts, args.window);
    const int64_t tables = checked_mul(
        checked_mul(args.layers, ranks, "--layers x --ranks"), 8 * experts, "the tables");
    const int64_t per_rank = window + tables;
    check_fits_in_memory(checked_mul(per_rank, ranks, "the memory of all ranks"),
                         detail::concat("the load windows and tables of ", ranks,
                                        " thread ranks (", per_rank, " bytes each)"),
                         "lower --ranks, --window or --layers");
  }
  const int64_t experts = experts_for(args, ranks);
  if (args.experts == 0 && args.slots_per_rank == 1) {
    fail("with one slot per rank there is no redundant slot, so --experts has no default: say "
         "--experts N with N <= --ranks (", ranks, ")");
  }
  if (experts < args.slots_per_rank || experts > ranks * args.slots_per_rank) {
    fail("--experts ", experts, " must be in [--slots-per-rank, --ranks x --slots-per-rank] = [",
         args.slots_per_rank, ", ", ranks * args.slots_per_rank, "] with --ranks ", ranks);
  }
}

void run_bench_runtime(BenchRuntimeArgs args) {
  if (args.ranks.empty()) fail("--ranks needs at least one rank count");
  if (!args.threads && args.ranks.size() > 1) {
    fail("--ranks takes one count without --threads (got ", args.ranks.size(),
         "); a list such as 8,32,128,256 runs one after the other with --threads");
  }
  if (args.layers < 1 || args.layers > kMaxLayers) {
    fail("--layers ", args.layers, " is outside [1, ", kMaxLayers, "]");
  }
  if (args.expert_bytes < 1) fail("--expert-bytes ", args.expert_bytes, " must be at least 1");
  // Before the shape checks, which size the load windows from it.
  for (const auto& [flag, value] : {std::pair<const char*, int64_t>{"--window", args.window},
                                    {"--interval", args.interval}}) {
    if (value < 1 || value > kMaxSteps) fail(flag, " ", value, " is outside [1, ", kMaxSteps, "]");
  }
  for (const int ranks : args.ranks) check_shape(args, ranks);
  if (args.steps < 1) fail("--steps ", args.steps, " must be at least 1");
  // The runtime's own options, here rather than in each rank, where a bad one would end the
  // rank (or thread) as a failure of the run.
  check_range("--lag", args.lag, 1, runtime::kMaxLag, "steps between an agreement and its action");
  check_range("--timeout-ms", args.timeout_ms, 1, runtime::kMaxTimeout.count(),
              "milliseconds every collective waits");
  placement::parse_policy(args.policy);
  if (!(std::isfinite(args.forward_ms) && args.forward_ms >= 0 && args.forward_ms <= 60'000)) {
    fail("--forward-ms ", args.forward_ms, " must be a number in [0, 60000] (milliseconds)");
  }
  if (args.mode != "async" && args.mode != "sync" && args.mode != "both") {
    fail("--mode '", args.mode, "' is not one of async, sync, both");
  }
  if (!transport::has_backend(args.transport)) {
    fail("--transport '", args.transport, "' is not built in");
  }
  if (args.threads && args.transport != "inproc") {
    fail("--transport '", args.transport, "' does not take --threads: thread ranks share one "
         "process and read each other's weights with the inproc transport (drop --transport or "
         "pass inproc)");
  }
  if (!args.threads && args.transport == "inproc") {
    fail("--transport inproc needs --threads: it reads between threads of one process, and "
         "without --threads the ranks are processes (use shm or ucx)");
  }
  if (args.weights != "engine" && args.weights != "arena") {
    fail("--weights '", args.weights, "' is not engine (each rank allocates its weights, the "
         "runtime registers them) or arena (the runtime allocates them)");
  }
  if (args.max_delay_us < 0 || args.max_delay_us > 1'000'000) {
    fail("--max-delay-us ", args.max_delay_us, " must be in [0, 1000000] (microseconds)");
  }
  if (args.threads) {
    if (!args.verbose) spdlog::set_level(spdlog::level::warn);
    run_bench_runtime_threads(args);
    return;
  }
  args.experts = experts_for(args, args.ranks.front());
  if (!args.verbose) spdlog::set_level(spdlog::level::warn);

  std::vector<std::pair<std::string, ModeFigures>> results;
  for (const std::string mode : {"async", "sync"}) {
    if (args.mode != "both" && args.mode != mode) continue;
    results.emplace_back(mode, run_mode(args, runtime::parse_mode(mode)));
  }
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [mode, f] : results) {
    out[mode] = {{"stall_p50_ms", f.p50},
                 {"stall_p99_ms", f.p99},
                 {"stall_max_ms", f.max},
                 {"stall_total_ms", f.total_per_rebalance},
                 {"rebalances", f.rebalances}};
  }
  const bool both = results.size() == 2;
  double ratio_total = 0, ratio_max = 0;
  if (both) {
    const ModeFigures& a = results[0].second;
    const ModeFigures& s = results[1].second;
    ratio_total = s.total_per_rebalance > 0 ? a.total_per_rebalance / s.total_per_rebalance : 0;
    ratio_max = s.max > 0 ? a.max / s.max : 0;
    out["ratio_total"] = ratio_total;
    out["ratio_max"] = ratio_max;
  }
  out["weights"] = args.weights;
  if (args.json) {
    fmt::print("{}\n", out.dump());
    return;
  }
  fmt::print("runtime stall: {} ranks, {} layers x {} slots per rank, {} B per expert, {} steps "
             "of {} ms, rebalance every {} steps ({} transport, weights {})\n",
             args.ranks.front(), args.layers, args.slots_per_rank, args.expert_bytes, args.steps,
             args.forward_ms, args.interval, args.transport,
             args.weights == "engine" ? "the ranks' own, registered" : "in the runtime's arena");
  for (const auto& [mode, f] : results) {
    fmt::print("  {:5}  step_end p50 {:.3f} ms  p99 {:.3f} ms  max {:.3f} ms  |  per rebalance "
               "{:.2f} ms over {:.1f} steps, {} slots moved  ({} rebalances)\n",
               mode, f.p50, f.p99, f.max, f.total_per_rebalance, f.steps_per_rebalance,
               f.slots_per_rebalance, f.rebalances);
  }
  if (both) {
    fmt::print("  async/sync: total per rebalance {:.2f}%, largest step {:.2f}% (one layer of {} "
               "is {:.2f}%)\n",
               100 * ratio_total, 100 * ratio_max, args.layers,
               100.0 / static_cast<double>(args.layers));
  }
}

}  // namespace

void add_bench_runtime(CLI::App& bench) {
  auto args = std::make_shared<BenchRuntimeArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "runtime", "Forward-thread stall of rebalances, async against sync (forked ranks; with "
                 "--threads, 64-256 thread ranks with every invariant checked at every step)");
  // With --threads an option left out takes the default of small experts and many steps.
  struct ThreadDefault {
    CLI::Option* option;
    std::function<void()> apply;
  };
  auto defaults = std::make_shared<std::vector<ThreadDefault>>();
  const auto threads_default = [&](CLI::Option* option, std::function<void()> apply) {
    defaults->push_back({option, std::move(apply)});
  };
  threads_default(cmd->add_option("--ranks", args->ranks_text,
                                  "Ranks; with --threads a comma-separated list runs one after "
                                  "the other (threads: 8,32,128,256)")
                      ->capture_default_str(),
                  [args] { args->ranks_text = "8,32,128,256"; });
  threads_default(cmd->add_option("--layers", args->layers, "(threads: 4)")->capture_default_str(),
                  [args] { args->layers = 4; });
  threads_default(
      cmd->add_option("--slots-per-rank", args->slots_per_rank, "(threads: 2)")
          ->capture_default_str(),
      [args] { args->slots_per_rank = 2; });
  cmd->add_option("--experts", args->experts, "Logical experts (0: one redundant slot per rank)")
      ->capture_default_str();
  threads_default(
      cmd->add_option("--expert-bytes", args->expert_bytes, "(threads: 4096)")
          ->capture_default_str(),
      [args] { args->expert_bytes = 4096; });
  threads_default(cmd->add_option("--steps", args->steps, "(threads: 800)")->capture_default_str(),
                  [args] { args->steps = 800; });
  cmd->add_option("--interval", args->interval, "Steps between rebalance triggers")
      ->capture_default_str();
  cmd->add_option("--window", args->window)->capture_default_str();
  cmd->add_option("--lag", args->lag)->capture_default_str();
  threads_default(cmd->add_option("--forward-ms", args->forward_ms,
                                  "Duration of the fake forward pass (threads: 1)")
                      ->capture_default_str(),
                  [args] { args->forward_ms = 1; });
  threads_default(
      cmd->add_option("--mode", args->mode, "async, sync or both (threads: async)")
          ->capture_default_str(),
      [args] { args->mode = "async"; });
  cmd->add_option("--weights", args->weights,
                  "engine (each rank allocates its weights, the runtime registers them) or "
                  "arena (the runtime allocates them)")
      ->capture_default_str();
  threads_default(cmd->add_option("--transport", args->transport,
                                  "shm or ucx (ranks are processes); inproc with --threads")
                      ->capture_default_str(),
                  [args] { args->transport = "inproc"; });
  cmd->add_option("--policy", args->policy, "deepseek, balanced or sticky")->capture_default_str();
  cmd->add_option("--timeout-ms", args->timeout_ms)->capture_default_str();
  cmd->add_flag("--threads", args->threads,
                "Ranks are threads of this process (inproc control and transport): every "
                "invariant checked at every step, random delays");
  add_seed_option(cmd, args->seed, "--threads: seed of the random delays");
  cmd->add_option("--max-delay-us", args->max_delay_us,
                  "--threads: longest random delay (fake forward, before step_end, runtime "
                  "threads); 0: none")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->add_flag("--verbose", args->verbose, "Log every rebalance");
  cmd->callback([args, defaults] {
    if (args->threads) {
      for (const ThreadDefault& d : *defaults) {
        if (d.option->count() == 0) d.apply();
      }
    }
    args->ranks = parse_int_list("--ranks", args->ranks_text);
    run_bench_runtime(*args);
  });
}

}  // namespace eplb::cli
