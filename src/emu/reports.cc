// The ranks' reports of `eplb run` merged into one result.

#include "emu/emulator.h"
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
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>
#include "emu/live_metrics.h"
#include "emu/serve.h"
#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "emu/serve.h"

namespace eplb::emu {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// Mean of values[first, last); 0 for an empty range.
double mean_of(const std::vector<StepFigures>& steps, int64_t first, int64_t last,
               double StepFigures::*field) {
  if (last <= first) return 0;
  double sum = 0;
  for (int64_t s = first; s < last; ++s) sum += steps[s].*field;
  return sum / static_cast<double>(last - first);
}

// What rank `rank` did in layer `l` of step `s`: its activated slots, tokens and CPU ns, and
// the experts that had a token in the layer (all ranks' tokens; -1 where the report has none).
struct RankLayer {
  int64_t slots = 0, tokens = 0, cpu_ns = 0, active = -1;
};

// Empty when the rank did not serve that step.
std::optional<RankLayer> rank_layer(const json& rank, int64_t s, int64_t l, int64_t layers) {
  if (!rank.contains("cost_samples")) return std::nullopt;
  const int64_t i = s - rank.value("first_step", int64_t{0});
  const json& all = rank["cost_samples"];
  const int64_t at = (i * layers + l) * 3;
  if (i < 0 || at + 3 > static_cast<int64_t>(all.size())) return std::nullopt;
  RankLayer x{.slots = all[at].get<int64_t>(),
              .tokens = all[at + 1].get<int64_t>(),
              .cpu_ns = all[at + 2].get<int64_t>()};
  if (rank.contains("active_experts")) {
    x.active = rank["active_experts"].at(i * layers + l).get<int64_t>();
  }
  return x;
}

// Each step's time balancedness: the sum over the layers of the mean rank CPU time over the sum
// of the largest, every rank that served the step counted (an idle one at its own time), and its
// means over both ranges.
void time_balancedness(const std::vector<json>& reports, int64_t layers, RunResult& result) {
  for (int64_t s = 0; s < static_cast<int64_t>(result.per_step.size()); ++s) {
    double sum_mean = 0, sum_max = 0;
    for (int64_t l = 0; l < layers; ++l) {
      double total = 0, most = 0;
      int64_t ranks = 0;
      for (const json& rank : reports) {
        const std::optional<RankLayer> x = rank_layer(rank, s, l, layers);
        if (!x) continue;
        total += static_cast<double>(x->cpu_ns);
        most = std::max(most, static_cast<double>(x->cpu_ns));
        ++ranks;
      }
      if (ranks == 0) continue;
      sum_mean += total / static_cast<double>(ranks);
      sum_max += most;
    }
    result.per_step[s].time_balancedness = sum_max > 0 ? sum_mean / sum_max : 1.0;
  }
  result.time_balancedness_before = mean_of(result.per_step, result.before_first,
                                            result.before_last, &StepFigures::time_balancedness);
  result.time_balancedness_after = mean_of(result.per_step, result.after_first, result.after_last,
                                           &StepFigures::time_balancedness);
}

// Every rank's (activated slots, tokens, CPU time) of every layer of the steps in [first, last)
// that `take` accepts, each with its step (the fit measures the noise within steps).
template <typename Take>
std::vector<placement::CostSample> cost_samples(const std::vector<json>& reports, int64_t layers,
                                                int64_t first, int64_t last, Take take) {
  std::vector<placement::CostSample> samples;
  for (int64_t s = first; s < last; ++s) {
    if (!take(s)) continue;
    for (const json& rank : reports) {
      for (int64_t l = 0; l < layers; ++l) {
        const std::optional<RankLayer> x = rank_layer(rank, s, l, layers);
        if (!x || x->tokens == 0) continue;  // idle in that layer: nothing to fit
        samples.push_back({.slots = static_cast<double>(x->slots),
                           .tokens = static_cast<double>(x->tokens),
                           .time_us = static_cast<double>(x->cpu_ns) / 1e3,
                           .step = s});
      }
    }
  }
  return samples;
}

// What model `m` says of step `s`: its MoE time, the sum over the layers of the layer time of
// the ranks' modeled times (the expected largest under the model's noise), and its floor, the
// same with every rank at the mean tokens and at the fewest activated slots (one per expert
// that had a token). The layer time never rises when the ranks' times are evened out, and the
// mean of the ranks' activated slots is at least the fewest, so the floor is at most the
// prediction, layer by layer (a floor above it by a rounding is taken down to it).
std::pair<double, double> predict_step(const placement::CostModel& m,
                                       const std::vector<json>& reports, int64_t s,
                                       int64_t layers) {
  double predicted = 0, floor = 0;
  std::vector<double> times, even;
  for (int64_t l = 0; l < layers; ++l) {
    double tokens = 0;
    int64_t active = -1;
    times.clear();
    for (const json& rank : reports) {
      const std::optional<RankLayer> x = rank_layer(rank, s, l, layers);
      if (!x) continue;
      times.push_back(m.linear_rank_time_us(static_cast<double>(x->slots),
                                            static_cast<double>(x->tokens)));
      tokens += static_cast<double>(x->tokens);
      if (active < 0) active = x->active;  // the same on every rank
    }
    const double layer = m.layer_time_us(times);
    predicted += layer;
    if (!times.empty() && active >= 0) {
      const auto n = static_cast<double>(times.size());
      even.assign(times.size(),
                  m.linear_rank_time_us(static_cast<double>(active) / n, tokens / n));
      floor += std::min(layer, m.layer_time_us(even));
    }
  }
  return {predicted, floor};
}

// The fit's error on steps it did not see: the steps [first, last) it was fitted on cut into
// kFolds sets by step (step i in set i mod kFolds), each predicted by a fit of the others; the
// error is the mean predicted MoE time over the mean measured one, less 1. Left unset where a
// set's fit fails.
void cross_validate(const std::vector<json>& reports, int64_t layers, int64_t first, int64_t last,
                    RunResult& result) {
  constexpr int64_t kFolds = 4;
  if (last - first < kFolds) return;
  double predicted = 0, measured = 0;
  for (int64_t fold = 0; fold < kFolds; ++fold) {
    const auto held = [&](int64_t s) { return (s - first) % kFolds == fold; };
    const std::vector<placement::CostSample> samples =
        cost_samples(reports, layers, first, last, [&](int64_t s) { return !held(s); });
    placement::CostModel m;
    try {
      m = placement::fit_cost_model(samples);
    } catch (const InvalidArgument&) {
      return;
    }
    for (int64_t s = first; s < last; ++s) {
      if (!held(s)) continue;
      predicted += predict_step(m, reports, s, layers).first / 1e3;
      measured += result.per_step[s].moe_ms;
    }
  }
  if (!(measured > 0)) return;
  result.cost_model->heldout_error = predicted / measured - 1;
  result.cost_model->heldout_steps = last - first;
}

// The cost model of the run: fitted on every rank's (activated slots, tokens, CPU time) of every
// layer of every step before the "after" range (the "before" steps and those the first
// rebalance took; all of the "before" steps when there is no "after"), its noise measured within
// each step (placement/cost.h), its error on held-back steps (cross_validate), then each step's
// predicted MoE time and floor (predict_step) and their means over both ranges: the "after"
// steps out of sample. Too few steps for a fit leave no model, and say why.
void fit_and_predict(const std::vector<json>& reports, int64_t layers, RunResult& result) {
  const int64_t first = result.before_first;
  const int64_t last = result.has_after() ? result.after_first : result.before_last;
  const std::vector<placement::CostSample> samples =
      cost_samples(reports, layers, first, last, [](int64_t) { return true; });
  result.cost_samples = static_cast<int64_t>(samples.size());
  try {
    result.cost_model = placement::fit_cost_model(samples);
    result.cost_model->source = fmt::format("fit of {} (rank, layer) samples of steps {}-{}",
                                            samples.size(), first, last - 1);
  } catch (const InvalidArgument& e) {
    result.cost_fit_error = e.what();
    return;
  }
  cross_validate(reports, layers, first, last, result);
  const placement::CostModel& m = *result.cost_model;
  for (int64_t s = 0; s < static_cast<int64_t>(result.per_step.size()); ++s) {
    const auto [predicted, floor] = predict_step(m, reports, s, layers);
    result.per_step[s].moe_ms_predicted = predicted / 1e3;
    result.per_step[s].moe_ms_floor = floor / 1e3;
  }
  result.moe_ms_predicted_before = mean_of(result.per_step, result.before_first,
                                           result.before_last, &StepFigures::moe_ms_predicted);
  result.moe_ms_predicted_after = mean_of(result.per_step, result.after_first, result.after_last,
                                          &StepFigures::moe_ms_predicted);
  result.moe_ms_floor_before = mean_of(result.per_step, result.before_first, result.before_last,
                                       &StepFigures::moe_ms_floor);
  result.moe_ms_floor_after = mean_of(result.per_step, result.after_first, result.after_last,
                                      &StepFigures::moe_ms_floor);
}

}  // namespace

