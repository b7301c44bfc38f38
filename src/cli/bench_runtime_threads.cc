// `eplb bench runtime --threads`: the runtime protocol with 8 to 256 ranks as threads of this
// process (inproc control plane and transport, small experts), with every invariant of the
// protocol checked at every step on every rank and random delays everywhere a rank can be late:
// the fake forward pass, before step_end, and the runtime's own worker and control threads.
//
// Each step on each rank: record the step's load, the fake forward pass (with a random delay),
// a barrier on the bench's own communicator (standing for the all-to-alls that keep
// expert-parallel ranks in step), maybe a random delay, step_end() timed, then the checks:
//   tables   the dispatch tables route to the placement in force (every replica of every
//            expert is a slot holding it, with the right count, and every rank's static slot
//            is one of them), and a hash of the placement and the tables, compared after the
//            run with rank 0's of the same step: identical tables on every rank at every step;
//   weights  every local slot of every layer holds the bytes of the expert the placement in
//            force puts there (each expert's weights are a pattern of (layer, expert));
//   switches the steps at which each layer's placement changed, compared after the run with
//            rank 0's: every layer switched at the same step everywhere;
//   records  every rank's rebalance records agree on trigger step, end step and outcome.
// A failed check is counted, never fatal: the run goes on and reports every failure.
//
// Ownership. RunState belongs to the thread that runs the ranks; each rank thread writes only
// its own row of every per-rank array (its Ranked entry, its column of `table_hash`), and the
// main thread reads them after joining every rank thread. A rank's Rebalancer, communicators
// and transport live and die on its thread; TimedCommunicator's samples are written by the
// Rebalancer's control thread and read after shutdown() has joined it.

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/bench_runtime.h"
#include "eplb/control/communicator.h"
#include "eplb/core/clock.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/types.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/testing.h"

namespace eplb::cli {
namespace {

using Clock = std::chrono::steady_clock;

// CPU seconds this process has used, all its threads.
double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// The control plane the Rebalancer is given: the inproc communicator, with the time of every
// agreement (an all-reduce (min) of one value) measured from this rank's entry to its result,
// which is the agreement's latency as the protocol sees it (it includes waiting for the last
// rank to contribute). Called by the Rebalancer's control thread only (and at connect()).
class TimedCommunicator final : public control::Communicator {
 public:
  explicit TimedCommunicator(std::unique_ptr<control::Communicator> inner)
      : Communicator(inner->rank(), inner->size(), inner->timeout()), inner_(std::move(inner)) {}

  std::string_view backend() const override { return inner_->backend(); }
  // Read after the control thread is joined.
  const std::vector<double>& agreement_ms() const { return agreement_ms_; }

 protected:
  void do_barrier(control::Clock::time_point deadline) override { inner_->barrier(left(deadline)); }
  void do_all_reduce(std::span<std::int64_t> values, control::ReduceOp op,
                     control::Clock::time_point deadline) override {
    const auto start = Clock::now();
    inner_->all_reduce(values, op, left(deadline));
    if (values.size() == 1 && op == control::ReduceOp::kMin) {
      agreement_ms_.push_back(ms_since(start));
    }
  }
  void do_broadcast(control::Bytes& data, int root, control::Clock::time_point deadline) override {
    inner_->broadcast(data, root, left(deadline));
  }
  std::vector<control::Bytes> do_all_gather(std::span<const std::byte> data,
                                            control::Clock::time_point deadline) override {
    return inner_->all_gather(data, left(deadline));
  }

 private:
  static std::chrono::milliseconds left(control::Clock::time_point deadline) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - control::Clock::now());
    return std::max(ms, std::chrono::milliseconds(1));
  }

  std::unique_ptr<control::Communicator> inner_;
  std::vector<double> agreement_ms_;
};

// Word i of the weights of (layer, expert), what the slot holding that expert must contain:
// a start drawn from (layer, expert), then a step per word, so that another expert's bytes
// differ at every word and a copy that stopped short or landed at an offset shows.
uint64_t pattern_start(int64_t layer, int32_t expert) {
  return mix64(static_cast<uint64_t>(layer) << 32 | static_cast<uint32_t>(expert));
}
constexpr uint64_t kPatternStep = 0x9E3779B97F4A7C15ull;

