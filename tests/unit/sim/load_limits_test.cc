// The simulator at the edge of the loads eplb takes: a window whose layer sums past
// kMaxLayerLoad is refused naming its steps, and a spread that pushes good loads past it is
// named as the cause, not the loads.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/sim/simulate.h"

namespace eplb::sim {
namespace {

constexpr Layout kLayout{.experts = 4, .physical = 6, .ranks = 2, .nodes = 1, .groups = 1};

// 8 steps of one layer, each step's row from `row_of(step)`.
template <typename Row>
stats::LoadHistory history(Row row_of) {
  stats::LoadHistory h;
  h.steps = 8;
  h.layers = 1;
  h.experts = 4;
  for (int64_t s = 0; s < h.steps; ++s) {
    const std::vector<double> row = row_of(s);
    h.values.insert(h.values.end(), row.begin(), row.end());
  }
  return h;
}

SimOptions options(double spread) {
  SimOptions o;
  o.layout = kLayout;
  o.interval = 4;
  o.window = 4;
  o.policies = parse_policies("balanced,deepseek");
  o.migration.expert_bytes = 1000;
  o.spread = spread;
  return o;
}

std::string message_of(const stats::LoadHistory& h, const SimOptions& o) {
  try {
    simulate(h, o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(SimLoadLimits, AWindowSummingPastTheBoundNamesItsSteps) {
  // Each load is finite and each step's layer is within the bound; four steps of them are not.
  const auto h = history([](int64_t) { return std::vector<double>{1e37, 1e37, 1e37, 1e37}; });
  const std::string what = message_of(h, options(0));
  EXPECT_NE(what.find("the loads of layer 0 over steps [0, 4) sum to 1.6e+38"), std::string::npos)
      << what;
}

TEST(SimLoadLimits, ASpreadPushingLoadsPastTheBoundIsNamed) {
  // Loads that vary from step to step (a standard deviation above 0), summing to little.
  const auto h = history([](int64_t s) {
    return std::vector<double>{static_cast<double>(s % 2), 1, 2, 3};
  });
  EXPECT_NO_THROW(simulate(h, options(2)));
  const std::string what = message_of(h, options(1e308));
  EXPECT_NE(what.find("spread 1e+308 (--spread)"), std::string::npos) << what;
  EXPECT_EQ(what.find("load of layer 0 expert 0 is inf"), std::string::npos) << what;
}

}  // namespace
}  // namespace eplb::sim
