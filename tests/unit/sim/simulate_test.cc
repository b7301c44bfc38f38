// Trace replay: hand-computed answers on tiny histories, agreement with a plain re-computation
// through the placement metrics, determinism, policy lists and bad options.

#include "eplb/sim/simulate.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"

namespace eplb::sim {
namespace {

// A history of one layer whose steps are the given rows. [steps][experts]
stats::LoadHistory one_layer(const std::vector<std::vector<double>>& rows) {
  stats::LoadHistory h;
  h.steps = static_cast<int64_t>(rows.size());
  h.layers = 1;
  h.experts = static_cast<int64_t>(rows.front().size());
  for (const auto& row : rows) h.values.insert(h.values.end(), row.begin(), row.end());
  return h;
}

SimOptions options_for(const Layout& layout, int64_t interval, int64_t window,
                       const std::string& policies) {
  SimOptions o;
  o.layout = layout;
  o.interval = interval;
  o.window = window;
  o.policies = parse_policies(policies);
  o.migration.expert_bytes = 1000;
  return o;
}

// steps x layers x experts counts floor(lognormal(0, 1) * scale), from `seed`.
stats::LoadHistory lognormal_history(uint64_t seed, int64_t steps, int64_t layers,
                                     int64_t experts, double scale) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> draw(0.0, 1.0);
  stats::LoadHistory h;
  h.steps = steps;
  h.layers = layers;
  h.experts = experts;
  for (int64_t i = 0; i < steps * layers * experts; ++i) {
    h.values.push_back(std::floor(draw(rng) * scale));
  }
  return h;
}

// The summed loads of steps [begin, end) of `h`.
LoadMatrix window_sum(const stats::LoadHistory& h, int64_t begin, int64_t end) {
  LoadMatrix w(h.layers, h.experts);
  for (int64_t t = begin; t < end; ++t) {
    for (size_t i = 0; i < w.values.size(); ++i) {
      w.values[i] += h.values[t * h.layers * h.experts + i];
    }
  }
  return w;
}

const PolicyResult& result_of(const SimResult& r, const std::string& name) {
  for (const PolicyResult& p : r.policies) {
    if (p.policy == name) return p;
  }
  throw std::runtime_error("no result for " + name);
}

// Two experts on 4 ranks of one slot each (P = 4). Under load A = (3, 1) only replica counts
// (3, 1) balance perfectly (every rank carries 1); (2, 2) leaves ranks at 1.5. Load B = (1, 3)
// is the mirror. The history flips between A and B every 2 steps, and each placement is made
// from the 2 steps before it, so every scored step is served by the placement of the other
// phase: three ranks carry 1/3 and one carries 3, mean 1, balancedness 1/3 at every scored step.
// The trivial placement (0, 1, 0, 1) carries 1.5 and 0.5 under both: 2/3. The lower bound of
// every scored window (loads 2A or 2B) is its mean: 1.
// Moves: from (0, 1, 0, 1) one slot turns to 0; each flip turns two slots; every moved slot is
// a read from the only rank holding the expert (1000 bytes), and that rank serves one reader
// per round: 1 round for the first rebalance, 2 for each flip.
TEST(Simulate, FlippingHotExpertIsScoredOutOfSample) {
  const std::vector<double> a = {3, 1}, b = {1, 3};
  const stats::LoadHistory h = one_layer({a, a, b, b, a, a, b, b});
  const Layout layout{.experts = 2, .physical = 4, .ranks = 4, .nodes = 1, .groups = 1};
  const SimResult r = simulate(h, options_for(layout, 2, 2, "deepseek,balanced,sticky,none"));

  EXPECT_EQ(r.first_scored_step, 2);
  EXPECT_EQ(r.rebalance_steps, (std::vector<int64_t>{2, 4, 6}));
  EXPECT_DOUBLE_EQ(r.lower_bound_balancedness, 1.0);
  EXPECT_DOUBLE_EQ(r.lower_bound_balancedness_step, 1.0);
  for (const char* name : {"deepseek", "balanced", "sticky"}) {
    SCOPED_TRACE(name);
    const PolicyResult& p = result_of(r, name);
    EXPECT_NEAR(p.balancedness, 1.0 / 3.0, 1e-12);
    EXPECT_NEAR(p.balancedness_step, 1.0 / 3.0, 1e-12);
    // Out of sample the hot expert (load 3) sits alone on one rank: every step waits for it.
    EXPECT_NEAR(p.max_rank_load_per_step, 3.0, 1e-12);
    ASSERT_EQ(p.step_balancedness.size(), 6u);
    for (const double s : p.step_balancedness) EXPECT_NEAR(s, 1.0 / 3.0, 1e-12);
    ASSERT_EQ(p.rebalances.size(), 3u);
    EXPECT_GE(p.rebalances[0].moved_slots, 1);
    EXPECT_GE(p.rebalances[1].moved_slots, 2);
    EXPECT_GE(p.rebalances[2].moved_slots, 2);
  }
  // sticky moves exactly the minimum.
  const PolicyResult& sticky = result_of(r, "sticky");
  const std::vector<std::array<int64_t, 4>> expected = {
      {2, 1, 1000, 1}, {4, 2, 2000, 2}, {6, 2, 2000, 2}};  // step, slots, bytes, rounds
  for (size_t k = 0; k < expected.size(); ++k) {
    SCOPED_TRACE(k);
    EXPECT_EQ(sticky.rebalances[k].step, expected[k][0]);
    EXPECT_EQ(sticky.rebalances[k].moved_slots, expected[k][1]);
    EXPECT_EQ(sticky.rebalances[k].bytes, expected[k][2]);
    EXPECT_EQ(sticky.rebalances[k].rounds, expected[k][3]);
  }
  EXPECT_DOUBLE_EQ(sticky.moved_slots_per_rebalance, 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(sticky.steady_moved_slots_per_rebalance, 2.0);
  EXPECT_DOUBLE_EQ(sticky.bytes_per_rebalance, 5000.0 / 3.0);
  EXPECT_DOUBLE_EQ(sticky.rounds_per_rebalance, 5.0 / 3.0);

  const PolicyResult& none = result_of(r, "none");
  EXPECT_NEAR(none.balancedness, 2.0 / 3.0, 1e-12);
  EXPECT_NEAR(none.balancedness_step, 2.0 / 3.0, 1e-12);
  EXPECT_NEAR(none.max_rank_load_per_step, 1.5, 1e-12);  // 3/2 + 1/2 on each rank
  EXPECT_TRUE(none.rebalances.empty());
  EXPECT_EQ(none.moved_slots_per_rebalance, 0);
  EXPECT_EQ(none.steady_moved_slots_per_rebalance, -1);
  EXPECT_EQ(r.layer_steps, 8 * 1 * 4);
}

// The in-sample case: a constant load (3, 1). Every rebalancing policy reaches 1, and sticky
// moves one slot at the first rebalance (from the trivial placement) and none afterwards.
TEST(Simulate, ConstantLoadIsPerfectAndStickyStopsMoving) {
  const std::vector<double> a = {3, 1};
  const stats::LoadHistory h = one_layer({a, a, a, a, a, a, a});
  const Layout layout{.experts = 2, .physical = 4, .ranks = 4, .nodes = 1, .groups = 1};
  const SimResult r = simulate(h, options_for(layout, 2, 3, "sticky,deepseek,none"));
  EXPECT_EQ(r.rebalance_steps, (std::vector<int64_t>{3, 5}));
  const PolicyResult& sticky = result_of(r, "sticky");
  EXPECT_DOUBLE_EQ(sticky.balancedness, 1.0);
  ASSERT_EQ(sticky.rebalances.size(), 2u);
  EXPECT_EQ(sticky.rebalances[0].moved_slots, 1);
  EXPECT_EQ(sticky.rebalances[1].moved_slots, 0);
  EXPECT_EQ(sticky.rebalances[1].bytes, 0);
  EXPECT_EQ(sticky.rebalances[1].rounds, 0);
  EXPECT_DOUBLE_EQ(result_of(r, "deepseek").balancedness, 1.0);
  // Trivial (0, 1, 0, 1) under (3, 1): ranks carry 1.5 and 0.5, mean 1.
  EXPECT_NEAR(result_of(r, "none").balancedness, 2.0 / 3.0, 1e-12);
}

// No redundancy, 4 experts on 2 ranks of 2 slots, load (6, 2, 1, 1), mean rank load 5. The
// trivial placement (0, 1 | 2, 3) carries 8 and 2: balancedness 5 / 8. The best placement pairs
// 0 with a 1-load expert: 7 and 3, so 5 / 7. With two slots per rank the lower bound knows
// that expert 0's replica needs a partner, and finds the optimum 7 (to its bisection's 1e-5):
// max(total / G, max_e w_e) = 6 alone would say 5 / 6.
TEST(Simulate, NoRedundancyHandComputed) {
  const std::vector<double> a = {6, 2, 1, 1};
  const stats::LoadHistory h = one_layer({a, a, a});
  const Layout layout{.experts = 4, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  const SimResult r = simulate(h, options_for(layout, 1, 1, "balanced,none"));
  EXPECT_NEAR(result_of(r, "balanced").balancedness, 5.0 / 7.0, 1e-12);
  EXPECT_NEAR(result_of(r, "none").balancedness, 5.0 / 8.0, 1e-12);
  EXPECT_NEAR(r.lower_bound_balancedness, 5.0 / 7.0, 1e-4);
  EXPECT_NEAR(r.lower_bound_balancedness_step, 5.0 / 7.0, 1e-4);
  EXPECT_GE(r.lower_bound_balancedness, 5.0 / 7.0);
}

// The same history with an all-zero (dense) layer beside it scores exactly as without: the
// dense layer is left out of every mean instead of counting as perfectly balanced.
TEST(Simulate, DenseLayersAreLeftOutOfTheMeans) {
  const std::vector<double> a = {6, 2, 1, 1};
  const stats::LoadHistory moe = one_layer({a, a, a});
  stats::LoadHistory both = moe;
  both.layers = 2;
  both.values.clear();
  for (int s = 0; s < 3; ++s) {
    both.values.insert(both.values.end(), {0, 0, 0, 0});
    both.values.insert(both.values.end(), a.begin(), a.end());
  }
  const Layout layout{.experts = 4, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  const SimResult r1 = simulate(moe, options_for(layout, 1, 1, "balanced,none"));
  const SimResult r2 = simulate(both, options_for(layout, 1, 1, "balanced,none"));
  for (const char* p : {"balanced", "none"}) {
    EXPECT_DOUBLE_EQ(result_of(r2, p).balancedness, result_of(r1, p).balancedness) << p;
    EXPECT_DOUBLE_EQ(result_of(r2, p).balancedness_step, result_of(r1, p).balancedness_step);
    EXPECT_EQ(result_of(r2, p).step_balancedness, result_of(r1, p).step_balancedness) << p;
  }
  EXPECT_DOUBLE_EQ(r2.lower_bound_balancedness, r1.lower_bound_balancedness);
  // All dense: nothing to balance, no division by zero.
  stats::LoadHistory none = moe;
  std::fill(none.values.begin(), none.values.end(), 0.0);
  const SimResult r3 = simulate(none, options_for(layout, 1, 1, "balanced"));
  EXPECT_EQ(result_of(r3, "balanced").balancedness, 1.0);
  EXPECT_EQ(r3.lower_bound_balancedness, 1.0);
}

// A random history, multi-layer, with an interval below the window (the window sums slide) and
// a last window cut short: every figure equals a plain re-computation with place() and the
// placement metrics, step by step.
TEST(Simulate, AgreesWithPlainRecomputation) {
  const uint64_t seed = 20240611;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const stats::LoadHistory h = lognormal_history(seed, 23, 3, 16, 20);
  const Layout layout{.experts = 16, .physical = 24, .ranks = 4, .nodes = 2, .groups = 4};
  const int64_t interval = 3, window = 7;
  const SimResult r = simulate(h, options_for(layout, interval, window, "deepseek,sticky"));

  for (const PolicyResult& p : r.policies) {
    SCOPED_TRACE(p.policy);
    Placement current = trivial_placement(h.layers, h.experts, layout.physical);
    double sum_b = 0, sum_mean = 0, sum_max = 0;
    size_t k = 0;
    std::vector<double> steps;
    for (int64_t s = window; s < h.steps; ++s) {
      if ((s - window) % interval == 0) {
        const LoadMatrix w = window_sum(h, s - window, s);
        placement::PolicyOptions po;
        po.policy = placement::parse_policy(p.policy);
        po.previous = &current;
        Placement next = placement::place(w, layout, po);
        ASSERT_LT(k, p.rebalances.size());
        EXPECT_EQ(p.rebalances[k].step, s);
        EXPECT_EQ(p.rebalances[k].moved_slots, placement::moved_slots(current, next));
        ++k;
        current = std::move(next);
      }
      double step_b = 0;
      for (int64_t l = 0; l < h.layers; ++l) {
        const std::span<const double> load(h.step(s) + l * h.experts,
                                           static_cast<size_t>(h.experts));
        const std::vector<double> ranks =
            placement::rank_loads(load, current.layer_phy2log(l), layout);
        double total = 0, most = 0;
        for (const double x : ranks) {
          total += x;
          most = std::max(most, x);
        }
        const double b = placement::layer_balancedness(load, current.layer_phy2log(l), layout);
        step_b += b;
        sum_b += b;
        sum_mean += total / static_cast<double>(layout.ranks);
        sum_max += most;
      }
      steps.push_back(step_b / static_cast<double>(h.layers));
    }
    EXPECT_EQ(k, p.rebalances.size());
    const double scored = static_cast<double>((h.steps - window) * h.layers);
    EXPECT_NEAR(p.balancedness, sum_b / scored, 1e-12);
    EXPECT_NEAR(p.balancedness_step, sum_mean / sum_max, 1e-12);
    ASSERT_EQ(p.step_balancedness.size(), steps.size());
    for (size_t i = 0; i < steps.size(); ++i) EXPECT_NEAR(p.step_balancedness[i], steps[i], 1e-12);
    // The step-weighted lower bound bounds the step-weighted balancedness of every policy.
    EXPECT_LE(p.balancedness_step, r.lower_bound_balancedness_step + 1e-12);
  }
  // The lower bound of each scored window, from the window's summed loads.
  ASSERT_EQ(r.window_lower_bound_balancedness.size(), r.rebalance_steps.size());
  double sum_ratio = 0, sum_mean = 0, sum_bound = 0;
  for (size_t k = 0; k < r.rebalance_steps.size(); ++k) {
    const int64_t begin = r.rebalance_steps[k];
    const int64_t end = std::min(begin + interval, h.steps);
    double window_ratio = 0;
    for (int64_t l = 0; l < h.layers; ++l) {
      std::vector<double> w(static_cast<size_t>(h.experts), 0.0);
      for (int64_t s = begin; s < end; ++s) {
        for (int64_t e = 0; e < h.experts; ++e) w[e] += h.step(s)[l * h.experts + e];
      }
      double total = 0;
      for (const double x : w) total += x;
      const double mean = total / static_cast<double>(layout.ranks);
      const double bound = placement::layer_lower_bound(w, layout);
      window_ratio += mean / bound;
      sum_ratio += mean / bound;
      sum_mean += mean;
      sum_bound += bound;
    }
    EXPECT_NEAR(r.window_lower_bound_balancedness[k], window_ratio / 3.0, 1e-12);
  }
  EXPECT_NEAR(r.lower_bound_balancedness, sum_ratio / 18.0, 1e-12);
  EXPECT_NEAR(r.lower_bound_balancedness_step, sum_mean / sum_bound, 1e-12);
  // 16 scored steps served by rebalances at 7, 10, ..., 22: the last serves one step.
  EXPECT_EQ(r.rebalance_steps, (std::vector<int64_t>{7, 10, 13, 16, 19, 22}));
}

TEST(Simulate, IsDeterministic) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> draw(0, 50);
  stats::LoadHistory h;
  h.steps = 30;
  h.layers = 4;
  h.experts = 32;
  for (int64_t i = 0; i < h.steps * h.layers * h.experts; ++i) h.values.push_back(draw(rng));
  const Layout layout{.experts = 32, .physical = 40, .ranks = 8, .nodes = 2, .groups = 4};
  const SimOptions o = options_for(layout, 4, 6, "deepseek,balanced,sticky,none");
  const SimResult a = simulate(h, o);
  const SimResult b = simulate(h, o);
  ASSERT_EQ(a.policies.size(), b.policies.size());
  for (size_t i = 0; i < a.policies.size(); ++i) {
    EXPECT_EQ(a.policies[i].policy, b.policies[i].policy);
    EXPECT_EQ(a.policies[i].balancedness, b.policies[i].balancedness);
    EXPECT_EQ(a.policies[i].balancedness_step, b.policies[i].balancedness_step);
    EXPECT_EQ(a.policies[i].step_balancedness, b.policies[i].step_balancedness);
    ASSERT_EQ(a.policies[i].rebalances.size(), b.policies[i].rebalances.size());
    for (size_t k = 0; k < a.policies[i].rebalances.size(); ++k) {
      EXPECT_EQ(a.policies[i].rebalances[k].moved_slots, b.policies[i].rebalances[k].moved_slots);
      EXPECT_EQ(a.policies[i].rebalances[k].bytes, b.policies[i].rebalances[k].bytes);
      EXPECT_EQ(a.policies[i].rebalances[k].rounds, b.policies[i].rebalances[k].rounds);
    }
  }
  EXPECT_EQ(a.lower_bound_balancedness, b.lower_bound_balancedness);
  // A policy's result does not depend on which others run beside it.
  const SimResult alone = simulate(h, options_for(layout, 4, 6, "sticky"));
  EXPECT_EQ(alone.policies[0].balancedness, result_of(a, "sticky").balancedness);
  EXPECT_EQ(alone.policies[0].step_balancedness, result_of(a, "sticky").step_balancedness);
}

TEST(ParsePolicies, ListsInOrder) {
  const std::vector<SimPolicy> p = parse_policies("sticky, deepseek,none");
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].name, "sticky");
  EXPECT_TRUE(p[0].rebalances);
  EXPECT_EQ(p[0].policy, placement::Policy::kSticky);
  EXPECT_EQ(p[1].name, "deepseek");
  EXPECT_EQ(p[1].policy, placement::Policy::kDeepseek);
  EXPECT_EQ(p[2].name, "none");
  EXPECT_FALSE(p[2].rebalances);
  EXPECT_EQ(parse_policies("balanced").size(), 1u);
}

TEST(ParsePolicies, RejectsBadLists) {
  for (const char* bad : {"", " ", "deepseek,", ",sticky", "deepseek,,sticky", "greedy",
                          "deepseek,deepseek", "DeepSeek"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(parse_policies(bad), InvalidArgument);
  }
  try {
    parse_policies("deepseek,greedy");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'greedy'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sticky"), std::string::npos) << e.what();
  }
}

TEST(Simulate, RejectsBadOptions) {
  const stats::LoadHistory h = one_layer({{3, 1}, {3, 1}, {3, 1}, {3, 1}});
  const Layout layout{.experts = 2, .physical = 4, .ranks = 2, .nodes = 1, .groups = 1};
  const auto message = [&](SimOptions o) -> std::string {
    try {
      simulate(h, o);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no throw";
  };
  EXPECT_NE(message(options_for(layout, 0, 2, "sticky")).find("interval 0"), std::string::npos);
  EXPECT_NE(message(options_for(layout, 1, 0, "sticky")).find("window 0"), std::string::npos);
  EXPECT_NE(message(options_for(layout, 1, 4, "sticky")).find("window 4 leaves no step"),
            std::string::npos);
  SimOptions o = options_for(layout, 1, 1, "sticky");
  o.policies.clear();
  EXPECT_NE(message(o).find("no policy"), std::string::npos);
  o = options_for(layout, 1, 1, "sticky");
  o.migration.expert_bytes = 0;
  EXPECT_NE(message(o).find("expert bytes 0"), std::string::npos);
  o = options_for(layout, 1, 1, "sticky");
  o.layout.experts = 3;
  o.layout.physical = 6;
  EXPECT_NE(message(o).find("2 experts per layer but the layout has 3"), std::string::npos);
  stats::LoadHistory bad = h;
  bad.values[5] = -1;
  try {
    simulate(bad, options_for(layout, 1, 1, "sticky"));
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("step 2 layer 0 expert 1 is -1"), std::string::npos)
        << e.what();
  }
}

// An interval past the last step means one rebalance: the next trigger step (t + interval) is
// never formed, so no interval overflows; past kMaxSteps an interval is refused.
TEST(Simulate, IntervalPastTheEndRebalancesOnce) {
  std::vector<std::vector<double>> rows(12, {3, 1, 1, 1});
  const stats::LoadHistory history = one_layer(rows);
  const Layout layout{.experts = 4, .physical = 6, .ranks = 2, .nodes = 1, .groups = 1};
  for (const int64_t interval : {kMaxSteps, kMaxSteps - 3, int64_t{8}, int64_t{9}}) {
    const SimResult r = simulate(history, options_for(layout, interval, 4, "balanced"));
    EXPECT_EQ(r.rebalance_steps, (std::vector<int64_t>{4})) << interval;
    EXPECT_EQ(result_of(r, "balanced").step_balancedness.size(), 8u) << interval;
  }
  for (const int64_t interval : {kMaxSteps + 1, std::numeric_limits<int64_t>::max()}) {
    EXPECT_THROW(simulate(history, options_for(layout, interval, 4, "balanced")), InvalidArgument)
        << interval;
  }
}

// `thorough` reaches the policies: each rebalance serves what place() gives its window with
// PolicyOptions::thorough, and on these loads (two slots per rank, twice the slots of the
// experts, where the level sweep finds better counts) that is not the default's placement.
TEST(Simulate, ThoroughIsThePoliciesThorough) {
  const stats::LoadHistory h = lognormal_history(11, 12, 2, 64, 50);
  const Layout layout{.experts = 64, .physical = 128, .ranks = 64, .nodes = 4, .groups = 1};
  std::vector<Placement> served[2];  // balanced's, default and thorough
  for (const bool thorough : {false, true}) {
    SCOPED_TRACE(thorough ? "thorough" : "default");
    SimOptions o = options_for(layout, 4, 4, "balanced,sticky");
    o.thorough = thorough;
    o.keep_placements = true;
    const SimResult r = simulate(h, o);
    for (const PolicyResult& p : r.policies) {
      SCOPED_TRACE(p.policy);
      Placement current = trivial_placement(h.layers, h.experts, layout.physical);
      ASSERT_EQ(p.placements.size(), r.rebalance_steps.size());
      for (size_t k = 0; k < r.rebalance_steps.size(); ++k) {
        const int64_t step = r.rebalance_steps[k];
        placement::PolicyOptions po;
        po.policy = placement::parse_policy(p.policy);
        po.previous = &current;
        po.thorough = thorough;
        current = placement::place(window_sum(h, step - o.window, step), layout, po);
        EXPECT_EQ(p.placements[k].phy2log, current.phy2log) << "rebalance " << k;
      }
    }
    served[thorough ? 1 : 0] = result_of(r, "balanced").placements;
  }
  ASSERT_EQ(served[0].size(), served[1].size());
  bool differ = false;
  for (size_t k = 0; k < served[0].size(); ++k) {
    differ |= served[0][k].phy2log != served[1][k].phy2log;
  }
  EXPECT_TRUE(differ) << "thorough changed no placement: the test shows nothing";
}

TEST(HistoryFromTrace, GroupsConsecutiveTokens) {
  stats::RoutingTrace t;
  t.layers = 2;
  t.tokens = 5;
  t.top_k = 2;
  t.experts = 4;
  // Layer 0: tokens route to (0,1) (0,2) (3,1) (2,3) (0,3); layer 1 all to (1,2).
  t.routes = {0, 1, 0, 2, 3, 1, 2, 3, 0, 3, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2};
  const stats::LoadHistory h = history_from_trace(t, 2, 6);
  EXPECT_EQ(h.steps, 2);  // the fifth token is a partial step, dropped
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 6);
  const std::vector<double> expected = {
      2, 1, 1, 0, 0, 0, 0, 2, 2, 0, 0, 0,   // step 0: layers 0 and 1
      0, 1, 1, 2, 0, 0, 0, 2, 2, 0, 0, 0};  // step 1
  EXPECT_EQ(h.values, expected);
  EXPECT_THROW(history_from_trace(t, 0), InvalidArgument);
  EXPECT_THROW(history_from_trace(t, 6), InvalidArgument);
}

}  // namespace
}  // namespace eplb::sim