void fill_pattern(std::span<std::byte> bytes, int64_t layer, int32_t expert) {
  const uint64_t start = pattern_start(layer, expert);
  for (size_t i = 0; i < bytes.size(); i += 8) {
    const uint64_t w = start + (i / 8) * kPatternStep;
    std::memcpy(bytes.data() + i, &w, std::min<size_t>(8, bytes.size() - i));
  }
}

// Whether `bytes` hold (layer, expert)'s pattern: every word up to 64 KiB, beyond that 8192
// words spread over the slot, its last word included.
bool holds_pattern(std::span<const std::byte> bytes, int64_t layer, int32_t expert) {
  const uint64_t start = pattern_start(layer, expert);
  const size_t words = (bytes.size() + 7) / 8;
  const auto holds = [&](size_t i) {
    const uint64_t w = start + i * kPatternStep;
    if (8 * i + 8 <= bytes.size()) {
      uint64_t got = 0;
      std::memcpy(&got, bytes.data() + 8 * i, 8);
      return got == w;
    }
    return std::memcmp(bytes.data() + 8 * i, &w, bytes.size() - 8 * i) == 0;
  };
  const size_t step = std::max<size_t>(1, words / 8192);
  bool ok = true;
  for (size_t i = 0; i < words; i += step) ok &= holds(i);
  return ok && holds(words - 1);
}

// The hash of a table's bytes, folded into `h`.
template <typename T>
uint64_t hash_into(uint64_t h, const std::vector<T>& v) {
  const std::string_view bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  return mix64(h ^ std::hash<std::string_view>{}(bytes)) + v.size();
}

struct Failures {
  int64_t tables = 0, weights = 0, switches = 0, records = 0;
  int64_t total() const { return tables + weights + switches + records; }
};

// What one rank thread leaves for the main thread.
struct Ranked {
  std::vector<double> stall_ms;   // [steps] time inside step_end
  std::vector<char> rebalancing;  // [steps] a rebalance was open at that step_end
  std::vector<std::pair<int64_t, int64_t>> switches;  // (step, layer) placement changes
  std::vector<runtime::RebalanceRecord> history;
  std::vector<double> agreement_ms;
  Failures failures;  // tables (consistency) and weights, found on this rank
  int64_t checks = 0;
  int64_t host_bytes = 0, bytes_held = 0;
  std::string error;  // why the rank stopped early, empty when it ran to the end
};

struct RunState {
  const BenchRuntimeArgs& args;
  int ranks;
  int64_t experts;
  runtime::Mode mode;
  std::string rendezvous;
  std::vector<uint64_t> table_hash;  // [steps + 1][ranks], column r written by rank r only
  std::vector<Ranked> ranked;        // [ranks]
};

// A layer's tables, the costly part hashed again only when they may have changed.
struct LayerCheck {
  std::vector<int32_t> phy2log;  // [physical] at the last step
  std::vector<int32_t> holders;  // [experts] scratch: slots holding each expert
  const void* static_slot = nullptr;
  uint64_t static_hash = 0;
};

