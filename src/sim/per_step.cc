// Per-step scoring at token level (sim/per_step.h).
//
// Cost. For each scored (step, layer): the step's tokens are counted once per rank and expert
// ([ranks][experts]), shared by every policy; static, split and adaptive follow from those
// counts alone (O(ranks x experts)); hash, random and weighted choose per token as the router
// does; the best split is one flow (routing::adaptive_split) per policy, shared by `adaptive`
// and the dispatch bound; the placement bound places the step's layer afresh once, for all
// policies.

#include "eplb/sim/per_step.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/adaptive.h"
#include "eplb/routing/adaptive_cost.h"
#include "sim/names.h"

namespace eplb::sim {
namespace {

using routing::DispatchPolicy;

constexpr std::string_view kDispatchChoices =
    "static, random, hash, weighted, split, adaptive, adaptive_cost, all or none";

// Running sums of one score.
struct Sums {
  double ratio = 0;  // of mean / max over scored (step, layer)
  double mean = 0;
  double max = 0;
  int64_t scored = 0;
  double step_ratio = 0;  // this step's layers
  int64_t step_layers = 0;
  double modeled_us = 0;  // sum over scored (step, layer) of the largest modeled rank time

  void add_modeled(double us) { modeled_us += us; }

  void add(int64_t total, int64_t most, int64_t ranks) {
    if (total <= 0) return;  // no tokens at this layer: dense, left out
    const double mean_load = static_cast<double>(total) / static_cast<double>(ranks);
    ratio += mean_load / static_cast<double>(most);
    step_ratio += mean_load / static_cast<double>(most);
    mean += mean_load;
    max += static_cast<double>(most);
    ++scored;
    ++step_layers;
  }
  void end_step(StepScore& score) {
    score.step_balancedness.push_back(
        step_layers > 0 ? step_ratio / static_cast<double>(step_layers) : 1.0);
    step_ratio = 0;
    step_layers = 0;
  }
  void finish(StepScore& score, int64_t steps) const {
    score.balancedness = scored > 0 ? ratio / static_cast<double>(scored) : 1.0;
    score.balancedness_step = max > 0 ? mean / max : 1.0;
    score.max_rank_load_per_step = steps > 0 ? max / static_cast<double>(steps) : 0.0;
  }
  void finish_modeled(StepScore& score, int64_t steps) const {
    score.modeled_ms = steps > 0 ? modeled_us / 1e3 / static_cast<double>(steps) : 0.0;
  }
};

// The tokens of one (step, layer): each rank's count of every expert, and a way to visit each
// rank's tokens in order for the per-token dispatches.
class StepTokens {
 public:
  StepTokens(const stats::LoadHistory& history, const PerStepOptions& o, int64_t ranks)
      : history_(history),
        o_(o),
        ranks_(ranks),
        experts_(history.experts),
        counts_(static_cast<size_t>(ranks * history.experts)),
        global_(static_cast<size_t>(history.experts)) {}

  void load(int64_t step, int64_t layer) {
    step_ = step;
    layer_ = layer;
    std::fill(counts_.begin(), counts_.end(), 0);
    std::fill(global_.begin(), global_.end(), 0);
    if (o_.trace != nullptr) {
      const stats::RoutingTrace& tr = *o_.trace;
      const int64_t T = o_.tokens_per_step;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t g = i * ranks_ / T;
        const int32_t* route = tr.routes.data() + (layer * tr.tokens + step * T + i) * tr.top_k;
        for (int64_t k = 0; k < tr.top_k; ++k) ++counts_[g * experts_ + route[k]];
      }
    } else {
      const double* w = history_.step(step) + layer * experts_;
      for (int64_t e = 0; e < experts_; ++e) {
        const auto c = static_cast<int64_t>(std::llround(w[e]));
        if (c <= 0) continue;
        global_[e] = c;
        const int64_t base = c / ranks_, rest = c % ranks_;
        if (base > 0) {
          for (int64_t g = 0; g < ranks_; ++g) counts_[g * experts_ + e] = base;
        }
        if (rest == 0) continue;
        const auto offset = static_cast<int64_t>(mix64((static_cast<uint64_t>(step) << 32) ^
                                                       (static_cast<uint64_t>(layer) << 16) ^
                                                       static_cast<uint64_t>(e)) %
                                                 static_cast<uint64_t>(ranks_));
        for (int64_t j = 0, g = offset; j < rest; ++j, g = g + 1 == ranks_ ? 0 : g + 1) {
          ++counts_[g * experts_ + e];
        }
      }
      return;
    }
    for (int64_t g = 0; g < ranks_; ++g) {
      for (int64_t e = 0; e < experts_; ++e) global_[e] += counts_[g * experts_ + e];
    }
  }

