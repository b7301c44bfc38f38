#include "runtime/scenarios.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

namespace eplb::runtime::testing {

Scenario skewed(const std::string& name, Mode mode) {
  Scenario s;
  s.name = name;
  s.config.layout = Layout{.experts = 8, .physical = 12, .ranks = 4, .nodes = 2, .groups = 1};
  s.config.interval = 4;
  s.config.window = 4;
  s.config.lag = 2;
  s.config.mode = mode;
  s.config.placement.policy = placement::Policy::kBalanced;
  s.config.timeout = std::chrono::milliseconds(20'000);
  s.weights.layers = 4;
  s.weights.tensors = {{"w13", 40}, {"w2", 24}};
  s.completed = 6;
  s.seed = testing::test_seed(7);
  return s;
}

Scenario flame(const std::string& name, Mode mode) {
  Scenario s;
  s.name = name;
  s.load = LoadSource::kFlame;
  s.config.layout = Layout{.experts = 64, .physical = 72, .ranks = 4, .nodes = 1, .groups = 1};
  s.config.interval = 6;
  s.config.window = 6;
  s.config.lag = 1;
  s.config.mode = mode;
  s.config.timeout = std::chrono::milliseconds(20'000);
  s.weights.layers = 8;
  s.weights.tensors = {{"w13", 32}, {"w2", 16}, {"scale", 8}};
  s.completed = 3;
  s.seed = testing::test_seed(11);
  return s;
}

Scenario as_processes(Scenario s, const std::string& transport) {
  s.processes = true;
  s.control = "shm";
  s.transport = transport;
  return s;
}

// Every rank ran cleanly, and every rank's per-step log (tables hash, history) is the same.
void expect_consistent(const Scenario& s, const std::vector<RankResult>& results) {
  SCOPED_TRACE(::testing::Message() << s.name << " seed " << s.seed
                                    << " (rerun with EPLB_TEST_SEED=" << s.seed << ")");
  const RankResult* reference = nullptr;
  for (const RankResult& r : results) {
    for (const std::string& e : r.errors) ADD_FAILURE() << e;
    if (r.rank == s.kill_rank) continue;
    EXPECT_TRUE(r.ran) << "rank " << r.rank << " produced no result";
    if (!r.ran) continue;
    if (!reference) {
      reference = &r;
      continue;
    }
    ASSERT_EQ(r.log.size(), reference->log.size()) << "rank " << r.rank << " ran a different "
                                                    << "number of steps than rank "
                                                    << reference->rank;
    for (size_t i = 0; i < r.log.size(); ++i) {
      ASSERT_EQ(r.log[i], reference->log[i]) << "rank " << r.rank << " vs rank "
                                             << reference->rank << " at log line " << i;
    }
    ASSERT_EQ(r.history.size(), reference->history.size());
    for (size_t i = 0; i < r.history.size(); ++i) {
      EXPECT_EQ(r.history[i].outcome, reference->history[i].outcome);
      EXPECT_EQ(r.history[i].trigger_step, reference->history[i].trigger_step);
      EXPECT_EQ(r.history[i].end_step, reference->history[i].end_step);
      EXPECT_EQ(r.history[i].layers_installed, reference->history[i].layers_installed);
      EXPECT_EQ(r.history[i].slots_moved, reference->history[i].slots_moved);
    }
  }
  ASSERT_NE(reference, nullptr);
}

int64_t count(const RankResult& r, Outcome outcome) {
  return std::count_if(r.history.begin(), r.history.end(),
                       [&](const RebalanceRecord& h) { return h.outcome == outcome; });
}

int64_t moved_slots(const RankResult& r) {
  int64_t moved = 0;
  for (const auto& h : r.history) {
    if (h.outcome == Outcome::kCompleted) moved += h.slots_moved;
  }
  return moved;
}

}  // namespace eplb::runtime::testing