// The checks of one rank after one step_end; `step` is rb.step().
void check_step(RunState& run, runtime::Rebalancer& rb, std::vector<LayerCheck>& layers, Ranked& me,
                int64_t step) {
  const BenchRuntimeArgs& args = run.args;
  const int rank = rb.rank();
  const int64_t spr = args.slots_per_rank;
  uint64_t h = 0;
  for (int64_t l = 0; l < args.layers; ++l) {
    LayerCheck& c = layers[static_cast<size_t>(l)];
    const std::span<const int32_t> p = rb.phy2log(l);
    const routing::DispatchTables& t = rb.dispatch(l);
    const bool changed = !std::equal(p.begin(), p.end(), c.phy2log.begin(), c.phy2log.end());
    if (changed) {
      if (step > 0) me.switches.emplace_back(step, l);
      c.phy2log.assign(p.begin(), p.end());
    }
    // The tables route to this placement. The [ranks][experts] static slots are checked and
    // hashed again only when the placement or the tables' storage changed (installs replace
    // both); the rest is checked at every step.
    bool ok = t.experts == run.experts &&
              static_cast<int64_t>(t.replica_count.size()) == run.experts &&
              static_cast<int64_t>(t.log2phy.size()) == run.experts * t.max_replicas;
    std::vector<int32_t>& holders = c.holders;
    holders.assign(static_cast<size_t>(run.experts), 0);
    for (const int32_t e : p) {
      if (e >= 0 && e < run.experts) ++holders[static_cast<size_t>(e)];
    }
    for (int64_t e = 0; ok && e < run.experts; ++e) {
      ok = t.replica_count[e] == holders[e] && t.replica_count[e] <= t.max_replicas;
      if (!ok) break;
      for (const int32_t slot : t.replicas(e)) {
        ok = ok && slot >= 0 && slot < static_cast<int64_t>(p.size()) && p[slot] == e;
      }
    }
    if (changed || c.static_slot != t.static_slot.data()) {
      c.static_slot = t.static_slot.data();
      c.static_hash = hash_into(hash_into(0, t.static_slot), t.cumulative_share);
      ok = ok && static_cast<int64_t>(t.static_slot.size()) == run.ranks * run.experts;
      for (size_t i = 0; ok && i < t.static_slot.size(); ++i) {
        const int32_t slot = t.static_slot[i];
        ok = slot >= 0 && slot < static_cast<int64_t>(p.size()) &&
             p[slot] == static_cast<int32_t>(i % static_cast<size_t>(run.experts));
      }
    }
    if (!ok) ++me.failures.tables;
    h = hash_into(hash_into(hash_into(h, c.phy2log), t.log2phy), t.replica_count);
    h = mix64(h ^ c.static_hash);
    // Every local slot holds the expert the placement in force puts there.
    for (int64_t j = 0; j < spr; ++j) {
      const int32_t e = p[static_cast<size_t>(rank * spr + j)];
      if (!holds_pattern(rb.slot_weights(l, 0, j), l, e)) ++me.failures.weights;
    }
    me.checks += 1 + spr;
  }
  run.table_hash[static_cast<size_t>(step) * run.ranks + rank] = h;
}

// A delay of up to max_us, or none, drawn from (seed, rank, where, n).
std::chrono::microseconds draw_delay(uint64_t seed, int rank, uint64_t where, uint64_t n,
                                     int64_t max_us) {
  if (max_us == 0) return {};
  const uint64_t r = mix64(mix64(seed ^ mix64(static_cast<uint64_t>(rank) * 16 + where)) + n);
  return std::chrono::microseconds(static_cast<int64_t>((r >> 8) % (max_us + 1)));
}