  const std::vector<int64_t>& counts() const { return counts_; }  // [ranks][experts]
  const std::vector<int64_t>& global() const { return global_; }  // [experts]

  // Calls visit(rank, expert, token_index) for every token-expert pair of the step whose expert
  // has more than one replica in `tables`, each rank's in token order.
  template <typename Visit>
  void each_token(const routing::DispatchTables& tables, Visit&& visit) const {
    if (o_.trace != nullptr) {
      const stats::RoutingTrace& tr = *o_.trace;
      const int64_t T = o_.tokens_per_step;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t token = step_ * T + i;
        const int32_t* route = tr.routes.data() + (layer_ * tr.tokens + token) * tr.top_k;
        for (int64_t k = 0; k < tr.top_k; ++k) {
          if (tables.replica_count[route[k]] > 1) {
            visit(i * ranks_ / T, route[k], static_cast<uint64_t>(token));
          }
        }
      }
      return;
    }
    for (int64_t e = 0; e < experts_; ++e) {
      if (tables.replica_count[e] == 1) continue;
      for (int64_t g = 0; g < ranks_; ++g) {
        const int64_t c = counts_[g * experts_ + e];
        for (int64_t j = 0; j < c; ++j) {
          visit(g, static_cast<int32_t>(e),
                (static_cast<uint64_t>(step_) << 40) | (static_cast<uint64_t>(e) << 24) |
                    static_cast<uint64_t>(j));
        }
      }
    }
  }

 private:
  const stats::LoadHistory& history_;
  const PerStepOptions& o_;
  int64_t ranks_, experts_;
  int64_t step_ = 0, layer_ = 0;
  std::vector<int64_t> counts_;
  std::vector<int64_t> global_;
};

// One policy's state while scoring.
struct PolicyRun {
  const PolicyResult* replay = nullptr;
  std::vector<routing::DispatchTables> tables;  // [layers], of the placement in force
  std::vector<Sums> dispatch_sums;
  Sums dispatch_bound, placement_bound;
  std::vector<uint64_t> random_state;  // [ranks]
  routing::AdaptiveShares shares;
  routing::AdaptiveShares cost_shares;  // adaptive_cost's, with a cost model
  double cost_modeled_us = 0;           // this (step, layer)'s adaptive_cost modeled time
  PerStepPolicy out;
};

// A lower bound on the largest modeled rank time of any split of the step's counts over the
// placement in force (`t`), in us: each expert costs at least its cheapest split over its
// replicas (least_expert_time_us), so the ranks together pay at least the sum of those; an
// expert whose replicas are all on one rank pays it there; and some rank takes at least 1/d of
// an expert spread over d ranks. `forced` is scratch of one entry per rank.
double split_bound_us(const routing::DispatchTables& t, const std::vector<int64_t>& global,
                      const placement::CostModel& m, std::vector<double>& forced) {
  std::fill(forced.begin(), forced.end(), 0.0);
  double total = 0, single = 0;
  for (int64_t e = 0; e < t.experts; ++e) {
    const int32_t r = t.replica_count[e];
    if (global[e] <= 0 || r == 0) continue;
    const auto w = static_cast<double>(global[e]);
    const double least = placement::least_expert_time_us(m, w, r);
    total += least;
    int64_t distinct = 0, first = -1;
    bool one_rank = true;
    for (int32_t i = 0; i < r; ++i) {
      const int64_t g = t.log2phy[e * t.max_replicas + i] / t.slots_per_rank;
      bool seen = false;
      for (int32_t k = 0; k < i; ++k) {
        seen = seen || t.log2phy[e * t.max_replicas + k] / t.slots_per_rank == g;
      }
      if (!seen) ++distinct;
      if (first < 0) first = g;
      one_rank = one_rank && g == first;
    }
    if (one_rank) forced[static_cast<size_t>(first)] += least;
    single = std::max(single, placement::least_expert_time_us(m, w / static_cast<double>(distinct), r));
  }
  double most = std::max(total / static_cast<double>(t.ranks), single);
  for (const double f : forced) most = std::max(most, f);
  return m.rank_us + most;
}

}  // namespace

