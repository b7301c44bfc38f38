// Per-step scoring under a cost model: every dispatch's modeled time is at least the bound,
// adaptive_cost is never above adaptive, the token model's modeled time is the token figure,
// and balanced_cost is a policy of the replay that needs a model.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/sim/per_step.h"
#include "eplb/sim/simulate.h"
#include "unit/sim/random_history.h"

namespace eplb::sim {
namespace {

using routing::DispatchPolicy;

SimOptions options_for(const Layout& layout, const std::string& policies,
                       const placement::CostModel& cost) {
  SimOptions o;
  o.layout = layout;
  o.interval = 4;
  o.window = 4;
  o.policies = parse_policies(policies);
  o.migration.expert_bytes = 1000;
  o.keep_placements = true;
  o.cost = cost;
  return o;
}

TEST(PerStepCost, AdaptiveCostNeverAboveAdaptiveAndNoneBelowTheBound) {
  const uint64_t seed = 31;
  std::mt19937 rng(seed);
  const stats::LoadHistory h = random_history(rng, 20, 3, 16, 3);
  const Layout layout{.experts = 16, .physical = 24, .ranks = 8, .nodes = 1, .groups = 1};
  for (const char* preset : {"h100-v3-decode", "tokens"}) {
    const placement::CostModel cost = placement::cost_model_preset(preset);
    const SimOptions o = options_for(layout, "none,deepseek,balanced,balanced_cost", cost);
    const SimResult replay = simulate(h, o);
    PerStepOptions po;
    po.dispatches = parse_dispatches("all", true);
    po.cost = cost;
    const PerStepResult r = score_per_step(h, o, replay, po);
    ASSERT_EQ(r.policies.size(), 4u);
    for (const PerStepPolicy& p : r.policies) {
      ASSERT_EQ(p.dispatches.size(), 7u);
      double adaptive = -1, adaptive_cost = -1;
      for (const StepScore& d : p.dispatches) {
        ASSERT_GE(d.modeled_ms, 0) << d.name;
        EXPECT_GE(d.modeled_ms, p.dispatch_bound.modeled_ms - 1e-9) << p.policy << " " << d.name;
        if (d.name == "adaptive") adaptive = d.modeled_ms;
        if (d.name == "adaptive_cost") adaptive_cost = d.modeled_ms;
        if (std::string(preset) == "tokens") {
          // 1 us per token: the modeled time is the busiest rank's tokens.
          EXPECT_NEAR(d.modeled_ms * 1e3, d.max_rank_load_per_step, 1e-6) << d.name;
        }
      }
      EXPECT_LE(adaptive_cost, adaptive * (1 + 1e-9)) << "seed " << seed << " " << p.policy;
      EXPECT_LE(p.placement_bound.modeled_ms, adaptive_cost + 1e-9);
    }
  }
}

TEST(PerStepCost, NeedsAModel) {
  EXPECT_THROW(parse_dispatches("adaptive_cost"), InvalidArgument);
  EXPECT_EQ(parse_dispatches("all").size(), 6u);
  EXPECT_EQ(parse_dispatches("all", true).size(), 7u);
  std::mt19937 rng(3);
  const stats::LoadHistory h = random_history(rng, 8, 1, 16, 3);
  const Layout layout{.experts = 16, .physical = 24, .ranks = 8, .nodes = 1, .groups = 1};
  SimOptions o = options_for(layout, "balanced_cost", placement::cost_model_preset("tokens"));
  o.cost.reset();
  try {
    simulate(h, o);
    FAIL() << "balanced_cost ran without a model";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("needs a cost model"));
  }
}

}  // namespace
}  // namespace eplb::sim

namespace eplb::sim {
namespace {

// A rebalance only when it pays: a price no gain reaches skips every rebalance, the placement in
// force (the trivial one) serves on, nothing moves, and per-step scoring sees the same steps as
// under `none`; a free one never skips a rebalance that gains; bad options are named.
TEST(SimMinGain, SkippedRebalancesMoveNothingAndKeepThePlacement) {
  std::mt19937 rng(41);
  const stats::LoadHistory h = random_history(rng, 24, 2, 16, 3);
  const Layout layout{.experts = 16, .physical = 24, .ranks = 8, .nodes = 1, .groups = 1};
  SimOptions o = options_for(layout, "none,balanced", placement::cost_model_preset("tokens"));
  o.min_gain = 1;
  o.pull_bytes_per_s = 1e9;
  o.stall_us = 1e12;  // no gain pays this
  const SimResult skipped = simulate(h, o);
  const PolicyResult& none = skipped.policies[0];
  const PolicyResult& balanced = skipped.policies[1];
  EXPECT_EQ(balanced.rebalances_done, 0);
  EXPECT_EQ(balanced.bytes_moved, 0);
  ASSERT_EQ(balanced.rebalances.size(), skipped.rebalance_steps.size());
  for (const Rebalance& b : balanced.rebalances) {
    EXPECT_TRUE(b.checked && b.skipped);
    EXPECT_EQ(b.bytes, 0);
    EXPECT_LT(b.gain_us, b.price_us);
  }
  EXPECT_EQ(balanced.step_balancedness, none.step_balancedness);
  ASSERT_EQ(balanced.placements.size(), skipped.rebalance_steps.size());
  for (const Placement& p : balanced.placements) EXPECT_EQ(p.phy2log, none.placements[0].phy2log);
  PerStepOptions po;
  po.dispatches = parse_dispatches("adaptive", true);
  po.cost = o.cost;
  const PerStepResult scored = score_per_step(h, o, skipped, po);
  EXPECT_EQ(scored.policies[1].dispatches[0].modeled_ms, scored.policies[0].dispatches[0].modeled_ms);

  o.stall_us = 0;
  o.pull_bytes_per_s = 1e300;  // moving is free: every rebalance that gains goes ahead
  const SimResult free = simulate(h, o);
  for (const Rebalance& b : free.policies[1].rebalances) {
    EXPECT_EQ(b.skipped, b.gain_us < 0) << b.step;
  }

  SimOptions bad = o;
  bad.min_gain = -1;
  EXPECT_THROW(simulate(h, bad), InvalidArgument);
  bad = o;
  bad.cost.reset();
  bad.policies = parse_policies("balanced");
  EXPECT_THROW(simulate(h, bad), InvalidArgument);
  bad = o;
  bad.pull_bytes_per_s = 0;
  EXPECT_THROW(simulate(h, bad), InvalidArgument);
}

}  // namespace
}  // namespace eplb::sim