void run_rank(RunState& run, int rank) {
  const BenchRuntimeArgs& args = run.args;
  Ranked& me = run.ranked[static_cast<size_t>(rank)];
  control::Options options;
  options.rank = rank;
  options.size = run.ranks;
  options.rendezvous = run.rendezvous;
  options.timeout = std::chrono::milliseconds(args.timeout_ms);
  TimedCommunicator comm(control::connect("inproc", options));
  options.group = "forward";
  std::unique_ptr<control::Communicator> lockstep = control::connect("inproc", options);
  std::unique_ptr<transport::Transport> transport =
      transport::create("inproc", transport::Options{.rank = rank});

  runtime::Config config;
  config.layout = Layout{.experts = run.experts,
                         .physical = run.ranks * args.slots_per_rank,
                         .ranks = run.ranks,
                         .nodes = 1,
                         .groups = 1};
  config.interval = args.interval;
  config.window = args.window;
  config.lag = args.lag;
  config.mode = run.mode;
  config.placement.policy = placement::parse_policy(args.policy);
  config.min_balancedness_gain = -1;  // forced: every trigger rebalances
  config.timeout = std::chrono::milliseconds(args.timeout_ms);
  config.balancedness_period = -1;  // not measured here: one collective less per interval
  // The runtime's own threads are late at random too; each point draws from its own sequence.
  struct Drawn {
    std::atomic<uint64_t> at[4] = {};  // [DelayPoint]
  };
  auto drawn = std::make_shared<Drawn>();
  const auto delays = [drawn, seed = args.seed, rank,
                       max_us = args.max_delay_us](runtime::DelayPoint point) {
    const auto where = static_cast<uint64_t>(point);
    const uint64_t n = drawn->at[where].fetch_add(1, std::memory_order_relaxed);
    const auto delay = draw_delay(seed, rank, 8 + where, n, max_us);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
  };
  std::vector<std::vector<std::byte>> own;  // --weights engine: [layers], this rank's slots
  const runtime::WeightSpec spec = weight_spec(args, own);
  runtime::Rebalancer rb(config, comm, *transport, spec,
                         trivial_placement(args.layers, run.experts, config.layout.physical));
  runtime::RebalancerTesting::set_delay_hook(rb, delays);
  me.bytes_held = rb.connect();
  runtime::fill_weights(rb, [](int64_t l, int64_t, int32_t e, std::span<std::byte> bytes) {
    fill_pattern(bytes, l, e);
  });
  std::vector<LayerCheck> layers(static_cast<size_t>(args.layers));
  check_step(run, rb, layers, me, 0);

  me.stall_ms.reserve(static_cast<size_t>(args.steps));
  me.rebalancing.reserve(static_cast<size_t>(args.steps));
  const auto forward = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(args.forward_ms));
  int64_t phase = 0;
  for (int64_t step = 0; step < args.steps; ++step) {
    record_load(rb, args.layers, run.experts, phase);
    const auto n = static_cast<uint64_t>(step);
    std::this_thread::sleep_for(forward + draw_delay(args.seed, rank, 0, n, args.max_delay_us));
    lockstep->barrier();
    // One step in four, this rank comes to step_end late.
    if (draw_delay(args.seed, rank, 1, n, 3).count() == 0) {
      std::this_thread::sleep_for(draw_delay(args.seed, rank, 2, n, args.max_delay_us));
    }
    const bool before = rb.rebalancing();
    const auto start = Clock::now();
    rb.step_end();
    me.stall_ms.push_back(ms_since(start));
    // A step of a rebalance: one was open before or after it, or it was a trigger step (sync
    // mode runs a whole rebalance inside that one step_end).
    const bool rebalancing = before || rb.rebalancing() || rb.step() % args.interval == 0;
    me.rebalancing.push_back(rebalancing ? 1 : 0);
    check_step(run, rb, layers, me, rb.step());
    // The load flips after every rebalance that ended: at the same step on every rank.
    if (rebalancing && !rb.rebalancing()) phase = static_cast<int64_t>(rb.history().size());
  }
  me.host_bytes = rb.host_bytes();
  rb.shutdown();
  me.history = rb.history();
  me.agreement_ms = comm.agreement_ms();
}

struct RunFigures {
  int ranks = 0;
  std::string mode;
  double seconds = 0;
  double cpu_seconds = 0;   // of the whole process: every rank shares this machine's cores
  double step_ms = 0;       // wall time per step
  double placement_ms = 0;  // mean of the completed records', every rank
  double p50 = 0, p99 = 0, all_p50 = 0, all_p99 = 0, max = 0;
  double agreement_p50 = 0, agreement_p99 = 0, agreement_max = 0;
  int64_t agreements = 0;
  int64_t completed = 0, failed = 0, skipped = 0;
  double stall_per_rebalance = 0, steps_per_rebalance = 0;
  Failures failures;
  int64_t checks = 0;
  int64_t host_bytes = 0, bytes_held = 0, window_bytes = 0;
};

// Count of entries in one sorted list and not the other.
template <typename T>
int64_t differences(const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<T> out;
  std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return static_cast<int64_t>(out.size());
}

