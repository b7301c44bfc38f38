// Trace replay: rebalance every `interval` steps from the last `window` steps, score the steps
// each placement serves (out of sample), account the moves of every rebalance.
//
// Cost. Scoring is the hot loop: every policy scores every (step, layer) after the first
// window. A placement is turned once into what scoring needs (per layer, each slot's expert and
// its share 1 / replica_count), so a (step, layer) costs P gathered multiply-adds and G
// comparisons, with no allocation. Window sums are shared by all policies, reused when a
// placement's window is the range the previous placement served, and otherwise updated by
// adding the steps that enter and subtracting those that leave when that is cheaper than
// summing afresh.

#include "eplb/sim/simulate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>

#include "eplb/core/error.h"
#include "eplb/placement/gain.h"
#include "eplb/placement/metrics.h"
#include "sim/names.h"

namespace eplb::sim {
namespace {

constexpr std::string_view kChoices = "deepseek, balanced, sticky, balanced_cost or none";

double ratio_or_one(double num, double den) { return den > 0 ? num / den : 1.0; }

void check_options(const stats::LoadHistory& history, const SimOptions& options) {
  options.layout.validate();
  if (history.steps < 1 || history.layers < 1 || history.experts < 1) {
    fail("the load history is empty (", history.steps, " steps x ", history.layers, " layers x ",
         history.experts, " experts)");
  }
  if (history.values.size() !=
      static_cast<size_t>(history.steps * history.layers * history.experts)) {
    fail("the load history holds ", history.values.size(), " values, expected ", history.steps,
         " x ", history.layers, " x ", history.experts);
  }
  if (history.experts != options.layout.experts) {
    fail("the load history has ", history.experts, " experts per layer but the layout has ",
         options.layout.experts);
  }
  if (options.interval < 1) fail("interval ", options.interval, " must be at least 1 step");
  if (options.window < 1) fail("window ", options.window, " must be at least 1 step");
  if (options.interval > kMaxSteps || options.window > kMaxSteps) {
    fail("interval ", options.interval, " and window ", options.window, " must be at most ",
         kMaxSteps, " steps");
  }
  if (options.window >= history.steps) {
    fail("window ", options.window, " leaves no step to score: the history has ", history.steps,
         history.steps == 1 ? " step" : " steps",
         " (the first placement is made from steps [0, window) and scored on the steps after it",
         history.steps < 2 ? ", so a replay needs a history of at least 2 steps)"
                           : ", so the window must be at most ",
         history.steps < 2 ? "" : std::to_string(history.steps - 1) + ")");
  }
  if (options.policies.empty()) fail("no policy to simulate (expected ", kChoices, ")");
  for (const SimPolicy& p : options.policies) {
    if (p.cost && !options.cost) {
      fail("policy ", p.name, " needs a cost model (--cost MODEL: a preset such as "
           "h100-v3-decode, or a JSON file of its parameters)");
    }
    if (p.cost && options.hierarchical) {
      fail("policy ", p.name, " is not hierarchical (drop --hierarchical or the policy)");
    }
  }
  if (options.cost) options.cost->validate();
  placement::check_min_gain(options.min_gain);
  if (options.min_gain > 0) {
    if (!options.cost) {
      fail("min_gain ", options.min_gain, " prices a rebalance's gain in modeled time: it needs "
           "a cost model (--cost MODEL: a preset such as h100-v3-decode, or a JSON file)");
    }
    if (!std::isfinite(options.pull_bytes_per_s) || !(options.pull_bytes_per_s > 0)) {
      fail("pull bandwidth ", options.pull_bytes_per_s,
           " bytes/s must be a finite number > 0 (what a rebalance's bytes move at)");
    }
    if (!std::isfinite(options.stall_us) || options.stall_us < 0) {
      fail("stall ", options.stall_us, " us must be a finite number >= 0");
    }
  }
  if (options.migration.expert_bytes < 1) {
    fail("expert bytes ", options.migration.expert_bytes,
         " must be at least 1 (the bytes of one expert's weights in one layer)");
  }
  if (options.migration.schedule.peers_per_round < 1) {
    fail("peers per round ", options.migration.schedule.peers_per_round, " must be at least 1");
  }
  if (!(options.spread >= 0) || !std::isfinite(options.spread)) {
    fail("spread ", options.spread, " must be a finite number of standard deviations >= 0");
  }
  if (!(options.tolerance >= 0 && options.tolerance < 1)) {
    fail("tolerance ", options.tolerance, " must be in [0, 1) (a loss of balancedness)");
  }
}

// Bad loads (negative, NaN, infinite) are caught on the passes that read the history anyway,
// elementwise so that those passes still vectorize: `least` keeps the least value seen of each
// (layer, expert) (0 until a negative one), and a NaN or infinite load leaves its sum NaN or
// infinite. A check of a sum and `least` after each pass costs a layer x experts loop. A layer
// whose sum passes kMaxLayerLoad is refused here, naming the steps, rather than by the policy
// (which would name a layer only) or not at all (the scored steps' sums feed only the bound,
// whose arithmetic would overflow into NaN).
void check_sum(const stats::LoadHistory& history, int64_t begin, int64_t end, const LoadMatrix& sum,
               const std::vector<double>& least) {
  bool ok = true;
  for (size_t i = 0; i < least.size(); ++i) {
    ok &= least[i] >= 0 && sum.values[i] <= std::numeric_limits<double>::max();
  }
  if (ok) {
    for (int64_t l = 0; l < sum.layers; ++l) {
      double total = 0;
      for (const double v : sum.row(l)) total += v;
      check_layer_total(l, total, eplb::detail::concat(" over steps [", begin, ", ", end, ")"));
    }
    return;
  }
  for (int64_t s = begin; s < end; ++s) {
    const double* step = history.step(s);
    for (int64_t i = 0; i < history.layers * history.experts; ++i) {
      if (!(step[i] >= 0) || step[i] > std::numeric_limits<double>::max()) {
        fail("load of step ", s, " layer ", i / history.experts, " expert ", i % history.experts,
             " is ", step[i], " (loads must be finite and non-negative)");
      }
    }
  }
  // Every load finite and non-negative: some (layer, expert)'s sum over the steps overflowed.
  for (size_t i = 0; i < sum.values.size(); ++i) {
    if (sum.values[i] <= std::numeric_limits<double>::max()) continue;
    const auto at = static_cast<int64_t>(i);
    fail("the loads of layer ", at / history.experts, " expert ", at % history.experts,
         ", each finite, sum over steps [", begin, ", ", end,
         ") past the largest double (1.8e308): scale the loads down");
  }
  fail("the loads of steps [", begin, ", ", end, ") overflow when summed");
}

// Sums of the history's loads over a range of steps, kept up to date as the range slides, and
// checked (check_sum) whenever they change.
class WindowSum {
 public:
  WindowSum(const stats::LoadHistory& history, std::vector<double>& least)
      : history_(history), least_(least), sum_(history.layers, history.experts) {}

