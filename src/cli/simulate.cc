// `eplb simulate`: replay a load history or routing trace under placement policies, rebalancing
// every --interval steps from the last --window steps, and report out-of-sample balancedness and
// the moves each rebalance costs, side by side (see eplb/sim/simulate.h for the schedule).

#include "eplb/sim/simulate.h"

#include <fmt/core.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/layout_options.h"
#include "cli/option_checks.h"
#include "eplb/core/error.h"
#include "emu/workload.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/gain.h"
#include "eplb/sim/per_step.h"
#include "eplb/stats/load_file.h"

namespace eplb::cli {
namespace {

// DeepSeek-V3's routed expert in one layer: gate, up and down projections of 7168 x 2048
// weights in FP8, one byte each.
// --token-us: a second per token and expert.
constexpr double kMaxTokenUs = 1e6;
constexpr int64_t kDeepseekV3ExpertBytes = int64_t{7168} * 2048 * 3;

struct SimulateArgs {
  std::string load_path;
  std::string trace_path;
  std::string format = "auto";
  int64_t experts = 0;
  int64_t ranks = 0;
  int64_t nodes = 1;
  int64_t groups = 1;
  std::optional<int64_t> physical;
  std::optional<int64_t> redundant;
  int64_t interval = 0;
  int64_t window = 0;
  std::string policies = "none,deepseek,balanced,sticky";
  bool hierarchical = false;
  double tolerance = 0.01;
  bool thorough = false;
  int64_t tokens_per_step = 256;
  int64_t expert_bytes = kDeepseekV3ExpertBytes;
  double token_us = 0;  // one token through one expert on one rank; 0: MoE time in token units
  int64_t peers_per_round = 1;
  bool json = false;
  std::string plot_path;
  std::string dispatches = "all";  // per-step scoring at token level; "none": off
  double spread = 0;
  std::string cost;             // --cost: a preset or a JSON file; empty: token counts only
  int64_t sample_tokens = 0;    // --sample-tokens: a load file drawn into a trace of this many
  int64_t top_k = 8;
  uint64_t seed = 1;
  double min_gain = 0;      // --min-gain: a rebalance only when it pays (placement/gain.h)
  double pull_gbps = 100;   // --pull-gbps: what each rank reads a rebalance's bytes at
  double stall_ms = 0;      // --stall-ms: a rebalance's stall of the serving loop
};

// --cost SPEC: a preset, else a JSON file of parameters (placement/cost.h).
placement::CostModel read_cost(const std::string& spec) {
  if (placement::is_cost_model_preset(spec)) return placement::cost_model_preset(spec);
  std::string text;
  try {
    text = stats::read_file(spec);
  } catch (const Error&) {
    std::string list;
    for (const std::string& p : placement::cost_model_presets()) {
      list += (list.empty() ? "" : ", ") + p;
    }
    fail("--cost '", spec, "' is neither a preset (", list,
         ") nor a readable JSON file of cost model parameters");
  }
  return placement::cost_model_from_json(text, "--cost " + spec);
}

// What was read: the history the replay runs on, and the trace its steps were grouped from.
struct Input {
  stats::LoadHistory history;
  std::optional<stats::RoutingTrace> trace;
};

// The input as a load history: steps of a load file as they are, a routing trace's tokens
// grouped into steps of --tokens-per-step.
Input read_input(const SimulateArgs& args) {
  if (args.load_path.empty() == args.trace_path.empty()) {
    fail("give exactly one of --load-history FILE and --trace FILE");
  }
  if (args.experts < 0) fail("--experts ", args.experts, " must not be negative");
  if (args.tokens_per_step < 1) {
    fail("--tokens-per-step ", args.tokens_per_step, " must be at least 1");
  }
  if (args.sample_tokens < 0) {
    fail("--sample-tokens ", args.sample_tokens, " must not be negative (0: use the file's steps)");
  }
  if (args.sample_tokens > 0) {
    if (args.load_path.empty()) {
      fail("--sample-tokens draws tokens from a load file: give --load-history FILE, not --trace");
    }
    // Tokens drawn from the file's loads as `eplb run` draws them, then grouped into steps.
    const emu::Workload w =
        emu::workload_from_load(args.load_path, args.top_k, args.sample_tokens, args.seed);
    Input in;
    in.trace = stats::RoutingTrace{.layers = w.layers,
                                   .tokens = w.tokens,
                                   .top_k = w.top_k,
                                   .experts = w.experts,
                                   .layer_ids = {},
                                   .routes = w.routes};
    for (int64_t l = 0; l < w.layers; ++l) in.trace->layer_ids.push_back(l);
    if (args.tokens_per_step > in.trace->tokens) {
      fail("--tokens-per-step ", args.tokens_per_step, " exceeds the ", in.trace->tokens,
           " tokens of --sample-tokens (not even one step)");
    }
    in.history = sim::history_from_trace(*in.trace, args.tokens_per_step, args.experts);
    return in;
  }
  const bool trace = !args.trace_path.empty();
  const std::string& path = trace ? args.trace_path : args.load_path;
  const std::string content = stats::read_file(path);
  stats::LoadFormat format = stats::parse_load_format(args.format);
  if (format == stats::LoadFormat::kAuto) format = stats::detect_load_format(content, path);
  if (trace && format != stats::LoadFormat::kTrace) {
    fail("--trace ", path,
         " is not a routing trace (CSV with the header "
         "\"layer,token,experts[,weights]\"; it reads as ",
         stats::load_format_name(format), "): pass load files with --load-history");
  }
  if (format == stats::LoadFormat::kTrace) {
    Input in;
    in.trace = stats::parse_routing_trace(content, args.experts, path);
    if (args.tokens_per_step > in.trace->tokens) {
      fail("--tokens-per-step ", args.tokens_per_step, " exceeds the ", in.trace->tokens,
           " tokens of ", path, " (not even one step)");
    }
    in.history = sim::history_from_trace(*in.trace, args.tokens_per_step, args.experts);
    return in;
  }
  stats::LoadReadOptions options;
  options.format = format;
  options.experts = args.experts;
  return {.history = stats::parse_load_history(content, options, path), .trace = std::nullopt};
}

Layout make_layout(const SimulateArgs& args, int64_t experts) {
  if (args.ranks < 1) fail("--ranks ", args.ranks, " must be at least 1");
  Layout layout;
  layout.experts = experts;
  layout.ranks = args.ranks;
  layout.nodes = args.nodes;
  layout.groups = args.groups;
  layout.physical = physical_slots(experts, args.ranks, args.physical, args.redundant);
  if (layout.physical < experts) {
    fail("--physical ", layout.physical, " is below the ", experts,
         " experts of the input (every logical expert needs a slot)");
  }
  layout.validate();
  return layout;
}

void check_options(const SimulateArgs& args) {
  if (args.interval < 1) fail("--interval ", args.interval, " must be at least 1 step");
  if (args.window < 1) fail("--window ", args.window, " must be at least 1 step");
  if (args.interval > kMaxSteps) {
    fail("--interval ", args.interval, " is outside [1, ", kMaxSteps,
         "] steps (an interval past the last step means one rebalance)");
  }
  if (args.window > kMaxSteps) {
    fail("--window ", args.window, " is outside [1, ", kMaxSteps, "] steps");
  }
  if (args.expert_bytes < 1) {
    fail("--expert-bytes ", args.expert_bytes,
         " must be at least 1 (the bytes of one expert's weights in one layer)");
  }
  if (args.peers_per_round < 1) {
    fail("--peers-per-round ", args.peers_per_round, " must be at least 1");
  }
  // A second per token and expert is past any device; below it, the predicted MoE time of a
  // step stays finite for every load a file may hold (kMaxLayerLoad per layer).
  check_number("--token-us", args.token_us, 0, kMaxTokenUs,
               "microseconds for one token through one expert");
}

// CPU time of this thread: the replay runs on one core, and its speed on that core should not
// depend on what else the machine runs.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

// Balancedness per scored step: the replay's (window sums, one line per policy), and below it,
// with per-step scoring, each policy's dispatches and bounds at token level; a dashed line at
// every rebalance.
void plot(const std::string& path, const sim::SimResult& r, const sim::PerStepResult* steps) {
  std::string script = "$data << EOD\n";
  for (size_t i = 0; i < r.policies.front().step_balancedness.size(); ++i) {
    script += std::to_string(r.first_scored_step + static_cast<int64_t>(i));
    for (const sim::PolicyResult& p : r.policies) {
      script += fmt::format(" {:.6f}", p.step_balancedness[i]);
    }
    if (steps != nullptr) {
      for (const sim::PerStepPolicy& p : steps->policies) {
        for (const sim::StepScore& d : p.dispatches) {
          script += fmt::format(" {:.6f}", d.step_balancedness[i]);
        }
        if (!p.dispatch_bound.step_balancedness.empty()) {
          script += fmt::format(" {:.6f} {:.6f}", p.dispatch_bound.step_balancedness[i],
                                p.placement_bound.step_balancedness[i]);
        }
      }
    }
    script += "\n";
  }
  script += "EOD\n";
  script += fmt::format("set terminal pngcairo size 1200,{}\n", steps != nullptr ? 1100 : 600);
  std::string quoted;
  for (const char c : path) {
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  script += fmt::format("set output \"{}\"\n", quoted);
  if (steps != nullptr) script += "set multiplot layout 2,1\n";
  script += "set xlabel \"step\"\nset ylabel \"balancedness (mean / max rank load)\"\n";
  script += "set yrange [0:1.05]\nset key bottom right\nset grid ytics\n";
  for (const int64_t t : r.rebalance_steps) {
    script +=
        fmt::format("set arrow from {0},graph 0 to {0},graph 1 nohead dt 2 lc rgb \"gray60\"\n", t);
  }
  script +=
      "set title \"eplb simulate: out-of-sample balancedness per step of the window's "
      "sums (dashed: rebalances)\"\n";
  script += "plot ";
  for (size_t i = 0; i < r.policies.size(); ++i) {
    script += fmt::format("{}$data using 1:{} with lines lw 2 title \"{}\"", i ? ", " : "", i + 2,
                          r.policies[i].policy);
  }
  script += "\n";
  if (steps != nullptr) {
    script += "set title \"each step at token level: dispatches and bounds\"\n";
    script += "set key outside right\nplot ";
    size_t column = r.policies.size() + 2;
    bool first = true;
    for (const sim::PerStepPolicy& p : steps->policies) {
      for (const sim::StepScore& d : p.dispatches) {
        script += fmt::format("{}$data using 1:{} with lines lw 1 title \"{} {}\"",
                              first ? "" : ", ", column++, p.policy, d.name);
        first = false;
      }
      if (!p.dispatch_bound.step_balancedness.empty()) {
        script += fmt::format(
            "{}$data using 1:{} with lines dt 3 lw 2 title \"{} dispatch bound\", "
            "$data using 1:{} with lines dt 4 lw 1 title \"{} placement bound\"",
            first ? "" : ", ", column, p.policy, column + 1, p.policy);
        column += 2;
        first = false;
      }
    }
    script += "\nunset multiplot\n";
  }
  FILE* pipe = popen("gnuplot", "w");
  if (pipe == nullptr) fail<IoError>("cannot start gnuplot to draw ", path);
  const bool written = std::fwrite(script.data(), 1, script.size(), pipe) == script.size();
  const int status = pclose(pipe);
  if (!written || status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fail<IoError>("gnuplot failed to draw ", path, " (is the folder writable?)");
  }
}

double mib(double bytes) { return bytes / (1 << 20); }

// The predicted MoE time of a step: in ms with --token-us, else in token-expert units.
double moe_per_step(const SimulateArgs& args, const sim::PolicyResult& p) {
  return args.token_us > 0 ? p.max_rank_load_per_step * args.token_us / 1000
                           : p.max_rank_load_per_step;
}

// MoE per step from a per-step score: ms with --token-us, else token-expert passes.
double moe_per_step(const SimulateArgs& args, const sim::StepScore& s) {
  return args.token_us > 0 ? s.max_rank_load_per_step * args.token_us / 1000
                           : s.max_rank_load_per_step;
}

nlohmann::json score_json(const SimulateArgs& args, const sim::StepScore& s) {
  return {{"balancedness", s.balancedness},
          {"modeled_ms", s.modeled_ms >= 0 ? nlohmann::json(s.modeled_ms) : nlohmann::json(nullptr)},
          {"balancedness_step", s.balancedness_step},
          {"max_rank_load_per_step", s.max_rank_load_per_step},
          {"predicted_moe_ms_per_step",
           args.token_us > 0 ? nlohmann::json(moe_per_step(args, s)) : nlohmann::json(nullptr)}};
}

// The per-step figures of one policy, merged into its results object.
void add_per_step_json(const SimulateArgs& args, const sim::PerStepPolicy& p, nlohmann::json& out) {
  nlohmann::json dispatch = nlohmann::json::object();
  for (const sim::StepScore& d : p.dispatches) dispatch[d.name] = score_json(args, d);
  out["dispatch"] = std::move(dispatch);
  if (!p.dispatch_bound.step_balancedness.empty()) {
    out["dispatch_bound"] = p.dispatch_bound.balancedness;
    out["placement_bound"] = p.placement_bound.balancedness;
    out["dispatch_bound_detail"] = score_json(args, p.dispatch_bound);
    out["placement_bound_detail"] = score_json(args, p.placement_bound);
  }
}

nlohmann::json result_json(const SimulateArgs& args, const sim::SimResult& r,
                           const sim::PolicyResult& p) {
  nlohmann::json moved = nlohmann::json::array(), bytes = nlohmann::json::array(),
                 rounds = nlohmann::json::array();
  nlohmann::json checks = nlohmann::json::array();  // --min-gain's, one per rebalance
  for (const sim::Rebalance& b : p.rebalances) {
    moved.push_back(b.moved_slots);
    bytes.push_back(b.bytes);
    rounds.push_back(b.rounds);
    if (b.checked) {
      checks.push_back({{"step", b.step},
                        {"rebalanced", !b.skipped},
                        {"modeled_ms_before", b.modeled_us_before / 1e3},
                        {"modeled_ms_after", b.modeled_us_after / 1e3},
                        {"gain_ms", b.gain_us / 1e3},
                        {"price_ms", b.price_us / 1e3},
                        {"bytes", b.bytes_planned}});
    }
  }
  return {
      {"balancedness", p.balancedness},
      {"balancedness_step", p.balancedness_step},
      {"max_rank_load_per_step", p.max_rank_load_per_step},
      {"predicted_moe_ms_per_step",
       args.token_us > 0 ? nlohmann::json(moe_per_step(args, p)) : nlohmann::json(nullptr)},
      {"moved_slots_per_rebalance", p.moved_slots_per_rebalance},
      {"steady_moved_slots_per_rebalance", p.steady_moved_slots_per_rebalance >= 0
                                               ? nlohmann::json(p.steady_moved_slots_per_rebalance)
                                               : nlohmann::json(nullptr)},
      {"bytes_per_rebalance", p.bytes_per_rebalance},
      {"rounds_per_rebalance", p.rounds_per_rebalance},
      {"lower_bound_balancedness", r.lower_bound_balancedness},
      {"rebalances", p.rebalances.size()},
      {"rebalances_done", p.rebalances_done},
      {"rebalances_skipped", static_cast<int64_t>(p.rebalances.size()) - p.rebalances_done},
      {"bytes_moved", p.bytes_moved},
      {"gain_checks", std::move(checks)},
      {"moved_slots", std::move(moved)},
      {"bytes", std::move(bytes)},
      {"rounds", std::move(rounds)},
  };
}

// The per-step table: balancedness per dispatch and the bounds, then the MoE per step.
void print_per_step(const SimulateArgs& args, const Input& in, const sim::PerStepResult& ps,
                    double cpu_seconds) {
  const sim::PerStepPolicy& first = ps.policies.front();
  const bool bounds = !first.dispatch_bound.step_balancedness.empty();
  fmt::print("\nper step at token level ({}), every step scored on its own:\n",
             in.trace ? fmt::format("{} tokens per step from the trace", args.tokens_per_step)
                      : std::string("the history's counts as tokens, spread over the ranks"));
  const bool modeled = first.dispatches.empty() ? first.dispatch_bound.modeled_ms >= 0
                                                : first.dispatches.front().modeled_ms >= 0;
  for (const int table : {0, 1, 2}) {
    if (table == 2 && !modeled) break;
    const bool moe = table == 1;
    std::string header =
        fmt::format("{:>9}", table == 2 ? "model ms" : moe ? "MoE/step" : "policy");
    for (const sim::StepScore& d : first.dispatches) header += fmt::format("  {:>9}", d.name);
    if (bounds) header += fmt::format("  {:>14}  {:>15}", "dispatch bound", "placement bound");
    fmt::print("{}\n", header);
    for (const sim::PerStepPolicy& p : ps.policies) {
      std::string line = fmt::format("{:>9}", p.policy);
      auto cell = [&](const sim::StepScore& s, int width) {
        if (table == 2) return fmt::format("  {:>{}.4f}", s.modeled_ms, width);
        return moe ? fmt::format("  {:>{}.{}f}", moe_per_step(args, s), width,
                                 args.token_us > 0 ? 3 : 0)
                   : fmt::format("  {:>{}.4f}", s.balancedness, width);
      };
      for (const sim::StepScore& d : p.dispatches) line += cell(d, 9);
      if (bounds) line += cell(p.dispatch_bound, 14) + cell(p.placement_bound, 15);
      fmt::print("{}\n", line);
    }
  }
  fmt::print(
      "dispatch bound: the best split of each step's counts over the placement in force; "
      "placement bound: a placement made for that step alone, with its best split\n");
  if (modeled) {
    fmt::print(
        "model ms: the modeled MoE time per step under the cost model; its dispatch bound is a "
        "lower bound on any split's, its placement bound a placement made for each step alone "
        "with adaptive_cost\n");
  }
  fmt::print(
      "per-step scoring: {:.3f} s of CPU, {:.3f}M layer-steps per CPU second ({:.1f}M "
      "token-experts per second)\n",
      cpu_seconds, static_cast<double>(ps.layer_steps) / cpu_seconds / 1e6,
      static_cast<double>(ps.tokens) * static_cast<double>(ps.policies.size()) / cpu_seconds / 1e6);
}

// --min-gain: per policy, the rebalances done and skipped, the bytes moved, and the modeled
// MoE time per step (adaptive's, or the first dispatch scored).
void print_gain(const SimulateArgs& args, const sim::SimResult& r, const sim::PerStepResult* ps) {
  fmt::print("\nmin_gain {}: a rebalance only when its modeled gain over the next {} steps "
             "reaches {} x its price (its bytes at {} GB/s per rank, stall {} ms)\n",
             args.min_gain, args.interval, args.min_gain, args.pull_gbps, args.stall_ms);
  std::string dispatch;
  fmt::print("{:>13}  {:>10}  {:>8}  {:>12}  {:>16}\n", "policy", "rebalanced", "skipped",
             "bytes moved", "model ms/step");
  for (size_t i = 0; i < r.policies.size(); ++i) {
    const sim::PolicyResult& p = r.policies[i];
    std::string modeled = "-";
    if (ps != nullptr && !ps->policies[i].dispatches.empty()) {
      const std::vector<sim::StepScore>& d = ps->policies[i].dispatches;
      const auto it = std::find_if(d.begin(), d.end(),
                                   [](const sim::StepScore& s) { return s.name == "adaptive"; });
      const sim::StepScore& shown = it != d.end() ? *it : d.front();
      dispatch = shown.name;
      modeled = fmt::format("{:.4f}", shown.modeled_ms);
    }
    fmt::print("{:>13}  {:>10}  {:>8}  {:>12}  {:>16}\n", p.policy, p.rebalances_done,
               static_cast<int64_t>(p.rebalances.size()) - p.rebalances_done,
               fmt::format("{:.2f} GB", static_cast<double>(p.bytes_moved) / 1e9), modeled);
  }
  if (!dispatch.empty()) fmt::print("model ms/step: the {} dispatch's\n", dispatch);
}

void print_table(const SimulateArgs& args, const stats::LoadHistory& history, const Layout& layout,
                 const sim::SimResult& r, double seconds, double cpu_seconds) {
  const std::string source =
      args.trace_path.empty()
          ? fmt::format("{} ({})", args.load_path, stats::load_format_name(history.format))
          : fmt::format("{} ({} tokens per step)", args.trace_path, args.tokens_per_step);
  fmt::print("eplb simulate: {}: {} steps x {} layers, {}\n", source, r.steps, r.layers,
             layout.describe());
  fmt::print(
      "rebalance every {} steps from the last {}: {} rebalances, steps {}..{} scored out "
      "of sample; expert {:.1f} MiB, {} peer{} per round\n",
      args.interval, args.window, r.rebalance_steps.size(), r.first_scored_step, r.steps - 1,
      mib(static_cast<double>(args.expert_bytes)), args.peers_per_round,
      args.peers_per_round == 1 ? "" : "s");
  fmt::print("{:>9}  {:>12}  {:>13}  {:>12}  {:>10}  {:>12}  {:>14}  {:>10}\n", "policy",
             "balancedness", "step-weighted", args.token_us > 0 ? "MoE ms/step" : "MoE/step",
             "moved/reb", "steady moved", "MiB read/reb", "rounds/reb");
  for (const sim::PolicyResult& p : r.policies) {
    const std::string steady = p.steady_moved_slots_per_rebalance >= 0
                                   ? fmt::format("{:.1f}", p.steady_moved_slots_per_rebalance)
                                   : "-";
    fmt::print("{:>9}  {:>12.4f}  {:>13.4f}  {:>12.{}f}  {:>10.1f}  {:>12}  {:>14.1f}  {:>10.1f}\n",
               p.policy, p.balancedness, p.balancedness_step, moe_per_step(args, p),
               args.token_us > 0 ? 3 : 0, p.moved_slots_per_rebalance, steady,
               mib(p.bytes_per_rebalance), p.rounds_per_rebalance);
  }
  fmt::print("lower bound on the scored windows: {:.4f} (mean), {:.4f} (step-weighted)\n",
             r.lower_bound_balancedness, r.lower_bound_balancedness_step);
  fmt::print(
      "moved/reb counts the first rebalance from the trivial placement; steady moved "
      "leaves it out\n");
  fmt::print(
      "MoE/step: the busiest rank's load summed over layers, per step (the MoE time a "
      "step waits for){}\n",
      args.token_us > 0 ? fmt::format(", at {} us per token and expert", args.token_us)
                        : " in token-expert passes; --token-us turns it into ms");
  fmt::print("replay: {:.3f} s ({:.3f} s of CPU), {:.2f}M layer-steps per CPU second\n", seconds,
             cpu_seconds, static_cast<double>(r.layer_steps) / cpu_seconds / 1e6);
}

void run_simulate(const SimulateArgs& args) {
  // Step 1: everything that needs no file.
  check_options(args);
  sim::SimOptions options;
  options.policies = sim::parse_policies(args.policies);
  std::optional<placement::CostModel> cost;
  if (!args.cost.empty()) {
    cost = read_cost(args.cost);
    options.cost = cost;
    // The cost-aware placement beside the others, unless asked for already (or impossible).
    bool listed = false;
    for (const sim::SimPolicy& p : options.policies) listed = listed || p.cost;
    if (!listed && !args.hierarchical) {
      options.policies.push_back(sim::parse_policies("balanced_cost").front());
    }
  }
  options.interval = args.interval;
  options.window = args.window;
  options.hierarchical = args.hierarchical;
  options.tolerance = args.tolerance;
  options.thorough = args.thorough;
  if (!(args.spread >= 0) || !std::isfinite(args.spread)) {
    fail("--spread ", args.spread, " must be a finite number of standard deviations >= 0");
  }
  options.spread = args.spread;
  options.migration.expert_bytes = args.expert_bytes;
  options.migration.schedule.peers_per_round = args.peers_per_round;
  placement::check_min_gain(args.min_gain, "--min-gain");
  if (args.min_gain > 0 && !cost) {
    fail("--min-gain ", args.min_gain, " weighs a rebalance's gain in modeled time: give --cost "
         "MODEL (a preset such as h100-v3-decode, or a JSON file of its parameters)");
  }
  if (!std::isfinite(args.pull_gbps) || !(args.pull_gbps > 0) || args.pull_gbps > 1e6) {
    fail("--pull-gbps ", args.pull_gbps, " must be a number of GB/s in (0, 1e6] (what each "
         "rank reads a rebalance's bytes at)");
  }
  if (!std::isfinite(args.stall_ms) || args.stall_ms < 0 || args.stall_ms > 1e9) {
    fail("--stall-ms ", args.stall_ms, " must be a number of ms in [0, 1e9] (what a rebalance "
         "stalls the serving loop)");
  }
  options.min_gain = args.min_gain;
  if (!args.plot_path.empty() && !have_gnuplot()) {
    fail<NotSupported>(
        "--plot needs gnuplot, which is not installed (apt-get install "
        "gnuplot-nox), or drop --plot");
  }

  // Step 2: the input, its layout, and the checks that need its shape.
  const std::vector<routing::DispatchPolicy> dispatches =
      sim::parse_dispatches(args.dispatches, cost.has_value());
  const Input input = read_input(args);
  const stats::LoadHistory& history = input.history;
  options.layout = make_layout(args, history.experts);
  // Every rank reads its share of a rebalance's bytes at --pull-gbps, all at once.
  options.pull_bytes_per_s = args.pull_gbps * 1e9 * static_cast<double>(options.layout.ranks);
  options.stall_us = args.stall_ms * 1e3;
  if (args.window >= history.steps) {
    const std::string steps = fmt::format(
        "{} step{}{}", history.steps, history.steps == 1 ? "" : "s",
        history.format == stats::LoadFormat::kTrace
            ? fmt::format(" of {} tokens", args.tokens_per_step)
            : std::string());
    if (history.steps < 2) {
      fail("--window ", args.window, " leaves no step to score: the input has ", steps,
           ", and a replay needs at least 2 (a placement is made from the first --window steps "
           "and scored on the steps after them)",
           history.format == stats::LoadFormat::kTrace
               ? "; lower --tokens-per-step to cut the trace into more steps"
               : "");
    }
    fail("--window ", args.window, " leaves no step to score: the input has ", steps,
         "; the first placement is made from steps [0, window) and scored on the steps after "
         "it, so --window must be at most ",
         history.steps - 1);
  }

  // Step 3: the replay, timed without the parsing: wall-clock, and CPU time for the speed.
  const bool per_step = !dispatches.empty();
  options.keep_placements = per_step;
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = thread_cpu_seconds();
  const sim::SimResult result = sim::simulate(history, options);
  const double cpu_seconds = std::max(thread_cpu_seconds() - cpu_start, 1e-9);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Step 4: every step scored on its own at token level, timed apart from the replay.
  std::optional<sim::PerStepResult> steps;
  double step_cpu_seconds = 0;
  if (per_step) {
    sim::PerStepOptions po;
    po.dispatches = dispatches;
    po.bounds = true;
    po.trace = input.trace ? &*input.trace : nullptr;
    po.tokens_per_step = args.tokens_per_step;
    po.cost = cost;
    const double step_start = thread_cpu_seconds();
    steps = sim::score_per_step(history, options, result, po);
    step_cpu_seconds = std::max(thread_cpu_seconds() - step_start, 1e-9);
  }
  if (!args.plot_path.empty()) plot(args.plot_path, result, steps ? &*steps : nullptr);

  if (args.json) {
    nlohmann::json results = nlohmann::json::object();
    for (size_t i = 0; i < result.policies.size(); ++i) {
      const sim::PolicyResult& p = result.policies[i];
      results[p.policy] = result_json(args, result, p);
      if (steps) add_per_step_json(args, steps->policies[i], results[p.policy]);
    }
    nlohmann::json out = {
        {"source", args.trace_path.empty() ? args.load_path : args.trace_path},
        {"format", stats::load_format_name(history.format)},
        {"steps", result.steps},
        {"layers", result.layers},
        {"experts", options.layout.experts},
        {"physical", options.layout.physical},
        {"ranks", options.layout.ranks},
        {"nodes", options.layout.nodes},
        {"groups", options.layout.groups},
        {"interval", args.interval},
        {"window", args.window},
        {"expert_bytes", args.expert_bytes},
        {"peers_per_round", args.peers_per_round},
        {"thorough", args.thorough},
        {"min_gain", args.min_gain},
        {"pull_gbps", args.pull_gbps},
        {"stall_ms", args.stall_ms},
        {"first_scored_step", result.first_scored_step},
        {"rebalance_steps", result.rebalance_steps},
        {"lower_bound_balancedness", result.lower_bound_balancedness},
        {"lower_bound_balancedness_step", result.lower_bound_balancedness_step},
        {"window_lower_bound_balancedness", result.window_lower_bound_balancedness},
        {"results", std::move(results)},
        {"layer_steps", result.layer_steps},
        {"replay_s", seconds},
        {"replay_cpu_s", cpu_seconds},
        // Per second of CPU time on the one core the replay runs on.
        {"layer_steps_per_s", static_cast<double>(result.layer_steps) / cpu_seconds},
    };
    if (!args.trace_path.empty() || history.format == stats::LoadFormat::kTrace) {
      out["tokens_per_step"] = args.tokens_per_step;
    }
    if (steps) {
      out["per_step"] = {
          {"tokens", input.trace ? "trace" : "counts"},
          {"dispatches", dispatches.size()},
          {"layer_steps", steps->layer_steps},
          {"token_experts", steps->tokens},
          {"cpu_s", step_cpu_seconds},
          {"layer_steps_per_s", static_cast<double>(steps->layer_steps) / step_cpu_seconds}};
    }
    if (!args.plot_path.empty()) out["plot"] = args.plot_path;
    out["cost_model"] = cost ? nlohmann::json::parse(placement::cost_model_to_json(*cost))
                             : nlohmann::json(nullptr);
    fmt::print("{}\n", out.dump());
  } else {
    print_table(args, history, options.layout, result, seconds, cpu_seconds);
    if (steps) print_per_step(args, input, *steps, step_cpu_seconds);
    if (args.min_gain > 0) print_gain(args, result, steps ? &*steps : nullptr);
    if (cost) {
      fmt::print("cost model: {} ({})\n", cost->describe(), cost->source);
      fmt::print("its error on held-back steps: {}\n", cost->describe_heldout());
    }
    if (!args.plot_path.empty()) fmt::print("wrote {}\n", args.plot_path);
  }
}

}  // namespace

void add_simulate(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Replay a load history or routing trace: rebalance every --interval steps from the last "
      "--window steps and score the steps after each rebalance, per policy");
  cmd->add_option("--load-history", args->load_path,
                  "Loads per step: vLLM load_history, eplb or SGLang JSON with steps (a routing "
                  "trace CSV is grouped like --trace)");
  cmd->add_option("--trace", args->trace_path,
                  "Routing trace CSV \"layer,token,experts[,weights]\"; consecutive tokens are "
                  "grouped into steps of --tokens-per-step");
  cmd->add_option("--format", args->format,
                  "Format of --load-history: auto, eplb, sglang, vllm, csv, trace")
      ->capture_default_str();
  cmd->add_option("--experts", args->experts,
                  "Logical experts per layer (default: as the input says)");
  cmd->add_option("--ranks", args->ranks, "Ranks (GPUs) G")->required();
  cmd->add_option("--nodes", args->nodes, "Nodes N (ranks are split evenly)")
      ->capture_default_str();
  cmd->add_option("--physical", args->physical, "Physical slots per layer P (a multiple of G)");
  cmd->add_option("--redundant", args->redundant, "Redundant slots per layer R (P = E + R)");
  cmd->add_option("--groups", args->groups, "Expert groups (DeepSeek group-limited routing)")
      ->capture_default_str();
  cmd->add_option("--interval", args->interval, "Steps between rebalances")->required();
  cmd->add_option("--window", args->window, "Steps each placement is computed from")->required();
  cmd->add_option("--policy", args->policies,
                  "Comma-separated policies to compare: deepseek, balanced, sticky, none "
                  "(never rebalance)")
      ->capture_default_str();
  cmd->add_flag("--hierarchical", args->hierarchical,
                "balanced/sticky: pack groups to nodes first, like deepseek");
  cmd->add_option("--tolerance", args->tolerance,
                  "sticky: balancedness it may give up against balanced")
      ->capture_default_str();
  cmd->add_flag("--thorough", args->thorough,
                "balanced/sticky at two slots per rank: also build the replica counts level by "
                "level (better balance at 256 ranks, slower; docs/placement.md)");
  cmd->add_option("--tokens-per-step", args->tokens_per_step,
                  "Routing traces: tokens per step (a trailing partial step is dropped)")
      ->capture_default_str();
  cmd->add_option("--expert-bytes", args->expert_bytes,
                  "Bytes of one expert's weights in one layer (default: DeepSeek-V3's, "
                  "3 x 7168 x 2048 FP8)")
      ->capture_default_str();
  cmd->add_option("--token-us", args->token_us,
                  "Microseconds one rank takes to pass one token through one expert: reports "
                  "the predicted MoE time per step in ms (0: in token-expert passes)")
      ->capture_default_str();
  cmd->add_option("--peers-per-round", args->peers_per_round,
                  "Peers a rank reads from (and serves) per round of a migration")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of the table");
  cmd->add_option("--spread", args->spread,
                  "Place from each expert's window sum plus this many standard deviations of "
                  "its per-step count (room for per-step dispatch; 0: the sum)")
      ->capture_default_str();
  cmd->add_option("--dispatch", args->dispatches,
                  "Score every step on its own at token level under these dispatches "
                  "(comma-separated: static, random, hash, weighted, split, adaptive), with the "
                  "dispatch and placement bounds; all, or none to skip")
      ->capture_default_str();
  cmd->add_option("--cost", args->cost,
                  "Score every step's modeled MoE time under a cost model: a preset "
                  "(h100-v3-decode, h200-v3-decode, tokens) or a JSON file of its parameters "
                  "(docs/dispatch.md); adds the adaptive_cost dispatch and the balanced_cost "
                  "policy");
  cmd->add_option("--min-gain", args->min_gain,
                  "A rebalance only when it pays: skip one whose modeled MoE time gain over the "
                  "next --interval steps is below this times its price (its bytes at --pull-gbps, "
                  "plus --stall-ms); needs --cost; 0: every rebalance happens (docs/dispatch.md)")
      ->capture_default_str();
  cmd->add_option("--pull-gbps", args->pull_gbps,
                  "With --min-gain: the GB/s each rank reads a rebalance's bytes at (measure it: "
                  "eplb bench transport)")
      ->capture_default_str();
  cmd->add_option("--stall-ms", args->stall_ms,
                  "With --min-gain: what a rebalance stalls the serving loop, in ms")
      ->capture_default_str();
  cmd->add_option("--sample-tokens", args->sample_tokens,
                  "With --load-history: draw this many tokens from the file's loads (top-k "
                  "experts each, as `eplb run` does) and group them into steps of "
                  "--tokens-per-step (for load files without steps)")
      ->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "Experts per token of --sample-tokens")
      ->capture_default_str();
  add_seed_option(cmd, args->seed, "Seed of --sample-tokens");
  cmd->add_option("--plot", args->plot_path,
                  "Draw balancedness per step per policy (and per dispatch), rebalances marked, "
                  "to a PNG (gnuplot)");
  cmd->callback([args] { run_simulate(*args); });
}

}  // namespace eplb::cli
