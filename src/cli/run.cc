// `eplb run`: the serving emulator (docs/run.md). G rank processes with real expert weights
// route a trace's tokens, compute every expert output, verify them, and rebalance live through
// the runtime; the summary says what rebalancing bought and what it cost the serving loop.

#include <fmt/core.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "emu/emulator.h"
#include "emu/workload.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/stats/load_file.h"

namespace eplb::cli {
namespace {

struct RunArgs {
  emu::RunOptions options;
  std::string trace;
  std::string load;
  int64_t top_k = 8;
  int64_t layers = -1;  // -1: 6 of the bundled DeepSeek-V3 loads, every layer of a given input
  int64_t sample_tokens = 4096;
  std::string verify = "16";
  bool compare = false;
  bool json = false;
  std::string plot;
  std::string metrics;
  bool verbose = false;
  std::string cost;  // --cost: adaptive_cost's and --min-gain's model, a preset or a JSON file
  // Given on the command line (not the defaults): --layers (whose default, -1, is no value a
  // user may give), and the options of sampled loads, which a --trace has no use for.
  bool layers_given = false;
  bool top_k_given = false;
  bool sample_tokens_given = false;
};

// --metrics FILE: every rank's metrics (of every mode with --compare) as one exposition.
void write_metrics(const std::string& path, const std::vector<emu::RunResult>& results) {
  std::vector<std::vector<prometheus::MetricFamily>> sets;
  for (const emu::RunResult& r : results) sets.push_back(runtime::families_from_json(r.metrics));
  stats::write_file(path, runtime::metrics_text(runtime::merge_families(sets)));
}

// Tokens per second the slowest rank allows: a step's tokens over its MoE time (CPU time of
// the busiest rank's expert compute), were nothing else in the step.
double tokens_per_s(const emu::RunOptions& o, double moe_ms) {
  return moe_ms > 0 ? static_cast<double>(o.ranks * o.tokens_per_rank) / (moe_ms / 1000) : 0;
}

// A figure of the "before" or "after" range, or null where the range has no step (a short run).
nlohmann::json figure(bool has, double value) { return has ? nlohmann::json(value) : nullptr; }

nlohmann::json to_json(const emu::RunOptions& o, const emu::RunResult& r) {
  nlohmann::json lost = nlohmann::json::array();
  for (const emu::LostRank& l : r.lost) {
    lost.push_back({{"rank", l.rank},
                    {"step", l.step >= 0 ? nlohmann::json(l.step) : nullptr},
                    {"planned", l.planned},
                    {"how", l.how}});
  }
  nlohmann::json rebalances = nlohmann::json::array();
  for (const emu::RebalanceFigures& f : r.per_rebalance) {
    rebalances.push_back({{"trigger_step", f.trigger_step},
                          {"end_step", f.end_step},
                          {"outcome", f.outcome},
                          {"error", f.error},
                          {"slots_moved", f.slots_moved},
                          {"bytes_moved", f.bytes_moved},
                          {"bytes_local_copy", f.bytes_local_copy},
                          {"bytes_installed", f.bytes_installed},
                          {"bytes_restored", f.bytes_restored},
                          {"repair", f.repair},
                          {"stall_total_ms", f.stall_total_ms},
                          {"stall_max_ms", f.stall_max_ms},
                          {"stall_preempted_ms", f.stall_preempted_ms},
                          {"predicted_balancedness_before", f.predicted_before},
                          {"predicted_balancedness_after", f.predicted_after},
                          {"gain_checked", f.gain_checked},
                          {"below_min_gain", f.below_min_gain},
                          {"priced", f.priced},
                          {"modeled_moe_ms_before", figure(f.gain_checked, f.moe_ms_modeled_before)},
                          {"modeled_moe_ms_after", figure(f.gain_checked, f.moe_ms_modeled_after)},
                          {"predicted_gain_ms", figure(f.gain_checked, f.predicted_gain_ms)},
                          {"price_ms", figure(f.gain_checked && f.priced, f.price_ms)}});
  }
  std::vector<double> balancedness, stall_ms, moe_ms, moe_wall_ms, moe_ms_predicted, moe_ms_floor,
      time_balancedness;
  for (const emu::StepFigures& f : r.per_step) {
    moe_ms_predicted.push_back(f.moe_ms_predicted);
    moe_ms_floor.push_back(f.moe_ms_floor);
    time_balancedness.push_back(f.time_balancedness);
    balancedness.push_back(f.balancedness);
    stall_ms.push_back(f.stall_ms);
    moe_ms.push_back(f.moe_ms);
    moe_wall_ms.push_back(f.moe_wall_ms);
  }
  return {{"mode", r.mode},
          {"ranks", o.ranks},
          {"nodes", o.nodes},
          {"transport", o.transport_backend()},
          {"weights", o.weights},
          {"steps", r.steps},
          {"interrupted", r.interrupted},
          {"rebalances", r.rebalances},
          {"rebalances_triggered", r.rebalances_triggered},
          {"rebalances_below_min_gain", r.rebalances_below_min_gain},
          {"min_gain", o.min_gain},
          {"stopped", r.stopped.empty() ? nullptr : nlohmann::json(r.stopped)},
          {"balancedness_before", figure(r.has_before(), r.balancedness_before)},
          {"balancedness_after", figure(r.has_after(), r.balancedness_after)},
          {"before_steps", r.has_before() ? nlohmann::json({r.before_first, r.before_last})
                                          : nlohmann::json(nullptr)},
          {"after_steps", r.has_after() ? nlohmann::json({r.after_first, r.after_last})
                                        : nlohmann::json(nullptr)},
          {"moe_ms_before", figure(r.has_before(), r.moe_ms_before)},
          {"moe_ms_after", figure(r.has_after(), r.moe_ms_after)},
          {"moe_ms_predicted_before",
           figure(r.has_before() && r.cost_model.has_value(), r.moe_ms_predicted_before)},
          {"moe_ms_predicted_after",
           figure(r.has_after() && r.cost_model.has_value(), r.moe_ms_predicted_after)},
          {"moe_ms_floor_before",
           figure(r.has_before() && r.cost_model.has_value(), r.moe_ms_floor_before)},
          {"moe_ms_floor_after",
           figure(r.has_after() && r.cost_model.has_value(), r.moe_ms_floor_after)},
          {"time_balancedness_before", figure(r.has_before(), r.time_balancedness_before)},
          {"time_balancedness_after", figure(r.has_after(), r.time_balancedness_after)},
          {"cost_model", r.cost_model ? nlohmann::json::parse(
                                            placement::cost_model_to_json(*r.cost_model))
                                      : nlohmann::json(nullptr)},
          {"cost_samples", r.cost_samples},
          {"cost_fit_error", r.cost_fit_error.empty() ? nlohmann::json(nullptr)
                                                      : nlohmann::json(r.cost_fit_error)},
          {"moe_wall_ms_before", figure(r.has_before(), r.moe_wall_ms_before)},
          {"moe_wall_ms_after", figure(r.has_after(), r.moe_wall_ms_after)},
          {"tokens_per_s_before", figure(r.has_before(), tokens_per_s(o, r.moe_ms_before))},
          {"tokens_per_s_after", figure(r.has_after(), tokens_per_s(o, r.moe_ms_after))},
          {"dispatch", o.dispatch},
          {"bytes_moved", r.bytes_moved},
          {"bytes_local_copy", r.bytes_local_copy},
          {"bytes_installed", r.bytes_installed},
          {"stall_max_ms", r.stall_max_ms},
          {"stall_total_ms", r.stall_total_ms},
          {"stall_preempted_ms", r.stall_preempted_ms},
          {"mismatches", r.mismatches},
          {"verified", r.verified},
          {"outputs", r.outputs},
          {"bytes_held_per_rank", r.bytes_held},
          {"kills", r.kills},
          {"lost", lost},
          {"rejoins", r.rejoins},
          {"tokens_dropped", r.tokens_dropped},
          {"unavailable_steps", r.unavailable_steps},
          {"no_service_steps", r.no_service_steps},
          {"restored_bytes", r.restored_bytes},
          {"wall_s", r.wall_s},
          {"per_rebalance", rebalances},
          {"per_step",
           {{"balancedness", balancedness},
            {"stall_ms", stall_ms},
            {"moe_ms", moe_ms},
            {"moe_wall_ms", moe_wall_ms},
            {"moe_ms_predicted", moe_ms_predicted},
            {"moe_ms_floor", moe_ms_floor},
            {"time_balancedness", time_balancedness}}}};
}

void print_header(const RunArgs& a, const emu::Workload& w) {
  const emu::RunOptions& o = a.options;
  const int64_t redundant = o.redundant_slots(w.experts);
  const std::string backend = o.transport_backend();
  const std::string transport =
      backend == "hybrid" ? "hybrid: shm within a node, UCX over TCP across" : backend;
  fmt::print(
      "eplb run: {} ranks on {} node{} ({}), {} layers x {} experts top-{}, {} slots per "
      "layer ({} redundant), {} tokens per rank per step\n",
      o.ranks, o.nodes, o.nodes > 1 ? "s" : "", transport, w.layers, w.experts, w.top_k,
      w.experts + redundant, redundant, o.tokens_per_rank);
  fmt::print("  experts: fp32 FFN hidden {} x intermediate {} ({} each, {}); tokens from {}\n",
             o.shape.hidden, o.shape.intermediate,
             human_bytes(o.shape.expert_bytes()),
             o.weights == "engine" ? "each rank's own tensors, registered" : "in eplb's arena",
             w.source);
  fmt::print("  {} steps, rebalance every {} steps from the last {} ({} policy, {} dispatch)\n\n",
             o.steps, o.interval, o.window, o.policy, o.dispatch);
}

// Why a run has no "after" steps: it ended before the split (docs/run.md, "The summary").
std::string no_after(const emu::RunOptions& o, const emu::RunResult& r) {
  if (r.mode == "off") {
    return fmt::format("no \"after\": the run ended before step {} (--interval), where EPLB off "
                       "splits it", o.interval);
  }
  return r.rebalances == 0
             ? std::string("no \"after\": no rebalance completed before the run ended")
             : std::string("no \"after\": the first rebalance ended with the run");
}

// The cost model fitted on the "before" steps, and its prediction beside the measured MoE time.
void print_prediction(const emu::RunResult& r) {
  if (!r.cost_model) {
    if (!r.cost_fit_error.empty()) fmt::print("  {:<14}no model: {}\n", "cost model", r.cost_fit_error);
    return;
  }
  fmt::print("  {:<14}{} ({})\n", "cost model", r.cost_model->describe(), r.cost_model->source);
  fmt::print("  {:<14}{}\n", "fit error", r.cost_model->describe_heldout());
  const auto side = [](bool has, double predicted, double measured) {
    return has ? fmt::format("{:.2f} ms (measured {:.2f}, {:+.1f}%)", predicted, measured,
                             (predicted / measured - 1) * 100)
               : std::string("none");
  };
  fmt::print("  {:<14}{}  ->  {}\n", "MoE predicted",
             side(r.has_before(), r.moe_ms_predicted_before, r.moe_ms_before),
             side(r.has_after(), r.moe_ms_predicted_after, r.moe_ms_after));
  // The floor: what no placement or dispatch of the same tokens beats under the model.
  const auto floor = [](bool has, double value, double measured) {
    return has ? fmt::format("{:.2f} ms ({:.3f} of the measured)", value, value / measured)
               : std::string("none");
  };
  fmt::print("  {:<14}{}  ->  {}  (the model, every layer's tokens and experts with a token "
             "spread evenly over the ranks)\n", "MoE floor",
             floor(r.has_before(), r.moe_ms_floor_before, r.moe_ms_before),
             floor(r.has_after(), r.moe_ms_floor_after, r.moe_ms_after));
}

// --min-gain: how many rebalances did not pay, and each check's predicted gain and price.
void print_gain_checks(const emu::RunOptions& o, const emu::RunResult& r) {
  if (!(o.min_gain > 0) || r.mode == "off") return;
  fmt::print("  {:<14}{} skipped: the MoE time predicted saved over the next {} steps below {} "
             "x the price\n", "min_gain", r.rebalances_below_min_gain, o.interval, o.min_gain);
  for (const emu::RebalanceFigures& f : r.per_rebalance) {
    if (!f.gain_checked) continue;
    fmt::print("  {:<14}step {}: {}, gain {:.3f} ms ({:.2f} -> {:.2f} ms modeled per step), "
               "price {}\n", "", f.trigger_step, f.below_min_gain ? "skipped" : f.outcome,
               f.predicted_gain_ms, f.moe_ms_modeled_before, f.moe_ms_modeled_after,
               f.priced ? fmt::format("{:.3f} ms", f.price_ms)
                        : std::string("none yet (no pull bandwidth measured)"));
  }
}

void print_result(const emu::RunOptions& o, const emu::RunResult& r) {
  fmt::print("  {:<14}{}{}\n", "mode", r.mode == "off" ? "off (no rebalancing)" : r.mode,
             r.interrupted ? fmt::format("  (interrupted at step {})", r.steps)
             : !r.stopped.empty() ? fmt::format("  (stopped after {} of {} steps)", r.steps,
                                                o.steps)
                                  : "");
  // Either side of "->" may have no steps in a short run: say so rather than print figures of
  // an empty range.
  const auto side = [&](bool has, const std::string& text) {
    return has ? text : std::string("none");
  };
  if (r.has_after()) {
    fmt::print("  {:<14}{}  ->  {:.3f} (steps {}-{})\n", "balancedness",
               side(r.has_before(), fmt::format("{:.3f} (steps {}-{})", r.balancedness_before,
                                                r.before_first, r.before_last - 1)),
               r.balancedness_after, r.after_first, r.after_last - 1);
  } else {
    fmt::print("  {:<14}{}  ->  {}\n", "balancedness",
               side(r.has_before(), fmt::format("{:.3f} (steps {}-{})", r.balancedness_before,
                                                r.before_first, r.before_last - 1)),
               no_after(o, r));
  }
  fmt::print("  {:<14}{}  ->  {}  (mean rank CPU time / the busiest's, per layer)\n",
             "time balance",
             side(r.has_before(), fmt::format("{:.3f}", r.time_balancedness_before)),
             side(r.has_after(), fmt::format("{:.3f}", r.time_balancedness_after)));
  if (r.has_before() && r.has_after()) {
    fmt::print(
        "  {:<14}{:.2f} ms  ->  {:.2f} ms  (max over ranks of expert compute, CPU time, "
        "same steps; wall {:.2f} -> {:.2f} ms)\n",
        "MoE per step", r.moe_ms_before, r.moe_ms_after, r.moe_wall_ms_before,
        r.moe_wall_ms_after);
    fmt::print("  {:<14}{:.0f}  ->  {:.0f} tokens/s  (what the slowest rank's MoE time allows)\n",
               "throughput", tokens_per_s(o, r.moe_ms_before), tokens_per_s(o, r.moe_ms_after));
  } else {
    fmt::print(
        "  {:<14}{}  ->  {}  (max over ranks of expert compute, CPU time, same steps; wall {} "
        "-> {})\n",
        "MoE per step", side(r.has_before(), fmt::format("{:.2f} ms", r.moe_ms_before)),
        side(r.has_after(), fmt::format("{:.2f} ms", r.moe_ms_after)),
        side(r.has_before(), fmt::format("{:.2f} ms", r.moe_wall_ms_before)),
        side(r.has_after(), fmt::format("{:.2f} ms", r.moe_wall_ms_after)));
    fmt::print("  {:<14}{}  ->  {}  (what the slowest rank's MoE time allows)\n", "throughput",
               side(r.has_before(),
                    fmt::format("{:.0f} tokens/s", tokens_per_s(o, r.moe_ms_before))),
               side(r.has_after(),
                    fmt::format("{:.0f} tokens/s", tokens_per_s(o, r.moe_ms_after))));
  }
  print_prediction(r);
  fmt::print("  {:<14}{} completed ({} triggered), {} moved, {} copied locally\n", "rebalances",
             r.rebalances, r.rebalances_triggered, human_bytes(r.bytes_moved),
             human_bytes(r.bytes_local_copy));
  print_gain_checks(o, r);
  fmt::print("  {:<14}max step {:.3f} ms, total {:.3f} ms (forward thread, in step_end; {:.3f} "
             "ms more waiting for a core)\n", "stall", r.stall_max_ms, r.stall_total_ms,
             r.stall_preempted_ms);
  if (o.elastic()) {
    // Every rank lost is named: the one --kill-rank ends, and any killed from outside eplb.
    const auto one = [](const emu::LostRank& l) {
      const std::string at =
          l.step >= 0 ? fmt::format("at step {}", l.step) : std::string("before it joined");
      return l.planned ? fmt::format("rank {} {} (--kill-rank)", l.rank, at)
                       : fmt::format("{}, from outside eplb, {}", l.how, at);
    };
    std::string lost = fmt::format("{} rank{} lost", r.lost.size(), r.lost.size() == 1 ? "" : "s");
    if (r.lost.size() == 1 && r.lost[0].planned && r.lost[0].step >= 0) {
      lost += fmt::format(" at step {} (rank {}, --kill-rank)", r.lost[0].step, r.lost[0].rank);
    } else {
      for (size_t i = 0; i < r.lost.size(); ++i) {
        lost += (i == 0 ? ": " : "; ") + one(r.lost[i]);
      }
    }
    fmt::print("  {:<14}{}; {} taken back{}; {} steps with some expert unavailable, {} with no "
               "service, {} top-k choices dropped (no replica); {} restored from the backup\n",
               "elastic", lost, r.rejoins,
               o.rejoin_at_step >= 0 && r.rejoins > 0
                   ? fmt::format(" at step {}", o.rejoin_at_step) : "",
               r.unavailable_steps, r.no_service_steps, r.tokens_dropped,
               human_bytes(r.restored_bytes));
  }
  if (!r.stopped.empty()) fmt::print("  {:<14}{}\n", "stopped", r.stopped);
  fmt::print("  {:<14}{} of {} expert outputs checked bit for bit, {} mismatches\n", "verified",
             r.verified, r.outputs, r.mismatches);
  fmt::print("  {:<14}{:.1f} s\n", "wall time", r.wall_s);
}

void print_compare(const emu::RunOptions& o, const std::vector<emu::RunResult>& results) {
  fmt::print("  {:<26}", "");
  for (const auto& r : results) fmt::print("{:>14}", r.mode);
  fmt::print("\n");
  const auto row = [&](const char* name, auto&& cell) {
    fmt::print("  {:<26}", name);
    for (const auto& r : results) fmt::print("{:>14}", cell(r));
    fmt::print("\n");
  };
  // "none" where a range has no step (a run too short for it).
  const auto cell = [](bool has, const char* format, double value) {
    return has ? fmt::format(fmt::runtime(format), value) : std::string("none");
  };
  row("balancedness before", [&](const emu::RunResult& r) {
    return cell(r.has_before(), "{:.3f}", r.balancedness_before);
  });
  row("balancedness after", [&](const emu::RunResult& r) {
    return cell(r.has_after(), "{:.3f}", r.balancedness_after);
  });
  row("MoE ms per step before",
      [&](const emu::RunResult& r) { return cell(r.has_before(), "{:.2f}", r.moe_ms_before); });
  row("MoE ms per step after",
      [&](const emu::RunResult& r) { return cell(r.has_after(), "{:.2f}", r.moe_ms_after); });
  row("MoE ms predicted after", [&](const emu::RunResult& r) {
    return cell(r.has_after() && r.cost_model.has_value(), "{:.2f}", r.moe_ms_predicted_after);
  });
  row("MoE ms floor after", [&](const emu::RunResult& r) {
    return cell(r.has_after() && r.cost_model.has_value(), "{:.2f}", r.moe_ms_floor_after);
  });
  row("time balance after", [&](const emu::RunResult& r) {
    return cell(r.has_after(), "{:.3f}", r.time_balancedness_after);
  });
  row("tokens/s before", [&](const emu::RunResult& r) {
    return cell(r.has_before(), "{:.0f}", tokens_per_s(o, r.moe_ms_before));
  });
  row("tokens/s after", [&](const emu::RunResult& r) {
    return cell(r.has_after(), "{:.0f}", tokens_per_s(o, r.moe_ms_after));
  });
  row("rebalances", [](const emu::RunResult& r) { return fmt::format("{}", r.rebalances); });
  if (o.min_gain > 0) {
    row("below min_gain", [](const emu::RunResult& r) {
      return r.mode == "off" ? std::string("-") : fmt::format("{}", r.rebalances_below_min_gain);
    });
  }
  row("bytes moved",
      [](const emu::RunResult& r) { return human_bytes(r.bytes_moved); });
  row("stall max step (ms)",
      [](const emu::RunResult& r) { return fmt::format("{:.3f}", r.stall_max_ms); });
  row("stall total (ms)",
      [](const emu::RunResult& r) { return fmt::format("{:.3f}", r.stall_total_ms); });
  row("mismatches", [](const emu::RunResult& r) { return fmt::format("{}", r.mismatches); });
  row("wall time (s)", [](const emu::RunResult& r) { return fmt::format("{:.1f}", r.wall_s); });
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::string dirs = path;
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string file = dirs.substr(start, end - start) + "/" + program;
    if (::access(file.c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

// Balancedness and step stall per step, one line per mode, rebalances marked.
void plot(const std::string& png, const std::vector<emu::RunResult>& results) {
  if (!on_path("gnuplot")) {
    fail<NotSupported>(
        "--plot needs gnuplot, which is not on PATH (Debian: apt-get install "
        "gnuplot-nox)");
  }
  const control::ScratchFolder scratch("eplb-plot");
  const std::string& dir = scratch.path();
  std::string marks, balance, stall;
  for (size_t i = 0; i < results.size(); ++i) {
    const emu::RunResult& r = results[i];
    const std::string data = fmt::format("{}/{}.dat", dir, r.mode);
    std::ofstream out(data);
    for (size_t s = 0; s < r.per_step.size(); ++s) {
      out << s << ' ' << r.per_step[s].balancedness << ' ' << r.per_step[s].stall_ms << '\n';
    }
    const std::string sep = i == 0 ? "" : ", ";
    balance += fmt::format("{}'{}' using 1:2 with lines lw 2 title '{}'", sep, data, r.mode);
    stall += fmt::format("{}'{}' using 1:3 with lines lw 2 title '{}'", sep, data, r.mode);
    for (const emu::RebalanceFigures& f : r.per_rebalance) {
      if (f.outcome != "completed") continue;
      marks += fmt::format("set arrow from {0},graph 0 to {0},graph 1 nohead dt 2 lc {1}\n",
                           f.trigger_step, i + 1);
      marks += fmt::format("set arrow from {0},graph 0 to {0},graph 1 nohead dt 3 lc {1}\n",
                           f.end_step, i + 1);
    }
  }
  const std::string script = fmt::format(
      "set terminal pngcairo size 1000,700 noenhanced\n"
      "set output '{}'\n"
      "set multiplot layout 2,1 title 'eplb run (dashed: rebalance triggered, dotted: installed)'\n"
      "set grid\nset key bottom right\n{}"
      "set ylabel 'balancedness (mean/max rank load)'\nset yrange [0:1.05]\n"
      "plot {}\n"
      "set yrange [*:*]\nset logscale y\nset xlabel 'step'\nset ylabel 'step_end stall (ms)'\n"
      "plot {}\nunset multiplot\n",
      png, marks, balance, stall);
  std::ofstream(dir + "/plot.gp") << script;
  // pngcairo may be missing from a minimal gnuplot: fall back to the plain png terminal.
  int rc = std::system(fmt::format("gnuplot '{}/plot.gp' 2>'{}/err.txt'", dir, dir).c_str());
  if (rc != 0) {
    std::string fallback = script;
    fallback.replace(fallback.find("pngcairo"), 8, "png");
    std::ofstream(dir + "/plot2.gp") << fallback;
    rc = std::system(fmt::format("gnuplot '{}/plot2.gp' 2>>'{}/err.txt'", dir, dir).c_str());
  }
  std::string err;
  if (rc != 0) {
    std::ifstream in(dir + "/err.txt");
    std::getline(in, err, '\0');
  }
  if (rc != 0) fail<IoError>("gnuplot failed to write ", png, ": ", err);
}

void run(RunArgs a) {
  if (!a.verbose) spdlog::set_level(spdlog::level::warn);
  emu::RunOptions& o = a.options;
  if (a.verify == "all") {
    o.verify_every = 1;
  } else if (a.verify == "sample") {
    o.verify_every = 16;
  } else {
    try {
      size_t used = 0;
      o.verify_every = std::stoll(a.verify, &used);
      if (used != a.verify.size()) throw std::invalid_argument("trailing");
    } catch (const std::exception&) {
      fail("--verify '", a.verify, "' is not all, sample or a number N (one token in N)");
    }
    if (o.verify_every < 1) {
      fail("--verify ", a.verify, " is not all, sample or a number N >= 1 (one token in N)");
    }
  }
  if (!a.trace.empty() && !a.load.empty()) fail("--trace and --load exclude each other");
  if (!a.trace.empty() && (a.top_k_given || a.sample_tokens_given)) {
    fail(a.top_k_given ? fmt::format("--top-k {}", a.top_k)
                       : fmt::format("--sample-tokens {}", a.sample_tokens),
         " is for sampled loads (--load, or the bundled ones): --trace ", a.trace,
         " replays its own tokens, with their own top-k");
  }
  if (a.layers_given && a.layers < 0) {
    fail("--layers ", a.layers, " must not be negative (N: the first N MoE layers; 0: all)");
  }
  if (!a.cost.empty()) {
    if (o.dispatch != "adaptive_cost" && !(o.min_gain > 0)) {
      fail("--cost ", a.cost, " is the model of adaptive_cost and of --min-gain: it needs "
           "--dispatch adaptive_cost (not ", o.dispatch, ") or a --min-gain above 0");
    }
    if (placement::is_cost_model_preset(a.cost)) {
      o.cost = placement::cost_model_preset(a.cost);
    } else {
      std::string text;
      try {
        text = stats::read_file(a.cost);
      } catch (const Error&) {
        fail("--cost '", a.cost, "' is neither a preset (h100-v3-decode, h200-v3-decode, tokens) "
             "nor a readable JSON file of cost model parameters");
      }
      o.cost = placement::cost_model_from_json(text, "--cost " + a.cost);
    }
  }
  // The default workload: tokens sampled from DeepSeek-V3's real, skewed expert loads, whose
  // imbalance rebalancing removes (docs/run.md).
  const bool bundled = a.trace.empty() && a.load.empty();
  const int64_t layers = a.layers_given ? a.layers : (bundled ? 6 : 0);
  emu::Workload workload =
      !a.trace.empty() ? emu::workload_from_trace(a.trace)
                       : emu::workload_from_load(bundled ? emu::default_load_path() : a.load,
                                                 a.top_k, a.sample_tokens, o.seed, layers);
  emu::keep_layers(workload, layers);  // a trace's; a load's are sampled as many already

  const bool launched = control::launched_by_mpirun() || std::getenv("RANK") != nullptr;
  if (launched) {
    if (a.compare) fail("--compare runs forked ranks: not under mpirun or a launcher");
    o.progress = false;
    o.transport = o.transport_backend(/*launched=*/true);
    const control::LaunchInfo info = *control::launch_info_from_env();
    o.ranks = info.size;  // as run_from_env sees them, for the summary
    if (info.local_size >= 1 && info.size % info.local_size == 0) {
      o.nodes = info.size / info.local_size;
    }
    const emu::RunResult r = emu::run_from_env(o, workload);
    const bool rank0 = info.rank == 0;
    if (rank0) {
      if (a.json) {
        fmt::print("{}\n", to_json(o, r).dump());
      } else {
        print_result(o, r);
      }
      if (!a.plot.empty()) plot(a.plot, {r});
      if (!a.metrics.empty()) write_metrics(a.metrics, {r});
    }
    if (r.mismatches > 0) fail<IoError>(r.mismatches, " expert outputs differ from the reference");
    return;
  }

  o.progress = !a.json && ::isatty(STDOUT_FILENO) != 0;
  if (a.compare && o.elastic()) {
    fail("--kill-rank runs one mode: drop --compare (or run each mode with --mode)");
  }
  std::vector<std::string> modes = {o.mode};
  if (a.compare) modes = {"off", "sync", "async"};
  o.validate(workload);
  if (!a.json) print_header(a, workload);
  std::vector<emu::RunResult> results;
  if (a.compare) {
    // The three runs go side by side, so that their MoE times meet the same machine: one after
    // the other, a noisy neighbour or a clock change during one run would decide the comparison.
    if (o.metrics_port > 65535 - 2) {
      fail("--metrics-port ", o.metrics_port,
           " with --compare serves three runs on PORT to "
           "PORT + 2: use a port up to 65533");
    }
    std::vector<emu::RunOptions> runs;
    for (size_t i = 0; i < modes.size(); ++i) {
      emu::RunOptions m = o;
      m.mode = modes[i];
      m.progress = false;
      if (o.metrics_port > 0) m.metrics_port = o.metrics_port + static_cast<int>(i);
      runs.push_back(std::move(m));
    }
    o.check_resources(workload, o.ranks * static_cast<int64_t>(runs.size()));
    results = emu::run_side_by_side(runs, workload);
  } else {
    emu::RunOptions m = o;
    results.push_back(emu::run_local(m, workload));
  }
  if (a.json) {
    if (a.compare) {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& r : results) out[r.mode] = to_json(o, r);
      fmt::print("{}\n", out.dump());
    } else {
      fmt::print("{}\n", to_json(o, results[0]).dump());
    }
  } else if (a.compare) {
    print_compare(o, results);
  } else {
    print_result(o, results[0]);
  }
  if (!a.plot.empty()) {
    plot(a.plot, results);
    if (!a.json) fmt::print("  plot written to {}\n", a.plot);
  }
  if (!a.metrics.empty()) {
    write_metrics(a.metrics, results);
    if (!a.json) fmt::print("  metrics written to {}\n", a.metrics);
  }
  int64_t mismatches = 0;
  bool interrupted = false;
  std::string stopped;  // an elastic run that could not serve every step: its summary is out
  for (const auto& r : results) {
    mismatches += r.mismatches;
    interrupted = interrupted || r.interrupted;
    if (!r.stopped.empty()) {
      stopped = fmt::format("the run stopped after {} of {} steps: {}", r.steps, o.steps,
                            r.stopped);
    }
  }
  if (mismatches > 0) {
    fail<IoError>(mismatches, " expert outputs differ from the reference (see docs/run.md)",
                  stopped.empty() ? "" : "; " + stopped);
  }
  if (!stopped.empty()) fail<IoError>(stopped);
  if (interrupted) {
    std::fflush(stdout);
    std::_Exit(130);
  }
}

}  // namespace

void add_run(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  emu::RunOptions& o = a->options;
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Serve MoE tokens (sampled from a load file, or a routing trace) on G emulated "
      "expert-parallel ranks, rebalancing live");
  cmd->add_option("--ranks", o.ranks, "Rank processes")->capture_default_str();
  cmd->add_option("--nodes", o.nodes, "Emulated nodes (cross-node reads: UCX over TCP)")
      ->capture_default_str();
  cmd->add_option("--tokens-per-rank", o.tokens_per_rank, "Tokens per rank per step")
      ->capture_default_str();
  cmd->add_option("--hidden", o.shape.hidden, "Expert hidden size")->capture_default_str();
  cmd->add_option("--intermediate", o.shape.intermediate, "Expert intermediate size")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps)->capture_default_str();
  cmd->add_option("--interval", o.interval, "Steps between rebalance triggers")
      ->capture_default_str();
  cmd->add_option("--window", o.window, "Steps of load history a placement sees")
      ->capture_default_str();
  cmd->add_option("--redundant", o.redundant,
                  "Redundant slots per layer (-1: one per rank; with --kill-rank, at least that "
                  "and enough for the survivors to hold every expert)")
      ->capture_default_str();
  cmd->add_option("--policy", o.policy, "deepseek, balanced or sticky")->capture_default_str();
  cmd->add_option("--mode", o.mode, "async, sync or off (no rebalancing)")->capture_default_str();
  cmd->add_option("--dispatch", o.dispatch,
                  "static, random, hash, weighted, split, adaptive (the step's best split from "
                  "its global counts) or adaptive_cost (the split of least modeled time)")
      ->capture_default_str();
  cmd->add_option("--cost", a->cost,
                  "The cost model of adaptive_cost and --min-gain: a preset (h100-v3-decode, "
                  "h200-v3-decode, tokens) or a JSON file of its parameters; default: fitted by "
                  "the ranks from their own times, for adaptive_cost at step --interval, for "
                  "--min-gain before every trigger (docs/dispatch.md)");
  cmd->add_option("--min-gain", o.min_gain,
                  "Skip a rebalance whose MoE time gain over the next --interval steps, "
                  "predicted by the cost model, is below this times its price (its bytes at the "
                  "pull bandwidth of the last rebalance, plus its stall); 0: never skip "
                  "(docs/runtime.md)")
      ->capture_default_str();
  cmd->add_option("--lag", o.lag, "Steps between an agreement and its action")
      ->capture_default_str();
  cmd->add_option("--verify", a->verify, "all, sample, or N: check the outputs of 1 token in N")
      ->capture_default_str();
  cmd->add_option("--trace", a->trace,
                  "Routing trace CSV to replay (e.g. the bundled "
                  "data/flame-moe-290m/routing_top6.csv)");
  cmd->add_option("--load", a->load,
                  "Load file to sample tokens from, any `eplb plan` format (default: the bundled "
                  "DeepSeek-V3 loads, data/deepseek-v3-sglang/prefill_in1024.json)");
  CLI::Option* top_k = cmd->add_option("--top-k", a->top_k, "With --load: experts per token")
                           ->capture_default_str();
  CLI::Option* layers = cmd->add_option(
      "--layers", a->layers,
      "Serve the first N MoE layers of the input (default: 6 of the bundled DeepSeek-V3 loads, "
      "every layer of a --trace or --load; 0: all)");
  CLI::Option* sample_tokens =
      cmd->add_option("--sample-tokens", a->sample_tokens, "With --load: tokens in one pass")
          ->capture_default_str();
  add_seed_option(cmd, o.seed, "Sampler and random dispatch seed");
  cmd->add_option("--transport", o.transport, "auto, shm, ucx or hybrid")->capture_default_str();
  cmd->add_option("--weights", o.weights,
                  "engine (each rank allocates its experts, eplb registers them) or arena (eplb "
                  "allocates them)")
      ->capture_default_str();
  cmd->add_option("--timeout-ms", o.timeout_ms, "Every collective and every batch of reads")
      ->capture_default_str();
  cmd->add_option("--kill-rank", o.kill_rank,
                  "Elastic serving: this rank's process kills itself at --at-step; the others "
                  "reconfigure, shrink, restore its experts and keep serving")
      ->capture_default_str();
  cmd->add_option("--at-step", o.kill_at_step, "The step --kill-rank ends its process at")
      ->capture_default_str();
  cmd->add_option("--rejoin-at-step", o.rejoin_at_step,
                  "With --kill-rank: a new process takes the rank back at this step")
      ->capture_default_str();
  cmd->add_option("--backup-copies", o.backup_copies,
                  "Host copies of every expert kept across the ranks (-1: 2 with --kill-rank, "
                  "else 0)")
      ->capture_default_str();
  cmd->add_flag("--compare", a->compare,
                "Run EPLB off, sync and async on the same workload, side by side (at the same "
                "time, so that they meet the same machine)");
  cmd->add_flag("--json", a->json, "Print one JSON object");
  cmd->add_option("--plot", a->plot, "Write balancedness and stall per step to a PNG (gnuplot)");
  cmd->add_flag("--verbose", a->verbose, "Log every rebalance");
  cmd->add_option("--metrics", a->metrics,
                  "Write every rank's metrics at the end (Prometheus text format, rank label)");
  cmd->add_option("--metrics-port", o.metrics_port,
                  "Serve the ranks' metrics on http://127.0.0.1:PORT/metrics while running "
                  "(under a launcher: each rank on PORT + its local rank; with --compare, off, "
                  "sync and async on PORT, PORT + 1, PORT + 2)");
  cmd->callback([a, top_k, layers, sample_tokens] {
    a->top_k_given = top_k->count() > 0;
    a->layers_given = layers->count() > 0;
    a->sample_tokens_given = sample_tokens->count() > 0;
    run(*a);
  });
}

}  // namespace eplb::cli