  // Takes over the sum of steps [begin, end) computed (and checked) elsewhere, leaving `sum`
  // with values to be overwritten.
  void take(LoadMatrix& sum, int64_t begin, int64_t end) {
    std::swap(sum_.values, sum.values);
    begin_ = begin;
    end_ = end;
  }

  // Makes the sum cover steps [begin, end): by adding the entering and subtracting the leaving
  // steps when they are fewer than the new range, else afresh. Subtraction of what was added is
  // exact for integer loads; other loads may keep a rounding residue, clamped at 0 so that a
  // load never turns negative.
  const LoadMatrix& cover(int64_t begin, int64_t end) {
    if (begin == begin_ && end == end_) return sum_;
    const int64_t overlap = std::max<int64_t>(0, std::min(end, end_) - std::max(begin, begin_));
    const int64_t changes = (end - begin - overlap) + (end_ - begin_ - overlap);
    if (overlap > 0 && changes < end - begin) {
      for (int64_t s = begin_; s < std::min(begin, end_); ++s) add(s, -1.0);
      for (int64_t s = std::max(end, begin_); s < end_; ++s) add(s, -1.0);
      for (int64_t s = begin; s < std::min(begin_, end); ++s) add(s, 1.0);
      for (int64_t s = std::max(end_, begin); s < end; ++s) add(s, 1.0);
      for (double& v : sum_.values) v = std::max(v, 0.0);
    } else {
      std::fill(sum_.values.begin(), sum_.values.end(), 0.0);
      for (int64_t s = begin; s < end; ++s) add(s, 1.0);
    }
    begin_ = begin;
    end_ = end;
    check_sum(history_, begin, end, sum_, least_);
    return sum_;
  }