std::vector<DispatchPolicy> parse_dispatches(std::string_view list, bool with_cost) {
  const std::string_view whole = detail::trim(list);
  if (whole == "none") return {};
  if (whole == "all") {
    std::vector<DispatchPolicy> all = {DispatchPolicy::kStatic,   DispatchPolicy::kRandom,
                                       DispatchPolicy::kHash,     DispatchPolicy::kWeighted,
                                       DispatchPolicy::kSplit,    DispatchPolicy::kAdaptive};
    if (with_cost) all.push_back(DispatchPolicy::kAdaptiveCost);
    return all;
  }
  std::vector<DispatchPolicy> out;
  for (const std::string_view name : detail::split_names(list, "dispatch", kDispatchChoices)) {
    if (name == "all" || name == "none") {
      fail("dispatch list '", list, "': '", name, "' stands alone, not in a list");
    }
    out.push_back(routing::parse_dispatch_policy(name));
    if (out.back() == DispatchPolicy::kAdaptiveCost && !with_cost) {
      fail("dispatch adaptive_cost needs a cost model (--cost MODEL: a preset such as "
           "h100-v3-decode, or a JSON file of its parameters)");
    }
  }
  return out;
}

// Scoring a load history at token level reads each count as that many tokens: counts past
// kMostCount would overflow the sums (and past 2^63 the rounding), and the per-token dispatches
// (random, hash, weighted) visit every token-expert pair, so a history of huge counts would run
// for hours. Both are refused up front, naming the count and what would do instead.
namespace {

constexpr double kMostCount = 281474976710656.0;  // 2^48
constexpr double kMostVisits = 1e10;                // token-expert pairs over the whole run

void check_token_counts(const stats::LoadHistory& history,
                        const std::vector<DispatchPolicy>& dispatches) {
  const bool per_token =
      std::any_of(dispatches.begin(), dispatches.end(), [](DispatchPolicy d) {
        return d == DispatchPolicy::kRandom || d == DispatchPolicy::kHash ||
               d == DispatchPolicy::kWeighted;
      });
  double visits = 0;
  for (int64_t s = 0; s < history.steps; ++s) {
    const double* w = history.step(s);
    for (int64_t i = 0; i < history.layers * history.experts; ++i) {
      if (w[i] > kMostCount) {
        fail("per-step scoring reads each count as tokens, and step ", s, " layer ",
             i / history.experts, " expert ", i % history.experts, " has ", w[i],
             " (at most 2^48 = ", kMostCount, "); scale the history down, or score sampled "
             "tokens with --sample-tokens N");
      }
      visits += w[i];
    }
  }
  if (per_token && visits > kMostVisits) {
    fail("per-step scoring would visit ", visits, " token-expert pairs one by one (dispatches "
         "random, hash, weighted; at most ", kMostVisits, "): choose --dispatch "
         "static,split,adaptive, or score sampled tokens with --sample-tokens N");
  }
}

}  // namespace

