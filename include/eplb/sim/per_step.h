#pragma once
// Per-step scoring at token level (docs/design.md layer `sim`): every MoE layer of every step waits
// for its busiest rank, so what a step pays is the balance of that step's tokens under the
// dispatch in use, not the balance of a window's sums. Given the placements a replay
// (simulate() with keep_placements) served each step with, this scores every scored step and
// layer:
//
//   per dispatch   the rank loads the dispatch realizes from the step's tokens (each rank's
//                  tokens sent through the layer's dispatch tables, as routing::route would);
//   dispatch_bound the best split of the step's counts over the replicas of the placement in
//                  force (routing::adaptive_split: exact, in whole tokens);
//   placement_bound a placement made for that step alone (`balanced` on its counts) with its best
//                  split, or the dispatch bound where that is better: never below it.
//
// Tokens. A routing trace gives them: step s holds tokens [s*T, (s+1)*T) (T tokens per step),
// token s*T + i comes from rank i * G / T (each rank a contiguous part of the batch, as the
// emulator and data-parallel attention ranks have it), and hash dispatch hashes the token's
// index in the trace. A load history has only counts: each is rounded to whole tokens and
// spread over the ranks evenly, the remainder rotating by (step, layer, expert); its tokens
// get synthetic indices (step, expert, ordinal) for hash dispatch.
//
// Pure and deterministic, like simulate(): `random` draws from per-rank streams of a fixed seed.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "eplb/placement/cost.h"
#include "eplb/routing/dispatch.h"
#include "eplb/sim/simulate.h"
#include "eplb/stats/load_file.h"

namespace eplb::sim {

// "static,adaptive" -> dispatches in order; "all" -> every one (adaptive_cost only when
// `with_cost`: it needs a cost model); "none" -> none. Unknown names, duplicates and empty names
// throw InvalidArgument naming them and the choices.
std::vector<routing::DispatchPolicy> parse_dispatches(std::string_view list,
                                                      bool with_cost = false);

struct PerStepOptions {
  std::vector<routing::DispatchPolicy> dispatches;  // what to score; may be empty
  bool bounds = true;                               // dispatch_bound and placement_bound
  // Where the tokens come from: a trace (with its tokens per step, as history_from_trace
  // grouped it) or, when null, the history's counts.
  const stats::RoutingTrace* trace = nullptr;
  int64_t tokens_per_step = 0;
  uint64_t seed = 1;  // of `random`
  // With a cost model (placement/cost.h) every score also has its modeled time (StepScore::
  // modeled_ms), `adaptive_cost` may be scored, and the bounds are time bounds too.
  std::optional<placement::CostModel> cost;
};

// One score: a dispatch's, or a bound's.
struct StepScore {
  std::string name;
  double balancedness = 1;       // mean over scored (step, layer) of mean / max rank load
  double balancedness_step = 1;  // sum of means / sum of maxima
  // The busiest rank's tokens summed over the layers, mean over the scored steps: the MoE
  // time a step waits for, in token-expert passes.
  double max_rank_load_per_step = 0;
  std::vector<double> step_balancedness;  // [scored steps]: mean over the layers
  // With a cost model: the modeled MoE time of a step, in ms: each layer's largest modeled rank
  // time (rank_us + the slot times of its activated slots, at the slot loads this score's
  // dispatch realizes) summed over the layers, mean over the scored steps. For dispatch_bound a
  // lower bound on any split over the placement in force (adaptive_cost_bound); for
  // placement_bound the modeled time of a placement made for each step alone with its
  // adaptive_cost split, or the policy's adaptive_cost where that is lower. -1 without a model.
  double modeled_ms = -1;
};

struct PerStepPolicy {
  std::string policy;
  std::vector<StepScore> dispatches;  // in the order of PerStepOptions::dispatches
  StepScore dispatch_bound;           // when bounds
  StepScore placement_bound;          // when bounds
};

struct PerStepResult {
  std::vector<PerStepPolicy> policies;  // in the replay's order
  int64_t layer_steps = 0;              // scored steps x layers x policies
  int64_t tokens = 0;                   // token-expert pairs scored per policy
};

// Scores `replay` (from simulate(history, options) with options.keep_placements) step by step.
// Throws InvalidArgument when the replay kept no placements, when the trace does not match the
// history, or for a dispatch list that is empty while bounds are off.
PerStepResult score_per_step(const stats::LoadHistory& history, const SimOptions& options,
                             const SimResult& replay, const PerStepOptions& per_step);

}  // namespace eplb::sim