RunFigures run_threads(const BenchRuntimeArgs& args, int ranks, runtime::Mode mode, int index) {
  RunState run{.args = args,
               .ranks = ranks,
               .experts = experts_for(args, ranks),
               .mode = mode,
               .rendezvous = fmt::format("eplb-bench-runtime-threads-{}", index),
               .table_hash = std::vector<uint64_t>(static_cast<size_t>(args.steps + 1) * ranks),
               .ranked = std::vector<Ranked>(static_cast<size_t>(ranks))};
  const auto start = Clock::now();
  const double cpu_start = cpu_seconds();
  {
    std::vector<std::jthread> threads;
    threads.reserve(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&run, r] {
        try {
          run_rank(run, r);
        } catch (const std::exception& e) {
          run.ranked[static_cast<size_t>(r)].error = e.what();
        }
      });
    }
  }
  RunFigures f;
  f.ranks = ranks;
  f.mode = std::string(runtime::mode_name(mode));
  f.seconds = ms_since(start) / 1000.0;
  f.cpu_seconds = cpu_seconds() - cpu_start;
  f.step_ms = f.seconds * 1000.0 / static_cast<double>(args.steps);
  for (int r = 0; r < ranks; ++r) {
    const std::string& error = run.ranked[static_cast<size_t>(r)].error;
    if (!error.empty())
      fail<IoError>("bench runtime --threads: rank ", r, " of ", ranks, ": ", error);
  }

  // Across ranks, against rank 0: the tables at every step, the switch steps, the records.
  const Ranked& first = run.ranked.front();
  std::vector<double> rebalancing_ms, all_ms, agreement_ms;
  int64_t placements = 0;
  for (int r = 0; r < ranks; ++r) {
    const Ranked& me = run.ranked[static_cast<size_t>(r)];
    f.failures.tables += me.failures.tables;
    f.failures.weights += me.failures.weights;
    f.checks += me.checks;
    for (int64_t s = 0; s <= args.steps; ++s) {
      const size_t row = static_cast<size_t>(s) * ranks;
      if (run.table_hash[row + r] != run.table_hash[row]) ++f.failures.tables;
    }
    f.failures.switches += differences(me.switches, first.switches);
    const auto key = [](const std::vector<runtime::RebalanceRecord>& h) {
      std::vector<std::tuple<int64_t, int64_t, int64_t, int>> keys;
      for (const auto& x : h) {
        keys.emplace_back(x.index, x.trigger_step, x.end_step, static_cast<int>(x.outcome));
      }
      return keys;
    };
    f.failures.records += differences(key(me.history), key(first.history));
    f.checks += args.steps + 1 + 2;
    for (size_t s = 0; s < me.stall_ms.size(); ++s) {
      all_ms.push_back(me.stall_ms[s]);
      if (me.rebalancing[s]) rebalancing_ms.push_back(me.stall_ms[s]);
    }
    agreement_ms.insert(agreement_ms.end(), me.agreement_ms.begin(), me.agreement_ms.end());
    for (const runtime::RebalanceRecord& x : me.history) {
      if (x.outcome != runtime::Outcome::kCompleted) continue;
      f.placement_ms += x.placement_ms;
      ++placements;
    }
    f.host_bytes = std::max(f.host_bytes, me.host_bytes);
    f.bytes_held = std::max(f.bytes_held, me.bytes_held);
  }
  if (placements > 0) f.placement_ms /= static_cast<double>(placements);
  f.p50 = percentile(rebalancing_ms, 0.50);
  f.p99 = percentile(rebalancing_ms, 0.99);
  f.all_p50 = percentile(all_ms, 0.50);
  f.all_p99 = percentile(all_ms, 0.99);
  f.max = all_ms.empty() ? 0 : *std::max_element(all_ms.begin(), all_ms.end());
  f.agreement_p50 = percentile(agreement_ms, 0.50);
  f.agreement_p99 = percentile(agreement_ms, 0.99);
  f.agreement_max =
      agreement_ms.empty() ? 0 : *std::max_element(agreement_ms.begin(), agreement_ms.end());
  f.agreements = static_cast<int64_t>(agreement_ms.size());
  double stall = 0, steps = 0;
  for (const runtime::RebalanceRecord& x : first.history) {
    if (x.outcome == runtime::Outcome::kCompleted) {
      ++f.completed;
      stall += x.stall_total_ms;
      steps += static_cast<double>(x.steps);
    } else if (x.outcome == runtime::Outcome::kFailed) {
      ++f.failed;
    } else if (x.outcome == runtime::Outcome::kSkipped) {
      ++f.skipped;
    }
  }
  if (f.completed > 0) {
    f.stall_per_rebalance = stall / static_cast<double>(f.completed);
    f.steps_per_rebalance = steps / static_cast<double>(f.completed);
  }
  f.window_bytes =
      stats::LoadRecorder::bytes_for(args.layers, run.experts, std::max<int64_t>(args.window, 1));
  return f;
}