 private:
  void add(int64_t step, double sign) {
    const double* src = history_.step(step);
    double* dst = sum_.values.data();
    double* least = least_.data();
    const size_t n = sum_.values.size();
    for (size_t i = 0; i < n; ++i) {
      dst[i] += sign * src[i];
      least[i] = std::min(least[i], src[i]);
    }
  }

  const stats::LoadHistory& history_;
  std::vector<double>& least_;
  LoadMatrix sum_;
  int64_t begin_ = 0;
  int64_t end_ = 0;
};

// What scoring needs of a placement besides its phy2log: the share of its expert's load each
// slot receives (1 / replica count). [layers][physical]
std::vector<double> slot_shares(const Placement& placement) {
  std::vector<double> share(placement.phy2log.size());
  for (int64_t l = 0; l < placement.layers; ++l) {
    for (int64_t p = 0; p < placement.physical; ++p) {
      const auto i = static_cast<size_t>(l * placement.physical + p);
      const int32_t count = placement.replica_count[l * placement.experts + placement.phy2log[i]];
      share[i] = 1.0 / static_cast<double>(count);
    }
  }
  return share;
}

// placement::layer_lower_bound, with a shortcut for the common case where the mean rank load
// is reachable (past two slots per rank): when replica counts r_e = max(1, ceil(w_e / mean)) fit in the slots and give
// every replica at most the mean, the bound is the mean (no count vector does better than
// total / G, and the optimal one does at least as well as these). O(E) instead of a heap.
double lower_bound(std::span<const double> w, double mean, const Layout& layout) {
  // Not with two slots per rank: there every replica's partner counts too (two_slots.h).
  if (mean > 0 && layout.slots_per_rank() != 2) {
    int64_t slots = 0;
    bool fits = true;
    for (const double v : w) {
      const double r = std::max(1.0, std::ceil(v / mean));
      slots += static_cast<int64_t>(r);
      fits &= v / r <= mean;
    }
    if (fits && slots <= layout.physical) return mean;
  }
  return placement::layer_lower_bound(w, layout);
}

// The load a placement is made from under SimOptions::spread: each expert's window sum plus
// `z` standard deviations of its per-step count, times the window's steps, so that experts
// whose count swings from step to step weigh as their busier steps do.
const LoadMatrix& spread_load(const stats::LoadHistory& history, int64_t begin, int64_t end,
                              const LoadMatrix& sums, double z, LoadMatrix& out) {
  const auto steps = static_cast<double>(end - begin);
  std::fill(out.values.begin(), out.values.end(), 0.0);
  for (int64_t s = begin; s < end; ++s) {
    const double* step = history.step(s);
    for (size_t i = 0; i < out.values.size(); ++i) out.values[i] += step[i] * step[i];
  }
  for (size_t i = 0; i < out.values.size(); ++i) {
    const double mean = sums.values[i] / steps;
    const double variance = std::max(0.0, out.values[i] / steps - mean * mean);
    out.values[i] = sums.values[i] + z * steps * std::sqrt(variance);
  }
  // The sums were checked (check_sum): past the bound now, it is the spread that put them there,
  // and the message says so rather than blaming the loads.
  for (int64_t l = 0; l < out.layers; ++l) {
    double total = 0;
    for (const double v : out.row(l)) total += v;
    if (!(total <= kMaxLayerLoad)) {
      fail("spread ", z, " (--spread) takes the load placed from steps [", begin, ", ", end,
           ") of layer ", l, " to ", total, ", above ", kMaxLayerLoad,
           ", the most one layer's loads may sum to: give a smaller spread (a few standard "
           "deviations)");
    }
  }
  return out;
}

// Running sums of one policy's scores.
struct Score {
  double sum_balancedness = 0;  // over the (step, layer) with load
  int64_t scored = 0;           // how many: a layer without load at a step is dense, not scored
  double sum_mean = 0;          // of mean rank loads
  double sum_max = 0;           // of max rank loads
};

// Scores steps [begin, end) under one placement; appends each step's mean over layers.
// Step 1: each rank's load, the sum over its slots (contiguous: slot p is on rank
// p / slots_per_rank) of the slot's share of its expert's load. Step 2: mean / max, the mean
// taken over the same rank loads (so that it never exceeds the max by a rounding).
// With `served` ([layers][experts], zeroed by the caller), also sums the steps' loads into it
// and keeps `least` for check_sum, on the same pass over the history (the history is far
// larger than the caches: every pass over it costs).
void score_steps(const stats::LoadHistory& history, const Layout& layout,
                 const Placement& placement, const std::vector<double>& slot_share, int64_t begin,
                 int64_t end, Score& score, std::vector<double>& step_balancedness,
                 LoadMatrix* served, std::vector<double>& least) {
  const int64_t experts = history.experts;
  const int64_t physical = layout.physical;
  const int64_t per_rank = layout.slots_per_rank();
  const auto ranks = static_cast<double>(layout.ranks);
  for (int64_t s = begin; s < end; ++s) {
    const double* step = history.step(s);
    double step_sum = 0;
    int64_t step_layers = 0;
    for (int64_t l = 0; l < history.layers; ++l) {
      const double* w = step + l * experts;
      const int32_t* slots = placement.phy2log.data() + l * physical;
      const double* share = slot_share.data() + l * physical;
      if (served != nullptr) {
        double* sum = served->values.data() + l * experts;
        double* low = least.data() + l * experts;
        for (int64_t e = 0; e < experts; ++e) {
          sum[e] += w[e];
          low[e] = std::min(low[e], w[e]);
        }
      }
      // Step 1.
      double total = 0, most = 0;
      for (int64_t p = 0; p < physical; p += per_rank) {
        double load = 0;
        for (int64_t j = p; j < p + per_rank; ++j) load += w[slots[j]] * share[j];
        total += load;
        most = std::max(most, load);
      }
      // Step 2.
      const double mean = total / ranks;
      if (!(total > 0)) continue;  // dense (no load): left out of the means
      const double balancedness = mean / most;
      step_sum += balancedness;
      ++step_layers;
      score.sum_balancedness += balancedness;
      ++score.scored;
      score.sum_mean += mean;
      score.sum_max += most;
    }
    step_balancedness.push_back(step_layers > 0 ? step_sum / static_cast<double>(step_layers)
                                                : 1.0);
  }
}

// The state of one policy's run.
struct Run {
  const SimPolicy* policy = nullptr;
  Placement current;
  std::vector<double> slot_share;  // of current
  Score score;
  PolicyResult result;
};

}  // namespace

std::vector<SimPolicy> parse_policies(std::string_view list) {
  std::vector<SimPolicy> out;
  for (const std::string_view name : detail::split_names(list, "policy", kChoices)) {
    SimPolicy p;
    p.name = std::string(name);
    if (name == "none") {
      p.rebalances = false;
    } else if (name == "deepseek" || name == "balanced" || name == "sticky") {
      p.policy = placement::parse_policy(name);
    } else if (name == "balanced_cost") {
      p.policy = placement::Policy::kBalanced;
      p.cost = true;
    } else {
      fail("unknown policy '", name, "' (expected ", kChoices, ")");
    }
    out.push_back(std::move(p));
  }
  return out;
}

SimResult simulate(const stats::LoadHistory& history, const SimOptions& options) {
  check_options(history, options);
  const Layout& layout = options.layout;
  const int64_t steps = history.steps;

  SimResult out;
  out.steps = steps;
  out.layers = history.layers;
  out.first_scored_step = options.window;
  // The step after t comes from what is left, so no t + interval is formed (an interval past
  // the last step means one rebalance).
  for (int64_t t = options.window; t < steps;
       t = (steps - t > options.interval) ? t + options.interval : steps) {
    out.rebalance_steps.push_back(t);
  }
  const auto rebalances = static_cast<int64_t>(out.rebalance_steps.size());

  const Placement trivial = trivial_placement(history.layers, layout.experts, layout.physical);
  std::vector<Run> runs(options.policies.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    runs[i].policy = &options.policies[i];
    runs[i].current = trivial;
    runs[i].slot_share = slot_shares(trivial);
    runs[i].result.policy = options.policies[i].name;
    runs[i].result.step_balancedness.reserve(static_cast<size_t>(steps - options.window));
  }

  std::vector<double> least(static_cast<size_t>(history.layers * history.experts), 0.0);
  WindowSum window_sum(history, least);
  LoadMatrix spread(history.layers, history.experts);  // with options.spread
  LoadMatrix served(history.layers, history.experts);  // the steps one placement serves
  int64_t served_begin = -1, served_end = -1;
  double sum_bound_ratio = 0, sum_bound_mean = 0, sum_bound = 0;
  int64_t bound_layers = 0;  // (window, layer) with load
  for (int64_t k = 0; k < rebalances; ++k) {
    const int64_t t = out.rebalance_steps[k];

    // Step 1: every policy places from the window before t and pays the moves from the
    // placement it had. The steps the previous placement served are often this very window
    // (interval == window): their sum is at hand.
    if (served_begin == t - options.window && served_end == t) {
      window_sum.take(served, served_begin, served_end);
    }
    const LoadMatrix& window_sums = window_sum.cover(t - options.window, t);
    const LoadMatrix& window = options.spread > 0 ? spread_load(history, t - options.window, t,
                                                                window_sums, options.spread, spread)
                                                  : window_sums;
    for (Run& run : runs) {
      if (!run.policy->rebalances) continue;
      placement::PolicyOptions po;
      po.policy = run.policy->policy;
      po.hierarchical = options.hierarchical;
      po.tolerance = options.tolerance;
      po.thorough = options.thorough && !run.policy->cost;
      if (run.policy->cost) {
        po.hierarchical = false;
        po.cost = options.cost;
        po.cost_steps = options.window;
      }
      // Only sticky reads the previous placement (place() checks whatever it is given).
      po.previous = po.policy == placement::Policy::kSticky ? &run.current : nullptr;
      Placement next = placement::place(window, layout, po);
      const migration::MigrationPlan plan =
          migration::plan_migration(run.current, next, layout, options.migration);
      Rebalance done{.step = t,
                     .moved_slots = placement::moved_slots(run.current, next),
                     .bytes = plan.totals.bytes_total,
                     .rounds = plan.totals.rounds};
      if (options.min_gain > 0) {
        // Does it pay? On the window's mean step (its sums, not a spread of them).
        LoadMatrix mean_step = window_sums;
        for (double& v : mean_step.values) v /= static_cast<double>(options.window);
        const placement::GainDecision d = placement::decide_rebalance(
            placement::modeled_step_us(*options.cost, mean_step, run.current, layout),
            placement::modeled_step_us(*options.cost, mean_step, next, layout),
            std::min(options.interval, steps - t),
            {.bytes = static_cast<double>(plan.totals.bytes_total),
             .bytes_per_s = options.pull_bytes_per_s,
             .stall_us = options.stall_us},
            options.min_gain);
        done.checked = true;
        done.modeled_us_before = d.current_us;
        done.modeled_us_after = d.proposed_us;
        done.gain_us = d.gain_us;
        done.price_us = d.price_us;
        done.bytes_planned = plan.totals.bytes_total;
        if (!d.rebalance) {
          done.skipped = true;
          done.moved_slots = done.bytes = done.rounds = 0;
        }
      }
      run.result.rebalances.push_back(done);
      if (done.skipped) {
        // The placement in force serves on: kept again as the one serving from t.
        if (options.keep_placements && k > 0) run.result.placements.push_back(run.current);
        continue;
      }
      // The placement that served until now is done: kept (moved, not copied) when asked.
      if (options.keep_placements && k > 0) {
        run.result.placements.push_back(std::move(run.current));
      }
      run.current = std::move(next);
      run.slot_share = slot_shares(run.current);
    }

    // Step 2: score the steps this placement serves, out of sample; the first policy's pass
    // also sums them.
    served_begin = t;
    served_end = t + std::min(options.interval, steps - t);
    std::fill(served.values.begin(), served.values.end(), 0.0);
    for (size_t i = 0; i < runs.size(); ++i) {
      score_steps(history, layout, runs[i].current, runs[i].slot_share, served_begin, served_end,
                  runs[i].score, runs[i].result.step_balancedness, i == 0 ? &served : nullptr,
                  least);
    }
    check_sum(history, served_begin, served_end, served, least);

    // Step 3: the best any placement could do on those steps.
    double window_ratio = 0;
    int64_t window_layers = 0;
    for (int64_t l = 0; l < served.layers; ++l) {
      const std::span<const double> w = served.row(l);
      double total = 0;
      for (const double v : w) total += v;
      if (!(total > 0)) continue;  // dense over these steps
      const double mean = total / static_cast<double>(layout.ranks);
      const double bound = lower_bound(w, mean, layout);
      window_ratio += ratio_or_one(mean, bound);
      ++window_layers;
      sum_bound_mean += mean;
      sum_bound += bound;
    }
    sum_bound_ratio += window_ratio;
    bound_layers += window_layers;
    out.window_lower_bound_balancedness.push_back(
        window_layers > 0 ? window_ratio / static_cast<double>(window_layers) : 1.0);
  }
  out.lower_bound_balancedness =
      bound_layers > 0 ? sum_bound_ratio / static_cast<double>(bound_layers) : 1.0;
  out.lower_bound_balancedness_step = ratio_or_one(sum_bound_mean, sum_bound);

  // Step 4: the figures of each policy.
  for (Run& run : runs) {
    PolicyResult& r = run.result;
    if (options.keep_placements) r.placements.push_back(std::move(run.current));
    r.balancedness = run.score.scored > 0
                         ? run.score.sum_balancedness / static_cast<double>(run.score.scored)
                         : 1.0;
    r.balancedness_step = ratio_or_one(run.score.sum_mean, run.score.sum_max);
    r.max_rank_load_per_step = run.score.sum_max / static_cast<double>(steps - options.window);
    double moved = 0, bytes = 0, rounds = 0, first_moved = -1;
    for (const Rebalance& b : r.rebalances) {
      if (b.skipped) continue;
      ++r.rebalances_done;
      r.bytes_moved += b.bytes;
      moved += static_cast<double>(b.moved_slots);
      bytes += static_cast<double>(b.bytes);
      rounds += static_cast<double>(b.rounds);
      if (first_moved < 0) first_moved = static_cast<double>(b.moved_slots);
    }
    if (r.rebalances_done > 0) {
      const auto n = static_cast<double>(r.rebalances_done);
      r.moved_slots_per_rebalance = moved / n;
      r.bytes_per_rebalance = bytes / n;
      r.rounds_per_rebalance = rounds / n;
      if (r.rebalances_done > 1) r.steady_moved_slots_per_rebalance = (moved - first_moved) / (n - 1);
    }
    out.policies.push_back(std::move(r));
  }
  out.layer_steps = steps * history.layers * static_cast<int64_t>(runs.size());
  return out;
}

stats::LoadHistory history_from_trace(const stats::RoutingTrace& trace, int64_t tokens_per_step,
                                      int64_t min_experts) {
  if (tokens_per_step < 1) {
    fail("tokens per step ", tokens_per_step, " must be at least 1");
  }
  if (tokens_per_step > trace.tokens) {
    fail("tokens per step ", tokens_per_step, " exceeds the trace's ", trace.tokens,
         " tokens (not even one step)");
  }
  if (trace.routes.size() != static_cast<size_t>(trace.layers * trace.tokens * trace.top_k)) {
    fail("the routing trace holds ", trace.routes.size(), " routes, expected ", trace.layers, " x ",
         trace.tokens, " x ", trace.top_k);
  }
  stats::LoadHistory out;
  out.format = stats::LoadFormat::kTrace;
  out.steps = trace.tokens / tokens_per_step;
  out.layers = trace.layers;
  out.experts = std::max(trace.experts, min_experts);
  out.values.assign(static_cast<size_t>(out.steps * out.layers * out.experts), 0.0);
  const int64_t tokens = out.steps * tokens_per_step;
  for (int64_t l = 0; l < trace.layers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t* route = trace.routes.data() + (l * trace.tokens + t) * trace.top_k;
      double* row = out.values.data() + ((t / tokens_per_step) * out.layers + l) * out.experts;
      for (int64_t i = 0; i < trace.top_k; ++i) {
        if (route[i] < 0 || route[i] >= out.experts) {
          fail("the routing trace sends token ", t, " of layer ", l, " to expert ", route[i],
               ", outside [0, ", out.experts, ")");
        }
        row[route[i]] += 1.0;
      }
    }
  }
  return out;
}

}  // namespace eplb::sim
