#include "eplb/emu/emulator.h"

#include <fmt/core.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "emu/live_metrics.h"
#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/metrics.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"

namespace eplb::emu {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// This thread's CPU time in ms: what the expert compute costs, whatever the scheduler does with
// more rank processes than cores (wall time then mostly measures the waiting).
double thread_cpu_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Whether the outputs of global token `token` at `step` are verified this step.
bool verified_token(int64_t verify_every, int64_t step, int64_t token) {
  if (verify_every <= 1) return true;
  const uint64_t h = mix64((static_cast<uint64_t>(step) << 32) ^ static_cast<uint64_t>(token) ^
                           0x3C6EF372FE94F82Bull);
  return h % static_cast<uint64_t>(verify_every) == 0;
}

int64_t physical_of(const RunOptions& options, const Workload& workload) {
  return workload.experts + options.redundant_slots();
}

runtime::Config make_config(const RunOptions& options, const Workload& workload) {
  runtime::Config config;
  config.layout = Layout{.experts = workload.experts,
                         .physical = physical_of(options, workload),
                         .ranks = options.ranks,
                         .nodes = options.nodes,
                         .groups = 1};
  const bool off = options.mode == "off";
  // EPLB off: the same workers and the same runtime, with a trigger that never comes.
  config.interval = off ? options.steps + 1 : options.interval;
  config.window = options.window;
  config.policy = placement::parse_policy(options.policy);
  config.mode = off ? runtime::Mode::kAsync : runtime::parse_mode(options.mode);
  config.lag = options.lag;
  config.dispatch = routing::parse_dispatch_policy(options.dispatch);
  config.timeout = std::chrono::milliseconds(options.timeout_ms);
  // The recorded window's balancedness every interval, with EPLB off too; the mode tells the
  // runs of --compare apart in one exposition.
  config.balancedness_period = std::max<int64_t>(options.interval, 1);
  config.metric_labels = {{"mode", options.mode}};
  config.registry = options.registry;
  return config;
}

// A verification waiting for its reference: the output computed from the slot's weights.
struct Pending {
  int32_t expert = 0;
  int64_t token = 0;
  size_t output = 0;  // offset in the outputs buffer
};

}  // namespace

void RunOptions::validate(const Workload& workload) const {
  if (ranks < 1 || ranks > kMaxRanks) fail("--ranks ", ranks, " is outside [1, ", kMaxRanks, "]");
  if (redundant < -1) {
    fail("--redundant ", redundant, " must not be negative (-1 means one per rank)");
  }
  if (redundant > kMaxPhysical - workload.experts) {
    fail("--redundant ", redundant, " gives more than ", kMaxPhysical,
         " physical slots per layer, the most eplb supports");
  }
  if (nodes < 1 || ranks % nodes != 0) {
    fail("--nodes ", nodes, " must divide --ranks ", ranks, " (every node has as many ranks)");
  }
  if (tokens_per_rank < 1) fail("--tokens-per-rank ", tokens_per_rank, " must be at least 1");
  if (metrics_port < 0 || metrics_port > 65535) {
    fail("--metrics-port ", metrics_port, " is not a port (1 to 65535, or 0: none)");
  }
  shape.validate();
  if (steps < 1) fail("--steps ", steps, " must be at least 1");
  if (steps > kMaxSteps) fail("--steps ", steps, " is outside [1, ", kMaxSteps, "]");
  if (interval < 1) fail("--interval ", interval, " must be at least 1");
  if (window < 1) fail("--window ", window, " must be at least 1");
  if (interval > kMaxSteps) fail("--interval ", interval, " is outside [1, ", kMaxSteps, "]");
  if (window > kMaxSteps) fail("--window ", window, " is outside [1, ", kMaxSteps, "]");
  if (lag < 1 || lag > runtime::kMaxLag) {
    fail("--lag ", lag, " is outside [1, ", runtime::kMaxLag, "] steps");
  }
  if (verify_every < 1) fail("--verify-every ", verify_every, " must be at least 1");
  if (timeout_ms < 1) fail("--timeout-ms ", timeout_ms, " must be at least 1");
  if (mode != "async" && mode != "sync" && mode != "off") {
    fail("--mode '", mode, "' is not one of async, sync, off");
  }
  placement::parse_policy(policy);
  routing::parse_dispatch_policy(dispatch);
  const int64_t physical = workload.experts + redundant_slots();
  if (physical % ranks != 0) {
    fail("--redundant ", redundant_slots(), " gives ", physical, " physical slots (",
         workload.experts, " experts + redundant), not a multiple of --ranks ", ranks,
         " (physical slots must divide evenly)");
  }
  if (physical < ranks) {
    fail("--ranks ", ranks, " is more than the ", physical,
         " physical slots (experts + --redundant): every rank needs a slot");
  }
  if (weights != "engine" && weights != "arena") {
    fail("--weights '", weights,
         "' is not engine (each rank allocates its experts and eplb "
         "registers them) or arena (eplb allocates them)");
  }
  if (transport != "auto" && !transport::has_backend(transport)) {
    fail("--transport '", transport, "' is not built in");
  }
  if (transport == "auto" && nodes > 1 && !transport::has_backend("hybrid")) {
    fail("--nodes ", nodes,
         " needs the hybrid transport (shm within a node, UCX across), "
         "which this build lacks: it needs UCX (use --nodes 1)");
  }
  make_config(*this, workload).validate();
  check_window_fits(workload, 1);
}