nlohmann::json to_json(const BenchRuntimeArgs& args, const RunFigures& f) {
  return {{"ranks", f.ranks},
          {"threads", true},
          {"mode", f.mode},
          {"layers", args.layers},
          {"slots_per_rank", args.slots_per_rank},
          {"experts", experts_for(args, f.ranks)},
          {"expert_bytes", args.expert_bytes},
          {"steps", args.steps},
          {"seconds", f.seconds},
          {"cpu_seconds", f.cpu_seconds},
          {"step_ms", f.step_ms},
          {"placement_ms", f.placement_ms},
          {"rebalances_completed", f.completed},
          {"rebalances_failed", f.failed},
          {"rebalances_skipped", f.skipped},
          {"steps_per_rebalance", f.steps_per_rebalance},
          {"stall_per_rebalance_ms", f.stall_per_rebalance},
          {"invariant_failures", f.failures.total()},
          {"invariant_failures_by_check",
           {{"tables", f.failures.tables},
            {"weights", f.failures.weights},
            {"switches", f.failures.switches},
            {"records", f.failures.records}}},
          {"invariant_checks", f.checks},
          {"step_end_p50_ms", f.p50},
          {"step_end_p99_ms", f.p99},
          {"step_end_all_p50_ms", f.all_p50},
          {"step_end_all_p99_ms", f.all_p99},
          {"step_end_max_ms", f.max},
          {"agreement_p50_ms", f.agreement_p50},
          {"agreement_p99_ms", f.agreement_p99},
          {"agreement_max_ms", f.agreement_max},
          {"agreements", f.agreements},
          {"host_bytes_per_rank", f.host_bytes},
          {"host_bytes",
           {{"weights", f.bytes_held},
            {"window", f.window_bytes},
            {"tables", f.host_bytes - f.bytes_held - f.window_bytes}}}};
}

}  // namespace

void run_bench_runtime_threads(const BenchRuntimeArgs& args) {
  std::vector<RunFigures> runs;
  int index = 0;
  for (const int ranks : args.ranks) {
    for (const std::string mode : {"async", "sync"}) {
      if (args.mode != "both" && args.mode != mode) continue;
      runs.push_back(run_threads(args, ranks, runtime::parse_mode(mode), index++));
    }
  }
  Failures all;
  for (const RunFigures& f : runs) {
    all.tables += f.failures.tables;
    all.weights += f.failures.weights;
    all.switches += f.failures.switches;
    all.records += f.failures.records;
  }
  const int64_t failures = all.total();
  if (args.json) {
    nlohmann::json out;
    if (runs.size() == 1) {
      out = to_json(args, runs.front());
    } else {
      out["runs"] = nlohmann::json::array();
      for (const RunFigures& f : runs) out["runs"].push_back(to_json(args, f));
      if (args.ranks.size() == 1) out["ranks"] = args.ranks.front();
      out["invariant_failures"] = failures;
    }
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print(
        "runtime protocol, ranks as threads: {} layers x {} slots per rank, {} B per "
        "expert, {} steps of {} ms + up to {} us of random delay, rebalance every {} "
        "steps, lag {} (inproc control and transport, weights {})\n",
        args.layers, args.slots_per_rank, args.expert_bytes, args.steps, args.forward_ms,
        args.max_delay_us, args.interval, args.lag,
        args.weights == "engine" ? "the ranks' own, registered" : "in the runtime's arena");
    fmt::print("  {:>5} {:5} {:>10} {:>9}  {:>23}  {:>9}  {:>19}  {:>8}  {:>11}  {:>7}\n", "ranks",
               "mode", "rebalances", "failures", "step_end p50/p99 (reb.)", "all p99",
               "agreement p50/p99", "step", "host B/rank", "seconds");
    for (const RunFigures& f : runs) {
      fmt::print(
          "  {:>5} {:5} {:>10} {:>9}  {:>11.3f}/{:>8.3f} ms  {:>6.3f} ms  {:>7.3f}/{:>7.3f} ms"
          "  {:>5.2f} ms  {:>11}  {:>7.1f}\n",
          f.ranks, f.mode, f.completed, f.failures.total(), f.p50, f.p99, f.all_p99,
          f.agreement_p50, f.agreement_p99, f.step_ms, f.host_bytes, f.seconds);
    }
    fmt::print(
        "  failures: invariant checks failed (tables, weights, switch steps, records); "
        "agreement: from a rank's contribution to its result\n");
  }
  if (failures > 0) {
    fail<IoError>("bench runtime --threads: ", failures, " invariant check(s) failed: ", all.tables,
                  " tables, ", all.weights, " weights, ", all.switches, " switch steps, ",
                  all.records, " records");
  }
  for (const RunFigures& f : runs) {
    if (f.failed > 0) {
      fail<IoError>("bench runtime --threads: ", f.failed, " rebalance(s) failed with ", f.ranks,
                    " ranks (run with --verbose for the runtime's log)");
    }
  }
}

}  // namespace eplb::cli
