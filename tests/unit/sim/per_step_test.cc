// Per-step scoring: every dispatch is a split of the step's tokens, so none beats the dispatch
// bound; adaptive reaches it; the placement bound is never below it; a hand-computed case; the
// bundled trace's figures; bad input.

#include "eplb/sim/per_step.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"
#include "unit/sim/random_history.h"

namespace eplb::sim {
namespace {

using routing::DispatchPolicy;

SimOptions options_for(const Layout& layout, int64_t interval, int64_t window,
                       const std::string& policies) {
  SimOptions o;
  o.layout = layout;
  o.interval = interval;
  o.window = window;
  o.policies = parse_policies(policies);
  o.migration.expert_bytes = 1000;
  o.keep_placements = true;
  return o;
}

const StepScore& dispatch_of(const PerStepPolicy& p, const std::string& name) {
  for (const StepScore& s : p.dispatches) {
    if (s.name == name) return s;
  }
  throw std::runtime_error("no dispatch " + name);
}

TEST(PerStep, NoDispatchBeatsTheBoundAdaptiveReachesItPlacementBoundIsAbove) {
  std::mt19937 rng(21);
  const stats::LoadHistory h = random_history(rng, 24, 3, 16, 4);
  const Layout layout{.experts = 16, .physical = 24, .ranks = 4, .nodes = 2, .groups = 1};
  const SimOptions o = options_for(layout, 4, 4, "none,deepseek,balanced,sticky");
  const SimResult replay = simulate(h, o);
  PerStepOptions po;
  po.dispatches = parse_dispatches("all");
  const PerStepResult r = score_per_step(h, o, replay, po);
  ASSERT_EQ(r.policies.size(), 4u);
  EXPECT_EQ(r.layer_steps, 20 * 3 * 4);
  for (const PerStepPolicy& p : r.policies) {
    ASSERT_EQ(p.dispatches.size(), 6u);
    for (const StepScore& d : p.dispatches) {
      EXPECT_LE(d.balancedness, p.dispatch_bound.balancedness + 1e-12) << p.policy << " " << d.name;
      EXPECT_GE(d.max_rank_load_per_step, p.dispatch_bound.max_rank_load_per_step - 1e-9);
      ASSERT_EQ(d.step_balancedness.size(), 20u);
      for (size_t s = 0; s < 20; ++s) {
        EXPECT_LE(d.step_balancedness[s], p.dispatch_bound.step_balancedness[s] + 1e-12);
      }
    }
    EXPECT_DOUBLE_EQ(dispatch_of(p, "adaptive").balancedness, p.dispatch_bound.balancedness);
    EXPECT_GE(p.placement_bound.balancedness, p.dispatch_bound.balancedness);
    EXPECT_LE(p.placement_bound.balancedness, 1.0);
  }
  // Deterministic.
  const PerStepResult again = score_per_step(h, o, replay, po);
  EXPECT_EQ(again.policies[1].dispatches[1].step_balancedness,
            r.policies[1].dispatches[1].step_balancedness);
}

// One layer, 2 experts, 2 ranks of 2 slots: slots (0, 1 | 0, 0) after the first rebalance of a
// history where expert 0 is hot. A step with counts (6, 2): static sends rank 0's tokens of 0 to
// its own replica and rank 1's to one of its own; the best split gives rank 0 (expert 1's 2)
// 2 of expert 0's and rank 1 the other 4: loads 4 and 4, balancedness 1.
TEST(PerStep, HandComputedBestSplit) {
  stats::LoadHistory h;
  h.steps = 3;
  h.layers = 1;
  h.experts = 2;
  h.values = {6, 2, 6, 2, 6, 2};
  const Layout layout{.experts = 2, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  const SimOptions o = options_for(layout, 1, 1, "balanced");
  const SimResult replay = simulate(h, o);
  PerStepOptions po;
  po.dispatches = parse_dispatches("static,adaptive");
  const PerStepResult r = score_per_step(h, o, replay, po);
  const PerStepPolicy& p = r.policies.front();
  EXPECT_DOUBLE_EQ(p.dispatch_bound.balancedness, 1.0);
  EXPECT_DOUBLE_EQ(dispatch_of(p, "adaptive").balancedness, 1.0);
  EXPECT_DOUBLE_EQ(p.dispatch_bound.max_rank_load_per_step, 4.0);
  EXPECT_DOUBLE_EQ(p.placement_bound.balancedness, 1.0);
}

TEST(PerStep, BundledTraceAdaptiveNearsTheBound) {
  const std::string path = std::string(EPLB_SOURCE_DIR) + "/data/flame-moe-290m/routing_top6.csv";
  const stats::RoutingTrace trace = stats::parse_routing_trace(stats::read_file(path), 0, path);
  const stats::LoadHistory h = history_from_trace(trace, 128);
  const Layout layout{
      .experts = h.experts, .physical = h.experts + 8, .ranks = 8, .nodes = 1, .groups = 1};
  const SimOptions o = options_for(layout, 4, 4, "deepseek");
  const SimResult replay = simulate(h, o);
  PerStepOptions po;
  po.dispatches = parse_dispatches("split,adaptive");
  po.trace = &trace;
  po.tokens_per_step = 128;
  const PerStepResult r = score_per_step(h, o, replay, po);
  const PerStepPolicy& p = r.policies.front();
  EXPECT_GE(dispatch_of(p, "adaptive").balancedness, 0.90);
  EXPECT_GT(dispatch_of(p, "adaptive").balancedness, dispatch_of(p, "split").balancedness + 0.03);
  // Every token-expert pair of the scored steps: 12 steps x 8 layers x 128 tokens x 6.
  EXPECT_EQ(r.tokens, 12 * 8 * 128 * 6);
}

// SimOptions::spread places for the busier steps of volatile experts: in the window [0, 4)
// expert 0 swings between 12 and 0 tokens a step and expert 1 holds 6 every step; their sums
// are equal. On the sums alone the spare slot goes to light expert 2 (its two halves partner
// the two heavy experts: 24 + 2 per rank); the spread gives it to the volatile one.
TEST(PerStep, SpreadWeighsVolatileExperts) {
  stats::LoadHistory h;
  h.steps = 9;
  h.layers = 1;
  h.experts = 3;
  for (int s = 0; s < 9; ++s) {
    const double e0 = s % 2 == 0 ? 12 : 0;
    h.values.insert(h.values.end(), {e0, 6, 1});
  }
  const Layout layout{.experts = 3, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  SimOptions o = options_for(layout, 8, 4, "balanced");
  const SimResult plain = simulate(h, o);
  o.spread = 1;
  const SimResult spread = simulate(h, o);
  const auto& p0 = plain.policies[0].placements[0];
  const auto& p1 = spread.policies[0].placements[0];
  EXPECT_EQ(p1.replica_count[0], 2);  // the volatile expert gets the spare slot
  EXPECT_EQ(p0.replica_count[2], 2);
}

TEST(PerStep, RejectsBadInput) {
  std::mt19937 rng(2);
  const stats::LoadHistory h = random_history(rng, 8, 1, 4, 4);
  const Layout layout{.experts = 4, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  SimOptions o = options_for(layout, 2, 2, "balanced");
  o.keep_placements = false;
  const SimResult replay = simulate(h, o);
  PerStepOptions po;
  po.dispatches = parse_dispatches("hash");
  EXPECT_THROW(score_per_step(h, o, replay, po), InvalidArgument);
  for (const char* bad : {"", "hash,", "hash,hash", "roundrobin", "all,hash"}) {
    EXPECT_THROW(parse_dispatches(bad), InvalidArgument) << bad;
  }
  EXPECT_TRUE(parse_dispatches("none").empty());
  EXPECT_EQ(parse_dispatches(" split , adaptive").size(), 2u);
}

}  // namespace
}  // namespace eplb::sim