void RunOptions::check_window_fits(const Workload& workload, int64_t local_ranks) const {
  // Every rank records a window of loads: what the ranks of this machine will hold together,
  // checked before any starts (each rank's recorder checks its own share again).
  const int64_t window_bytes =
      stats::LoadRecorder::bytes_for(workload.layers, workload.experts, window);
  check_fits_in_memory(
      checked_mul(window_bytes, local_ranks, "the load windows of this machine's ranks"),
      detail::concat("--window ", window, " (", local_ranks, local_ranks == 1 ? " rank" : " ranks",
                     " here, each keeping ", window, " steps x ", workload.layers, " layers x ",
                     workload.experts, " experts of counts)"),
      "lower --window");
}

std::string run_rank(const RunOptions& options, const Workload& workload,
                     control::Communicator& communicator, control::Communicator& lockstep,
                     transport::Transport& transport, const std::atomic<int>* stop) {
  const int me = communicator.rank();
  const int64_t G = options.ranks;
  const int64_t T = options.tokens_per_rank;
  const int64_t L = workload.layers;
  const int64_t k = workload.top_k;
  const ExpertShape& shape = options.shape;
  const runtime::Config config = make_config(options, workload);
  const int64_t spr = config.layout.slots_per_rank();
  const routing::DispatchPolicy dispatch = config.dispatch;

  runtime::WeightSpec spec{
      .layers = L, .tensors = {{"gate_up", shape.gate_up_bytes()}, {"down", shape.down_bytes()}}};
  // --weights engine: this rank allocates its experts itself, per layer and tensor,
  // expert-major, as an engine does at model load, and registers them; they never move.
  std::vector<std::vector<float>> own;  // [layers][tensors]
  if (options.weights == "engine") {
    for (int64_t l = 0; l < L; ++l) {
      for (const int64_t floats : {shape.gate_up_floats(), shape.down_floats()}) {
        own.emplace_back(static_cast<size_t>(spr * floats));
        spec.engine.push_back({.base = own.back().data(), .stride = 0});
      }
    }
  }
  runtime::Rebalancer rb(config, communicator, transport, spec,
                         trivial_placement(L, workload.experts, config.layout.physical));
  const int64_t bytes_held = rb.connect();
  // --metrics-port: a forked rank's families go to the launcher through a file; a launched
  // rank serves its own.
  std::optional<SnapshotWriter> snapshots;
  if (!options.live_metrics_dir.empty()) {
    snapshots.emplace(snapshot_path(options.live_metrics_dir, me), std::chrono::milliseconds(500));
  }

  runtime::fill_weights(
      rb, [&](int64_t layer, int64_t tensor, int32_t expert, std::span<std::byte> bytes) {
        generate_weights_bytes(shape, layer, expert, static_cast<Tensor>(tensor), bytes);
      });

  // Every rank replays every sender's replica choice, so each sender has its random stream here.
  std::vector<uint64_t> random_state(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) random_state[g] = mix64(options.seed * 1000003 + g) | 1;

  std::vector<int32_t> experts(static_cast<size_t>(G * T * k));  // every sender's, this layer
  const bool adaptive = dispatch == routing::DispatchPolicy::kAdaptive;
  std::vector<int64_t> global_counts(static_cast<size_t>(workload.experts));
  std::vector<int64_t> prefix(static_cast<size_t>(workload.experts));
  routing::AdaptiveShares shares;
  std::vector<int32_t> slots(static_cast<size_t>(G * T * k));
  std::vector<int64_t> rank_load(static_cast<size_t>(G));
  std::vector<float> x(static_cast<size_t>(shape.hidden));
  std::vector<float> scratch(static_cast<size_t>(2 * shape.intermediate));
  std::vector<float> y(static_cast<size_t>(shape.hidden));
  std::vector<float> reference_y(static_cast<size_t>(shape.hidden));
  std::vector<float> reference_gate_up(static_cast<size_t>(shape.gate_up_floats()));
  std::vector<float> reference_down(static_cast<size_t>(shape.down_floats()));
  std::vector<float> outputs;  // the outputs to verify, this layer
  std::vector<Pending> pending;
  struct Received {
    int64_t local;  // the slot on this rank
    int64_t entry;  // (sender, token, k) flattened
  };
  std::vector<Received> received;  // this layer's entries for this rank's slots
  std::vector<int64_t> step_max(static_cast<size_t>(1 + 2 * L));

  std::vector<double> moe_ms, moe_wall_ms, stall_ms, balancedness;
  std::vector<int64_t> installs;
  int64_t mismatches = 0, verified = 0, computed = 0;
  std::string first_mismatch;
  bool interrupted = false;
  const bool progress = options.progress && me == 0;

  int64_t step = 0;
  for (; step < options.steps; ++step) {
    // This thread's CPU time in each layer's expert compute, and the wall time it took, in ns:
    // [0] the stop flag, then [1 + l] CPU and [1 + L + l] wall, maxed over the ranks below.
    std::fill(step_max.begin(), step_max.end(), 0);
    double sum_mean = 0, sum_max = 0;
    for (int64_t l = 0; l < L; ++l) {
      // Step 1: route every sender's tokens through this layer's tables, as each sender would.
      // Adaptive dispatch first needs the step's global count of every expert (what an engine
      // has after its all-to-all's layout exchange): every rank computes the same shares from
      // it, and each sender's tokens follow those of the lower ranks (`prefix`).
      const routing::DispatchTables& tables = rb.dispatch(l);
      std::fill(rank_load.begin(), rank_load.end(), 0);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t first = (step * G + g) * T;
        for (int64_t t = 0; t < T; ++t) {
          const auto e = workload.experts_of(l, first + t);
          std::copy(e.begin(), e.end(), experts.begin() + (g * T + t) * k);
        }
      }
      if (adaptive) {
        std::fill(global_counts.begin(), global_counts.end(), 0);
        routing::count_experts(experts, workload.experts, global_counts);
        routing::adaptive_shares(tables, global_counts, shares);
        std::fill(prefix.begin(), prefix.end(), 0);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t first = (step * G + g) * T;
        std::span<const int32_t> in{experts.data() + g * T * k, static_cast<size_t>(T * k)};
        std::span<int32_t> out{slots.data() + g * T * k, static_cast<size_t>(T * k)};
        if (adaptive) {
          routing::route_adaptive(tables, shares, prefix, in, k, out);
          routing::count_experts(in, workload.experts, prefix);
        } else {
          routing::route(tables, dispatch, in, k, out, static_cast<uint64_t>(first), g,
                         random_state[g]);
        }
        if (g == me) rb.record(l, in);
        for (const int32_t s : out) ++rank_load[s / spr];
      }
      const int64_t max_load = *std::max_element(rank_load.begin(), rank_load.end());
      sum_mean += static_cast<double>(T * k);  // G*T*k assignments over G ranks
      sum_max += static_cast<double>(max_load);

      // Step 2: compute the expert outputs of every (token, expert) this rank's slots received,
      // slot by slot as a grouped expert kernel does (each slot's weights are read once per
      // step, not once per token), so that the time follows the tokens a rank computes.
      const auto* gate_up = reinterpret_cast<const float*>(rb.weights(l, 0).data());
      const auto* down = reinterpret_cast<const float*>(rb.weights(l, 1).data());
      outputs.clear();
      pending.clear();
      received.clear();
      for (int64_t i = 0; i < G * T * k; ++i) {
        if (slots[i] / spr == me) received.push_back({slots[i] % spr, i});
      }
      std::stable_sort(received.begin(), received.end(),
                       [](const Received& a, const Received& b) { return a.local < b.local; });
      const auto start = Clock::now();
      const double cpu_start = thread_cpu_ms();
      for (const Received& r : received) {
        const int64_t g = r.entry / (T * k), t = (r.entry / k) % T, j = r.entry % k;
        const int64_t token = (step * G + g) * T + t;
        generate_activation(shape.hidden, step, token, l, x);
        expert_forward(shape, gate_up + r.local * shape.gate_up_floats(),
                       down + r.local * shape.down_floats(), x.data(), scratch.data(), y.data());
        ++computed;
        if (verified_token(options.verify_every, step, token)) {
          pending.push_back({workload.experts_of(l, token)[j], token, outputs.size()});
          outputs.insert(outputs.end(), y.begin(), y.end());
        }
      }
      step_max[1 + l] = std::llround((thread_cpu_ms() - cpu_start) * 1e6);
      step_max[1 + L + l] = std::llround(ms_since(start) * 1e6);

      // Step 3: check the sampled outputs against the logical expert the token chose, from
      // reference weights generated afresh (once per expert).
      std::sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
        return a.expert != b.expert ? a.expert < b.expert : a.output < b.output;
      });
      int32_t generated = -1;
      for (const Pending& p : pending) {
        if (p.expert != generated) {
          generate_weights(shape, l, p.expert, Tensor::kGateUp, reference_gate_up);
          generate_weights(shape, l, p.expert, Tensor::kDown, reference_down);
          generated = p.expert;
        }
        generate_activation(shape.hidden, step, p.token, l, x);
        expert_forward(shape, reference_gate_up.data(), reference_down.data(), x.data(),
                       scratch.data(), reference_y.data());
        ++verified;
        if (std::memcmp(reference_y.data(), outputs.data() + p.output,
                        reference_y.size() * sizeof(float)) != 0) {
          if (mismatches == 0) {
            first_mismatch = fmt::format("step {} layer {} token {} expert {} on rank {}", step, l,
                                         p.token, p.expert, me);
          }
          ++mismatches;
        }
      }
    }
    balancedness.push_back(sum_max > 0 ? sum_mean / sum_max : 1.0);

    // Step 4: the all-to-alls that keep expert-parallel ranks in step, carrying the stop flag
    // so that every rank stops at the same step, and each layer's compute times: every layer
    // waits for its busiest rank, so a step's MoE time is the sum over the layers of the
    // slowest rank's time in each (what the balancedness measures, in time).
    step_max[0] = stop != nullptr && stop->load() != 0 ? 1 : 0;
    lockstep.all_reduce(step_max, control::ReduceOp::kMax);
    double cpu_ns = 0, wall_ns = 0;
    for (int64_t l = 0; l < L; ++l) {
      cpu_ns += static_cast<double>(step_max[1 + l]);
      wall_ns += static_cast<double>(step_max[1 + L + l]);
    }
    moe_ms.push_back(cpu_ns / 1e6);
    moe_wall_ms.push_back(wall_ns / 1e6);

    const int64_t installed = rb.installed_layers();
    const auto start = Clock::now();
    rb.step_end();
    stall_ms.push_back(ms_since(start));
    installs.push_back(rb.installed_layers() - installed);
    if (snapshots) snapshots->maybe_write(rb);
    if (progress) {
      fmt::print("\r  step {}/{}  rebalances {}  balancedness {:.3f}", step + 1, options.steps,
                 rb.history().size(), balancedness.back());
      std::fflush(stdout);
    }
    if (step_max[0] != 0) {
      interrupted = true;
      ++step;
      break;
    }
  }
  if (progress) {
    fmt::print("\r\033[K");
    std::fflush(stdout);
  }
  rb.shutdown();

  json history = json::array();
  for (const runtime::RebalanceRecord& r : rb.history()) {
    history.push_back({{"trigger_step", r.trigger_step},
                       {"end_step", r.end_step},
                       {"outcome", std::string(runtime::outcome_name(r.outcome))},
                       {"error", r.error},
                       {"slots_moved", r.slots_moved},
                       {"bytes_intra_node", r.bytes_intra_node},
                       {"bytes_inter_node", r.bytes_inter_node},
                       {"bytes_local_copy", r.bytes_local_copy},
                       {"bytes_installed", r.bytes_installed},
                       {"stall_total_ms", r.stall_total_ms},
                       {"stall_max_ms", r.stall_max_ms},
                       {"balancedness_before", r.balancedness_before},
                       {"balancedness_after", r.balancedness_after}});
  }
  const json report = {{"rank", me},
                       {"steps", step},
                       {"interrupted", interrupted},
                       {"bytes_held", bytes_held},
                       {"computed", computed},
                       {"verified", verified},
                       {"mismatches", mismatches},
                       {"first_mismatch", first_mismatch},
                       {"moe_ms", moe_ms},
                       {"moe_wall_ms", moe_wall_ms},
                       {"stall_ms", stall_ms},
                       {"balancedness", balancedness},
                       {"installs", installs},
                       {"history", history},
                       {"metrics", json::parse(runtime::families_to_json(rb.collect_metrics()))}};
  if (snapshots) write_snapshot(rb, snapshot_path(options.live_metrics_dir, me));
  return report.dump();
}

