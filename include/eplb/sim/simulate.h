#pragma once
// Trace replay (docs/design.md layer `sim`): what rebalancing every `interval` steps would buy on a
// recorded load history, per placement policy. Pure: plain structs in, plain results out; no
// threads, no I/O, deterministic.
//
// The schedule, the same for every policy:
//
//   steps     0 .. window-1 | window .. window+interval-1 | window+interval .. | ... steps-1
//   placement   (trivial)   |  placed from [0, window)    |  placed from the window ending there
//   scored        no        |            yes              |           yes
//
// A rebalance happens at every step t = window + k * interval below `steps`; it places from the
// loads of steps [t - window, t) and that placement serves steps [t, next rebalance). Every
// scored step is thus scored out of sample, with a placement that never saw it (as the public
// ADRS EPLB benchmark does: plan on window i, score on window i + 1). The first `window` steps
// only feed the first placement; the run starts from the trivial placement (slot p holds expert
// p mod E, what engines start with), so the first rebalance's moves are counted from it.
// `sticky` takes the placement in force in its own run as its previous placement.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/migration/migration.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/policy.h"
#include "eplb/stats/load_file.h"

namespace eplb::sim {

// A policy of the replay: one of placement's policies, or `none` (never rebalance: the trivial
// placement throughout, the baseline the others are compared with).
struct SimPolicy {
  std::string name;  // "deepseek" | "balanced" | "sticky" | "none" | "balanced_cost"
  bool rebalances = true;
  placement::Policy policy = placement::Policy::kBalanced;  // when rebalances
  // balanced_cost: balanced under SimOptions::cost (placement::balanced_cost), from the
  // window's loads (its steps priced by the model).
  bool cost = false;
};

// "deepseek,sticky" -> two policies, in order ("balanced_cost": see SimPolicy). Names are trimmed of spaces; an empty list, an
// empty name, a duplicate or an unknown name throws InvalidArgument naming it and the choices.
std::vector<SimPolicy> parse_policies(std::string_view list);

struct SimOptions {
  Layout layout;                    // experts must be the history's
  int64_t interval = 0;             // steps between rebalances, >= 1
  int64_t window = 0;               // steps a placement is computed from, in [1, steps)
  std::vector<SimPolicy> policies;  // at least one
  bool hierarchical = false;        // balanced / sticky: pack groups to nodes first
  double tolerance = 0.01;          // sticky: accepted balancedness loss against balanced
  bool thorough = false;            // balanced / sticky: PolicyOptions::thorough
  // Migration accounting of each rebalance (expert_bytes >= 1, peers per round).
  migration::MigrationOptions migration;
  // Place from each expert's window sum plus `spread` standard deviations of its per-step
  // count (times the window's steps) instead of the sum alone: more room for the experts whose
  // count varies most, for per-step dispatch. 0: the sum (the default). >= 0.
  double spread = 0;
  // Keep every placement each policy served with (PolicyResult::placements), for the per-step
  // scoring of sim/per_step.h.
  bool keep_placements = false;
  // The cost model of balanced_cost (required by it; per-step scoring takes its own,
  // PerStepOptions::cost), and of min_gain's check.
  std::optional<placement::CostModel> cost;
  // A rebalance only when it pays (placement/gain.h): with min_gain > 0 each rebalance is
  // checked first, its modeled MoE time per step on the window's mean step with the placement
  // in force and with the new one (under `cost`, required), its gain over the next interval
  // against its price (the bytes it reads at pull_bytes_per_s, the group's bandwidth, plus
  // stall_us); one that does not pay min_gain times its price is skipped and the placement in
  // force serves on. 0: every rebalance happens.
  double min_gain = 0;
  double pull_bytes_per_s = 0;  // > 0 with min_gain
  double stall_us = 0;
};

// One rebalance of one policy: the moves from the placement in force to the new one.
struct Rebalance {
  int64_t step = 0;         // the first step the new placement serves
  int64_t moved_slots = 0;  // slots whose expert changed, all layers
  int64_t bytes = 0;        // bytes read from other ranks (migration totals' bytes_total)
  int64_t rounds = 0;       // rounds of reads, summed over the layers (layers move in turn)
  // min_gain's check, where made (checked): skipped (nothing moved: the figures above are 0),
  // and the decision's figures (placement::GainDecision).
  bool checked = false;
  bool skipped = false;
  double modeled_us_before = 0;  // per step, the placement in force
  double modeled_us_after = 0;   // per step, the new one
  double gain_us = 0;            // over the next interval
  double price_us = 0;
  int64_t bytes_planned = 0;     // the bytes it would have read
};

struct PolicyResult {
  std::string policy;
  // Scored (step, layer): the steps after the first window, each layer with load at that step
  // (a layer without load is dense and left out; every figure is 1 when nothing has load).
  double balancedness = 1;       // mean over scored (step, layer) of mean / max rank load
  double balancedness_step = 1;  // sum over scored (step, layer) of mean / sum of max
  // The predicted MoE time of a step, in units of one token's pass through one expert: the
  // busiest rank's load of each layer (every rank waits for it), summed over the layers, mean
  // over the scored steps. Multiply by the time of one token-expert to get a time.
  double max_rank_load_per_step = 0;
  std::vector<double> step_balancedness;  // [scored steps]: mean over layers, step by step
  std::vector<Rebalance> rebalances;      // [rebalances]; empty for `none`; skipped ones too
  int64_t rebalances_done = 0;            // not skipped by min_gain
  int64_t bytes_moved = 0;                // over the rebalances done
  // With SimOptions::keep_placements: [rebalances], the placement that served from each
  // rebalance step on; for `none`, one: the trivial placement that served throughout.
  std::vector<Placement> placements;
  // Means over the rebalances done (0 when there are none), the first one counted from the
  // trivial placement; steady_moved_slots_per_rebalance leaves the first one out (-1 with fewer
  // than two).
  double moved_slots_per_rebalance = 0;
  double bytes_per_rebalance = 0;
  double rounds_per_rebalance = 0;
  double steady_moved_slots_per_rebalance = -1;
};

struct SimResult {
  int64_t steps = 0;
  int64_t layers = 0;
  int64_t first_scored_step = 0;         // = window
  std::vector<int64_t> rebalance_steps;  // [rebalances]: window + k * interval
  // The best any placement could do on each scored window (the steps one placement serves),
  // from the window's summed loads: mean rank load / layer_lower_bound. The step-weighted
  // figure (sum of means / sum of bounds) bounds every policy's balancedness_step from above;
  // the mean over (window, layer) is its counterpart of `balancedness`.
  std::vector<double> window_lower_bound_balancedness;  // [rebalances]: mean over layers
  double lower_bound_balancedness = 1;
  double lower_bound_balancedness_step = 1;
  std::vector<PolicyResult> policies;  // in the order of SimOptions::policies
  int64_t layer_steps = 0;             // steps x layers x policies replayed (for a speed figure)
};

// Replays `history` under every policy of `options`. Throws InvalidArgument for a bad option or
// a history that does not fit the layout, naming the value and the rule.
SimResult simulate(const stats::LoadHistory& history, const SimOptions& options);

// Groups consecutive tokens of a routing trace into steps of `tokens_per_step` tokens (every
// layer's tokens t of step s = t / tokens_per_step); each listed expert of a token counts 1.
// A last, partial step is dropped. experts = max(trace.experts, min_experts).
// Throws InvalidArgument when tokens_per_step < 1 or exceeds the trace's tokens.
stats::LoadHistory history_from_trace(const stats::RoutingTrace& trace, int64_t tokens_per_step,
                                      int64_t min_experts = 0);

}  // namespace eplb::sim
