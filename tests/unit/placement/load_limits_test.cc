// Loads at the edge of what eplb takes: every policy and the metrics refuse a layer whose loads
// sum past kMaxLayerLoad with the layer and the sum (not an internal check, not NaN), and just
// below it every policy places equal loads evenly with finite figures.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/types.h"
#include "placement/deepseek.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"

namespace eplb::placement {
namespace {

constexpr Layout kLayout{.experts = 8, .physical = 10, .ranks = 2, .nodes = 1, .groups = 1};

LoadMatrix equal_load(double value) {
  LoadMatrix load(1, 8);
  std::fill(load.values.begin(), load.values.end(), value);
  return load;
}

std::string message_of_place(const LoadMatrix& load, Policy policy) {
  const Placement previous = trivial_placement(1, 8, 10);
  PolicyOptions options;
  options.policy = policy;
  options.previous = policy == Policy::kSticky ? &previous : nullptr;
  try {
    place(load, kLayout, options);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(LoadLimits, EveryPolicyRefusesALayerSummingPastTheBound) {
  // 1e308 is finite, eight of them are not; 5e37 x 8 = 4e38 is past float32's 3.4e38.
  for (const double value : {1e308, 5e37}) {
    for (const Policy policy : {Policy::kBalanced, Policy::kSticky, Policy::kDeepseek}) {
      const std::string what = message_of_place(equal_load(value), policy);
      EXPECT_NE(what.find("the loads of layer 0 sum to"), std::string::npos)
          << policy_name(policy) << " " << value << ": " << what;
      EXPECT_EQ(what.find("heap"), std::string::npos) << what;
    }
  }
  EXPECT_THROW(deepseek(equal_load(1e308), kLayout), InvalidArgument);
  EXPECT_THROW(evaluate(equal_load(1e308), trivial_placement(1, 8, 10), kLayout), InvalidArgument);
}

// Just below the bound, with values far past what a token count could be: the float32 sums of
// deepseek stay finite, so equal loads get an even placement (every rank the same load) and
// every figure is a number.
TEST(LoadLimits, EqualLoadsNearTheBoundArePlacedEvenly) {
  const LoadMatrix load = equal_load(kMaxLayerLoad / 8);
  for (const Policy policy : {Policy::kBalanced, Policy::kDeepseek}) {
    PolicyOptions options;
    options.policy = policy;
    const Placement p = place(load, kLayout, options);
    const PlacementMetrics m = evaluate(load, p, kLayout);
    EXPECT_TRUE(std::isfinite(m.balancedness_mean)) << policy_name(policy);
    EXPECT_NEAR(m.balancedness_mean, m.lower_bound_mean, 1e-12) << policy_name(policy);
    // Two extra replicas on two ranks of five slots: they go to two different experts, one a
    // rank, never both to expert 0 (what inf keys, all equal, would give).
    int most = 0;
    for (const int32_t c : p.replica_count) most = std::max(most, c);
    EXPECT_EQ(most, 2) << policy_name(policy);
  }
}

}  // namespace
}  // namespace eplb::placement