namespace {

// Mean of values[first, last); 0 for an empty range.
double mean_of(const std::vector<StepFigures>& steps, int64_t first, int64_t last,
               double StepFigures::*field) {
  if (last <= first) return 0;
  double sum = 0;
  for (int64_t s = first; s < last; ++s) sum += steps[s].*field;
  return sum / static_cast<double>(last - first);
}

}  // namespace

RunResult merge_reports(const RunOptions& options, const Workload& workload,
                        const std::vector<std::string>& reports) {
  EPLB_CHECK_EQ(static_cast<int64_t>(reports.size()), static_cast<int64_t>(options.ranks),
                "rank reports");
  std::vector<json> r;
  for (const std::string& text : reports) r.push_back(json::parse(text));
  RunResult result;
  result.mode = options.mode;
  result.steps = r[0]["steps"].get<int64_t>();
  result.interrupted = r[0]["interrupted"].get<bool>();
  result.bytes_held = r[0]["bytes_held"].get<int64_t>();
  std::vector<std::vector<prometheus::MetricFamily>> metrics;
  for (const json& rank : r) metrics.push_back(runtime::families_from_json(rank["metrics"].dump()));
  result.metrics = runtime::families_to_json(runtime::merge_families(metrics));
  result.per_step.resize(static_cast<size_t>(result.steps));
  for (int64_t s = 0; s < result.steps; ++s) {
    StepFigures& f = result.per_step[s];
    f.balancedness = r[0]["balancedness"][s].get<double>();
    f.installs = r[0]["installs"][s].get<int64_t>();
    for (const json& rank : r) {
      f.moe_ms = std::max(f.moe_ms, rank["moe_ms"][s].get<double>());
      f.moe_wall_ms = std::max(f.moe_wall_ms, rank["moe_wall_ms"][s].get<double>());
      f.stall_ms = std::max(f.stall_ms, rank["stall_ms"][s].get<double>());
    }
  }
  for (const json& rank : r) {
    result.mismatches += rank["mismatches"].get<int64_t>();
    result.verified += rank["verified"].get<int64_t>();
    result.outputs += rank["computed"].get<int64_t>();
  }
  const json& history = r[0]["history"];
  for (size_t i = 0; i < history.size(); ++i) {
    const json& h = history[i];
    RebalanceFigures f;
    f.trigger_step = h["trigger_step"].get<int64_t>();
    f.end_step = h["end_step"].get<int64_t>();
    f.outcome = h["outcome"].get<std::string>();
    f.error = h["error"].get<std::string>();
    f.slots_moved = h["slots_moved"].get<int64_t>();
    f.bytes_moved = h["bytes_intra_node"].get<int64_t>() + h["bytes_inter_node"].get<int64_t>();
    f.bytes_local_copy = h["bytes_local_copy"].get<int64_t>();
    f.predicted_before = h["balancedness_before"].get<double>();
    f.predicted_after = h["balancedness_after"].get<double>();
    for (const json& rank : r) {
      if (i >= rank["history"].size()) continue;
      f.bytes_installed += rank["history"][i]["bytes_installed"].get<int64_t>();
      f.stall_total_ms =
          std::max(f.stall_total_ms, rank["history"][i]["stall_total_ms"].get<double>());
      f.stall_max_ms = std::max(f.stall_max_ms, rank["history"][i]["stall_max_ms"].get<double>());
    }
    ++result.rebalances_triggered;
    if (f.outcome == "completed") {
      ++result.rebalances;
      result.bytes_moved += f.bytes_moved;
      result.bytes_local_copy += f.bytes_local_copy;
      result.bytes_installed += f.bytes_installed;
    }
    result.stall_total_ms += f.stall_total_ms;
    result.stall_max_ms = std::max(result.stall_max_ms, f.stall_max_ms);
    result.per_rebalance.push_back(f);
  }

  // "Before": the steps ahead of the first trigger; "after": the steps after the first completed
  // rebalance ended. Both are cut to whole periods of the workload (each period replays the same
  // tokens), so they score the same traffic; without a rebalance (EPLB off) the same split is
  // made at the first step that would have triggered one.
  const int64_t period = workload.period(options.ranks, options.tokens_per_rank);
  int64_t split_before = std::min(options.interval, result.steps);
  int64_t split_after = split_before;
  if (!result.per_rebalance.empty()) split_before = result.per_rebalance[0].trigger_step;
  for (const RebalanceFigures& f : result.per_rebalance) {
    if (f.outcome == "completed") {
      split_after = std::min(f.end_step, result.steps);
      break;
    }
  }
  result.before_first = 0;
  result.before_last = split_before >= period ? split_before / period * period : split_before;
  result.after_last = result.steps;
  const int64_t after_len = result.steps - split_after;
  result.after_first =
      after_len >= period ? result.steps - after_len / period * period : split_after;
  result.balancedness_before =
      mean_of(result.per_step, result.before_first, result.before_last, &StepFigures::balancedness);
  result.balancedness_after =
      mean_of(result.per_step, result.after_first, result.after_last, &StepFigures::balancedness);
  result.moe_ms_before =
      mean_of(result.per_step, result.before_first, result.before_last, &StepFigures::moe_ms);
  result.moe_ms_after =
      mean_of(result.per_step, result.after_first, result.after_last, &StepFigures::moe_ms);
  result.moe_wall_ms_before =
      mean_of(result.per_step, result.before_first, result.before_last, &StepFigures::moe_wall_ms);
  result.moe_wall_ms_after =
      mean_of(result.per_step, result.after_first, result.after_last, &StepFigures::moe_wall_ms);
  return result;
}