RunResult merge_reports(const RunOptions& options, const Workload& workload,
                        const std::vector<std::string>& reports) {
  EPLB_CHECK(!reports.empty(), "merge_reports: no report");
  std::vector<json> r;
  for (const std::string& text : reports) r.push_back(json::parse(text));
  const auto first_of = [&](const json& rank) { return rank.value("first_step", int64_t{0}); };
  // The reference: the lowest seat that served from the first step to the last (its per-step
  // figures are those of every rank: same tables, same global loads). A process --kill-rank
  // ended, or one that failed, left a report of the steps before it ended: it counts, but is a
  // reference only where no process that ended well served as many steps (a run that stops
  // where --kill-rank strikes has them tie, and only the survivors saw the stop).
  size_t ref = r.size();
  const auto rank_of = [&](const json& rank) {
    // Ended well first, then more steps, then the lower seat.
    return std::tuple(!rank.value("ended", std::string()).empty(), -rank["steps"].get<int64_t>(),
                      rank["rank"].get<int>());
  };
  for (size_t i = 0; i < r.size(); ++i) {
    if (first_of(r[i]) != 0) continue;
    if (ref == r.size() || rank_of(r[i]) < rank_of(r[ref])) ref = i;
  }
  EPLB_CHECK(ref < r.size(), "merge_reports: no rank served from the first step");
  const json& reference = r[ref];
  RunResult result;
  result.mode = options.mode;
  result.steps = reference["steps"].get<int64_t>();
  result.interrupted = reference["interrupted"].get<bool>();
  result.bytes_held = reference["bytes_held"].get<int64_t>();
  result.no_service_steps = reference.value("no_service_steps", int64_t{0});
  result.stopped = reference.value("stopped", std::string());
  // Elastic runs: the reference saw every change of the group from the first step on.
  if (reference.contains("losses")) {
    for (const json& loss : reference["losses"]) {
      LostRank lost;
      lost.rank = loss[1].get<int>();
      lost.step = loss[0].get<int64_t>();
      result.lost.push_back(std::move(lost));
    }
  }
  if (reference.contains("joins")) {
    result.rejoins = static_cast<int64_t>(reference["joins"].size());
  }
  result.kills = static_cast<int64_t>(result.lost.size());
  // Metrics: each seat's last process.
  std::map<int, size_t> last_of_seat;
  for (size_t i = 0; i < r.size(); ++i) {
    const int seat = r[i]["rank"].get<int>();
    const auto it = last_of_seat.find(seat);
    if (it == last_of_seat.end() || first_of(r[i]) > first_of(r[it->second])) {
      last_of_seat[seat] = i;
    }
  }
  std::vector<std::vector<prometheus::MetricFamily>> metrics;
  for (const auto& [seat, i] : last_of_seat) {
    metrics.push_back(runtime::families_from_json(r[i]["metrics"].dump()));
  }
  result.metrics = runtime::families_to_json(runtime::merge_families(metrics));
  result.per_step.resize(static_cast<size_t>(result.steps));
  for (int64_t s = 0; s < result.steps; ++s) {
    StepFigures& f = result.per_step[s];
    f.balancedness = reference["balancedness"][s].get<double>();
    f.installs = reference["installs"][s].get<int64_t>();
    if (reference.contains("unavailable")) {
      f.unavailable = reference["unavailable"][s].get<int>() != 0;
    }
    if (reference.contains("dropped")) f.dropped = reference["dropped"][s].get<int64_t>();
    result.unavailable_steps += f.unavailable ? 1 : 0;
    result.tokens_dropped += f.dropped;
    for (const json& rank : r) {
      const int64_t i = s - first_of(rank);
      if (i < 0 || i >= rank["steps"].get<int64_t>() - first_of(rank)) continue;
      f.moe_ms = std::max(f.moe_ms, rank["moe_ms"][i].get<double>());
      f.moe_wall_ms = std::max(f.moe_wall_ms, rank["moe_wall_ms"][i].get<double>());
      f.stall_ms = std::max(f.stall_ms, rank["stall_ms"][i].get<double>());
    }
  }
  for (const json& rank : r) {
    result.mismatches += rank["mismatches"].get<int64_t>();
    result.verified += rank["verified"].get<int64_t>();
    result.outputs += rank["computed"].get<int64_t>();
  }
  const json& history = reference["history"];
  for (size_t i = 0; i < history.size(); ++i) {
    const json& h = history[i];
    const int64_t index = h["index"].get<int64_t>();
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
    f.gain_checked = h.value("gain_checked", false);
    f.below_min_gain = h.value("below_min_gain", false);
    f.priced = h.value("priced", false);
    f.moe_ms_modeled_before = h.value("moe_us_before", 0.0) / 1e3;
    f.moe_ms_modeled_after = h.value("moe_us_after", 0.0) / 1e3;
    f.predicted_gain_ms = h.value("gain_us", 0.0) / 1e3;
    f.price_ms = h.value("price_us", 0.0) / 1e3;
    result.rebalances_below_min_gain += f.below_min_gain ? 1 : 0;
    f.repair = h.value("repair", false);
    for (const json& rank : r) {
      for (const json& mine : rank["history"]) {
        if (mine["index"].get<int64_t>() != index) continue;
        f.bytes_installed += mine["bytes_installed"].get<int64_t>();
        f.bytes_restored += mine.value("bytes_restored", int64_t{0});
        f.stall_total_ms = std::max(f.stall_total_ms, mine["stall_total_ms"].get<double>());
        f.stall_max_ms = std::max(f.stall_max_ms, mine["stall_max_ms"].get<double>());
        f.stall_preempted_ms =
            std::max(f.stall_preempted_ms, mine.value("stall_preempted_ms", 0.0));
      }
    }
    ++result.rebalances_triggered;
    if (f.outcome == "completed") {
      ++result.rebalances;
      result.bytes_moved += f.bytes_moved;
      result.bytes_local_copy += f.bytes_local_copy;
      result.bytes_installed += f.bytes_installed;
    }
    result.restored_bytes += f.bytes_restored;
    result.stall_total_ms += f.stall_total_ms;
    result.stall_max_ms = std::max(result.stall_max_ms, f.stall_max_ms);
    result.stall_preempted_ms += f.stall_preempted_ms;
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
  time_balancedness(r, workload.layers, result);
  fit_and_predict(r, workload.layers, result);
  return result;
}

}  // namespace eplb::emu