PerStepResult score_per_step(const stats::LoadHistory& history, const SimOptions& options,
                             const SimResult& replay, const PerStepOptions& o) {
  const Layout& layout = options.layout;
  const int64_t G = layout.ranks, E = history.experts, L = history.layers;
  const int64_t spr = layout.slots_per_rank();
  EPLB_CHECK(!o.dispatches.empty() || o.bounds,
             "per-step scoring with no dispatch and no bounds has nothing to score");
  if (o.trace != nullptr) {
    EPLB_CHECK(o.tokens_per_step >= 1 && o.trace->layers == L &&
                   o.trace->tokens / o.tokens_per_step >= history.steps && o.trace->experts <= E,
               "the routing trace (", o.trace->layers, " layers, ", o.trace->tokens,
               " tokens) does not match the history it was grouped into (", L, " layers, ",
               history.steps, " steps of ", o.tokens_per_step, " tokens)");
  }
  if (o.trace == nullptr) check_token_counts(history, o.dispatches);
  PerStepResult result;
  std::vector<PolicyRun> runs(replay.policies.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    PolicyRun& run = runs[i];
    run.replay = &replay.policies[i];
    EPLB_CHECK(run.replay->placements.size() == replay.rebalance_steps.size() ||
                   (!run.replay->placements.empty() && run.replay->rebalances.empty()),
               "the replay of policy '", run.replay->policy,
               "' kept no placements (run simulate() with keep_placements)");
    run.out.policy = run.replay->policy;
    run.dispatch_sums.resize(o.dispatches.size());
    for (const DispatchPolicy d : o.dispatches) {
      run.out.dispatches.emplace_back();
      run.out.dispatches.back().name = routing::dispatch_policy_name(d);
    }
    run.out.dispatch_bound.name = "dispatch_bound";
    run.out.placement_bound.name = "placement_bound";
    run.random_state.resize(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      run.random_state[g] = mix64(o.seed * 1000003 + static_cast<uint64_t>(g) + 7 * i) | 1;
    }
  }
  const bool adaptive_needed =
      o.bounds || std::find(o.dispatches.begin(), o.dispatches.end(), DispatchPolicy::kAdaptive) !=
                      o.dispatches.end();
  const bool with_cost = o.cost.has_value();
  EPLB_CHECK(with_cost || std::find(o.dispatches.begin(), o.dispatches.end(),
                                    DispatchPolicy::kAdaptiveCost) == o.dispatches.end(),
             "dispatch adaptive_cost needs a cost model (PerStepOptions::cost)");
  const routing::CostTicks ticks = with_cost ? routing::cost_ticks(*o.cost) : routing::CostTicks{};

  StepTokens tokens(history, o, G);
  std::vector<int64_t> slot_load(static_cast<size_t>(layout.physical));
  std::vector<int64_t> rank_load(static_cast<size_t>(G));
  auto busiest = [&](int64_t& total) {
    std::fill(rank_load.begin(), rank_load.end(), 0);
    total = 0;
    for (int64_t p = 0; p < layout.physical; ++p) rank_load[p / spr] += slot_load[p];
    int64_t most = 0;
    for (const int64_t v : rank_load) {
      total += v;
      most = std::max(most, v);
    }
    return most;
  };
  std::vector<double> rank_time(static_cast<size_t>(G));
  // The largest modeled rank time of the slot loads in slot_load, in us.
  const auto modeled = [&] {
    std::fill(rank_time.begin(), rank_time.end(), o.cost->rank_us);
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (slot_load[p] > 0) {
        rank_time[p / spr] += o.cost->slot_time_us(static_cast<double>(slot_load[p]));
      }
    }
    return *std::max_element(rank_time.begin(), rank_time.end());
  };
  std::vector<int64_t> fresh_cost_share, fresh_cost_work;
  // The largest modeled rank time of shares over a layer's replicas, in us, evaluated as
  // `modeled` evaluates slot loads (the solver's ticks round the model's parameters).
  const auto modeled_shares = [&](const routing::AdaptiveLayer& v, const int64_t* share) {
    std::fill(rank_time.begin(), rank_time.end(), o.cost->rank_us);
    for (int64_t e = 0; e < v.experts; ++e) {
      for (int64_t i = 0; i < v.replica_count[e]; ++i) {
        const int64_t n = share[e * v.max_replicas + i];
        if (n > 0) {
          rank_time[v.log2phy[e * v.max_replicas + i] / spr] +=
              o.cost->slot_time_us(static_cast<double>(n));
        }
      }
    }
    return *std::max_element(rank_time.begin(), rank_time.end());
  };
  // The placement bound's fresh placement of one layer, with its own tables and shares.
  LoadMatrix one_layer(1, E);
  std::vector<int64_t> fresh_share, fresh_work;
  placement::PolicyOptions fresh_policy;
  fresh_policy.policy = placement::Policy::kBalanced;
  const int64_t steps_scored = replay.steps - replay.first_scored_step;

  for (size_t k = 0; k < replay.rebalance_steps.size(); ++k) {
    const int64_t begin = replay.rebalance_steps[k];
    const int64_t end =
        k + 1 < replay.rebalance_steps.size() ? replay.rebalance_steps[k + 1] : replay.steps;
    for (PolicyRun& run : runs) {
      // Every slot usable: a replay never loses a rank, so every expert has a replica (the
      // scoring below reads replica_count >= 1; no slot is -1).
      run.tables.clear();
      for (int64_t l = 0; l < L; ++l) {
        const std::vector<Placement>& served = run.replay->placements;
        run.tables.push_back(
            routing::build_dispatch_tables(served[std::min(k, served.size() - 1)], l, layout));
      }
    }
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t l = 0; l < L; ++l) {
        tokens.load(s, l);
        const std::vector<int64_t>& counts = tokens.counts();
        const std::vector<int64_t>& global = tokens.global();
        int64_t total = 0;
        for (const int64_t c : global) total += c;
        result.tokens += total;
        // A placement for this step alone, shared by every policy's placement bound.
        int64_t fresh_max = -1;
        double fresh_cost_us = 0;
        if (o.bounds && total > 0) {
          for (int64_t e = 0; e < E; ++e) one_layer.values[e] = static_cast<double>(global[e]);
          const Placement fresh = placement::place(one_layer, layout, fresh_policy);
          const routing::AdaptiveLayer view{
              .log2phy = fresh.log2phy.data(),
              .replica_count = fresh.replica_count.data(),
              .experts = static_cast<int32_t>(E),
              .max_replicas = static_cast<int32_t>(fresh.max_replicas),
              .ranks = static_cast<int32_t>(G),
              .slots_per_rank = static_cast<int32_t>(spr)};
          fresh_share.resize(static_cast<size_t>(E * fresh.max_replicas));
          fresh_work.resize(
              static_cast<size_t>(routing::adaptive_workspace_words(E, G, layout.physical)));
          fresh_max =
              routing::adaptive_split(view, global.data(), fresh_share.data(), fresh_work.data());
          if (with_cost) {
            fresh_cost_share.resize(fresh_share.size());
            fresh_cost_work.resize(static_cast<size_t>(routing::adaptive_cost_workspace_words(
                E, fresh.max_replicas, G, layout.physical)));
            routing::adaptive_cost_split(view, global.data(), ticks, fresh_cost_share.data(),
                                         fresh_cost_work.data());
            fresh_cost_us = modeled_shares(view, fresh_cost_share.data());
          }
        }
        for (PolicyRun& run : runs) {
          const routing::DispatchTables& t = run.tables[l];
          if (adaptive_needed && total > 0) routing::adaptive_shares(t, global, run.shares);
          if (with_cost && total > 0) {
            routing::adaptive_cost_shares(t, global, ticks, run.cost_shares);
            run.cost_modeled_us =
                modeled_shares(routing::adaptive_layer(t), run.cost_shares.share.data());
          }
          for (size_t d = 0; d < o.dispatches.size(); ++d) {
            std::fill(slot_load.begin(), slot_load.end(), 0);
            switch (o.dispatches[d]) {
              case DispatchPolicy::kStatic:
                for (int64_t e = 0; e < E; ++e) {
                  if (t.replica_count[e] == 1) {
                    slot_load[t.log2phy[e * t.max_replicas]] += global[e];
                    continue;
                  }
                  for (int64_t g = 0; g < G; ++g) {
                    slot_load[t.static_slot[g * E + e]] += counts[g * E + e];
                  }
                }
                break;
              case DispatchPolicy::kSplit:
                // Rank g's ordinals 0..c-1 of e go to replicas (j + offset) mod r: each gets
                // c / r, and the c mod r after the offset one more.
                for (int64_t e = 0; e < E; ++e) {
                  const int32_t r = t.replica_count[e];
                  if (r == 1) {
                    slot_load[t.log2phy[e * t.max_replicas]] += global[e];
                    continue;
                  }
                  for (int64_t g = 0; g < G; ++g) {
                    const int64_t c = counts[g * E + e];
                    if (c == 0) continue;
                    const int64_t offset = routing::split_replica(0, g, static_cast<int32_t>(e), r);
                    for (int32_t i = 0; i < r; ++i) {
                      slot_load[t.log2phy[e * t.max_replicas + i]] +=
                          c / r + ((i - offset + r) % r < c % r ? 1 : 0);
                    }
                  }
                }
                break;
              case DispatchPolicy::kAdaptive:
                // Routing by prefix realizes the shares exactly (routing's tests check it).
                if (total > 0) {
                  for (int64_t e = 0; e < E; ++e) {
                    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
                      slot_load[t.log2phy[e * t.max_replicas + i]] +=
                          run.shares.share[e * t.max_replicas + i];
                    }
                  }
                }
                break;
              case DispatchPolicy::kAdaptiveCost:
                if (total > 0) {
                  for (int64_t e = 0; e < E; ++e) {
                    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
                      slot_load[t.log2phy[e * t.max_replicas + i]] +=
                          run.cost_shares.share[e * t.max_replicas + i];
                    }
                  }
                }
                break;
              default: {
                // Per token, as the router chooses; an expert with one replica has no choice.
                const DispatchPolicy policy = o.dispatches[d];
                for (int64_t e = 0; e < E; ++e) {
                  if (t.replica_count[e] == 1)
                    slot_load[t.log2phy[e * t.max_replicas]] += global[e];
                }
                tokens.each_token(t, [&](int64_t g, int32_t e, uint64_t index) {
                  ++slot_load[routing::choose_slot(t, policy, e, index, g, run.random_state[g])];
                });
              }
            }
            int64_t sum = 0;
            const int64_t most = busiest(sum);
            run.dispatch_sums[d].add(sum, most, G);
            if (with_cost && total > 0) run.dispatch_sums[d].add_modeled(modeled());
          }
          if (o.bounds) {
            run.dispatch_bound.add(total, run.shares.max_rank_load, G);
            run.placement_bound.add(total, std::min(run.shares.max_rank_load, fresh_max), G);
            if (with_cost && total > 0) {
              run.dispatch_bound.add_modeled(split_bound_us(t, global, *o.cost, rank_time));
              run.placement_bound.add_modeled(std::min(fresh_cost_us, run.cost_modeled_us));
            }
          }
        }
      }
      for (PolicyRun& run : runs) {
        for (size_t d = 0; d < o.dispatches.size(); ++d) {
          run.dispatch_sums[d].end_step(run.out.dispatches[d]);
        }
        if (o.bounds) {
          run.dispatch_bound.end_step(run.out.dispatch_bound);
          run.placement_bound.end_step(run.out.placement_bound);
        }
      }
    }
  }
  for (PolicyRun& run : runs) {
    for (size_t d = 0; d < o.dispatches.size(); ++d) {
      run.dispatch_sums[d].finish(run.out.dispatches[d], steps_scored);
      if (with_cost) run.dispatch_sums[d].finish_modeled(run.out.dispatches[d], steps_scored);
    }
    if (o.bounds) {
      run.dispatch_bound.finish(run.out.dispatch_bound, steps_scored);
      run.placement_bound.finish(run.out.placement_bound, steps_scored);
      if (with_cost) {
        run.dispatch_bound.finish_modeled(run.out.dispatch_bound, steps_scored);
        run.placement_bound.finish_modeled(run.out.placement_bound, steps_scored);
      }
    }
    result.policies.push_back(std::move(run.out));
  }
  result.layer_steps = steps_scored * L * static_cast<int64_t>(runs.size());
  return result;
}

}  // namespace eplb::sim