namespace {

std::atomic<int>* g_stop = nullptr;  // shared with the ranks (MAP_SHARED), set by the handler

// A Ctrl-C at a terminal reaches the launcher and every rank at once: each process takes its
// first signal as "stop at the next step" (the flag is shared), and only a second one to the
// same process as "stop now" (forked ranks die with the launcher).
volatile sig_atomic_t g_stop_signals = 0;  // this process's

void on_stop_signal(int signal) {
  if (g_stop == nullptr) return;
  const int seen = g_stop_signals;
  g_stop_signals = seen + 1;
  if (seen > 0) {
    ::signal(signal, SIG_DFL);
    ::raise(signal);
    return;
  }
  g_stop->store(1);
}

std::unique_ptr<transport::Transport> make_transport(const RunOptions& options, int rank) {
  const std::string name = options.transport_backend();
  // Emulated nodes: reads across them go over TCP, as between machines, unless the caller chose
  // UCX's transports; reads within one (hybrid) stay in shared memory.
  if ((name == "ucx" || name == "hybrid") && options.nodes > 1) ::setenv("UCX_TLS", "tcp", 0);
  const int ranks_per_node = options.ranks / std::max(options.nodes, 1);
  return transport::create(
      name, transport::Options{.rank = rank,
                               .node = "emulated-node-" + std::to_string(rank / ranks_per_node)});
}

std::string describe_failures(const std::vector<control::RankExit>& exits) {
  // The ranks that died or stopped on their own first, then those that failed with an error
  // (each distinct message once), then the ones that ended because of them.
  std::string died, others;
  std::vector<std::pair<std::string, std::vector<int>>> errors;  // message, ranks
  for (const control::RankExit& e : exits) {
    if (e.ok()) continue;
    const bool own = e.stopped || (!e.killed_by_launcher && e.signal != 0 && e.signal != SIGINT);
    if (!own && !e.error.empty()) {
      auto same = std::find_if(errors.begin(), errors.end(),
                               [&](const auto& m) { return m.first == e.error; });
      if (same == errors.end()) {
        errors.push_back({e.error, {e.rank}});
      } else {
        same->second.push_back(e.rank);
      }
      continue;
    }
    (own ? died : others) += ((own ? died : others).empty() ? "" : "; ") + e.describe();
  }
  std::string failed;
  for (const auto& [message, ranks] : errors) {
    std::string who = ranks.size() == 1 ? fmt::format("rank {}", ranks[0]) : "ranks ";
    for (size_t i = 0; ranks.size() > 1 && i < ranks.size(); ++i) {
      if (i == 3 && ranks.size() > 4) {
        who += fmt::format(" and {} more", ranks.size() - 3);
        break;
      }
      who += fmt::format("{}{}", i == 0 ? "" : ", ", ranks[i]);
    }
    failed += fmt::format("{}{} failed: {}", failed.empty() ? "" : "; ", who, message);
  }
  if (!died.empty()) {
    std::string then = failed;
    if (!others.empty()) then += (then.empty() ? "" : "; ") + others;
    const bool stopped = died.find("stopped (") != std::string::npos;
    return fmt::format("{}{}; the run stopped{}", died, stopped ? "" : " died",
                       then.empty() ? "" : " (then: " + then + ")");
  }
  if (!failed.empty()) return failed + (others.empty() ? "" : " (then: " + others + ")");
  return "ranks failed: " + others;
}

}  // namespace

RunResult run_local(const RunOptions& options, const Workload& workload) {
  options.validate(workload);
  if (options.ranks > control::max_local_ranks()) {
    fail("--ranks ", options.ranks, " is more rank processes than this machine takes: at most ",
         control::max_local_ranks(), " (", control::kMaxLocalRanks,
         ", fewer where the memory available or the process limit, ulimit -u, leave less room)");
  }
  options.check_window_fits(workload, options.ranks);
  const control::ScratchFolder scratch("eplb-run");
  const std::string& dir = scratch.path();

  // --metrics-port: the ranks write their families into the scratch folder, a server process
  // of its own serves them merged (live_metrics.h). Listening before the ranks fork (and
  // before the signal handlers): a port in use fails the run at once.
  RunOptions rank_options = options;
  std::unique_ptr<MetricsServerProcess> server;
  if (options.metrics_port > 0) {
    rank_options.live_metrics_dir = dir;
    server = std::make_unique<MetricsServerProcess>(options.metrics_port, dir, options.ranks);
  }

  // The stop flag lives in shared memory: a signal to the launcher or to any rank reaches all.
  void* shared = ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) fail<IoError>("mmap of the stop flag failed: ", std::strerror(errno));
  auto* stop = new (shared) std::atomic<int>(0);
  g_stop = stop;
  g_stop_signals = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);

  const std::string rendezvous = fmt::format("eplb-run-{}-{}-{}", ::getpid(), options.mode,
                                             Clock::now().time_since_epoch().count() % 1000000);
  control::ForkOptions fork_options;
  fork_options.timeout = std::chrono::hours(24);  // collectives time out on their own
  fork_options.grace = std::chrono::milliseconds(options.timeout_ms) + std::chrono::seconds(5);
  const auto start = Clock::now();
  std::vector<control::RankExit> exits;
  try {
    exits = control::fork_ranks(
        options.ranks,
        [&](int rank) {
          control::Options o;
          o.rank = rank;
          o.size = options.ranks;
          o.rendezvous = rendezvous;
          o.timeout = std::chrono::milliseconds(options.timeout_ms);
          auto communicator = control::connect("shm", o);
          o.rendezvous = rendezvous + "-lockstep";
          o.group = "lockstep";
          auto lockstep = control::connect("shm", o);
          auto transport = make_transport(options, rank);
          const std::string report =
              run_rank(rank_options, workload, *communicator, *lockstep, *transport, stop);
          std::ofstream(fmt::format("{}/rank{}.json", dir, rank)) << report;
          return 0;
        },
        fork_options);
  } catch (...) {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    g_stop = nullptr;
    throw;
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_stop = nullptr;
  const bool stopped = stop->load() != 0;
  ::munmap(shared, sizeof(std::atomic<int>));

  bool all_ok = true;
  for (const control::RankExit& e : exits) all_ok = all_ok && e.ok();
  if (!all_ok) {
    fail<IoError>(describe_failures(exits), stopped ? " (after an interrupt)" : "");
  }
  std::vector<std::string> reports;
  for (int rank = 0; rank < options.ranks; ++rank) {
    reports.push_back(stats::read_file(fmt::format("{}/rank{}.json", dir, rank)));
  }
  RunResult result = merge_reports(options, workload, reports);
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

RunResult run_from_env(RunOptions options, const Workload& workload) {
  const std::optional<control::LaunchInfo> info = control::launch_info_from_env();
  if (!info) {
    fail(
        "no launcher environment: set RANK and WORLD_SIZE (and EPLB_RENDEZVOUS), or start "
        "under mpirun");
  }
  options.ranks = info->size;
  if (info->local_size >= 1 && info->size % info->local_size == 0) {
    options.nodes = info->size / info->local_size;
  }
  options.progress = options.progress && info->rank == 0;
  options.validate(workload);
  // --metrics-port: this rank serves its own registry, listening before the group forms, so
  // a port in use fails this rank before its peers wait for it.
  std::unique_ptr<MetricsServer> server;
  if (options.metrics_port > 0) {
    const int port = options.metrics_port + info->local_rank;
    if (port > 65535) {
      fail("--metrics-port ", options.metrics_port, " + local rank ", info->local_rank, " is ",
           port, ", past the last port 65535 (each rank serves on PORT + its local rank)");
    }
    options.registry = std::make_shared<prometheus::Registry>();
    server = std::make_unique<MetricsServer>(port, options.registry);
  }
  control::Options o;
  o.rank = info->rank;
  o.size = info->size;
  o.rendezvous = info->rendezvous;
  o.timeout = info->timeout;
  const auto start = Clock::now();
  auto communicator = control::connect(info->backend, o);
  o.group = "lockstep";
  auto lockstep = control::connect(info->backend, o);
  // One process per rank across machines: shared memory with the ranks of this machine, UCX
  // with the others.
  options.transport = options.transport_backend(/*launched=*/true);
  auto transport = transport::create(options.transport, transport::Options{.rank = info->rank});
  const std::string report =
      run_rank(options, workload, *communicator, *lockstep, *transport, nullptr);
  const auto bytes = std::as_bytes(std::span(report.data(), report.size()));
  const std::vector<control::Bytes> all = lockstep->all_gather(bytes);
  std::vector<std::string> reports;
  for (const control::Bytes& b : all) {
    reports.emplace_back(reinterpret_cast<const char*>(b.data()), b.size());
  }
  RunResult result = merge_reports(options, workload, reports);
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace eplb::emu
