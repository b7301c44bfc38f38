#include "eplb/stats/recorder.h"

#include <gtest/gtest.h>

#include <random>

#include "eplb/core/error.h"

namespace eplb::stats {
namespace {

TEST(LoadRecorder, WindowSumMatchesTheLastStepsOnRandomInput) {
  constexpr int64_t kLayers = 3, kExperts = 5, kWindow = 4;
  LoadRecorder rec(kLayers, kExperts, kWindow);
  std::mt19937 rng(5);
  std::vector<std::vector<int64_t>> history;
  std::vector<int64_t> snapshot(kLayers * kExperts);
  for (int step = 0; step < 23; ++step) {
    std::vector<int64_t> step_counts(kLayers * kExperts, 0);
    for (int64_t l = 0; l < kLayers; ++l) {
      std::vector<int32_t> ids(rng() % 7);
      for (auto& id : ids) id = static_cast<int32_t>(rng() % kExperts);
      rec.record(l, ids);
      for (int32_t id : ids) ++step_counts[l * kExperts + id];
      std::vector<int64_t> counts(kExperts);
      for (auto& c : counts) c = rng() % 3;
      rec.record_counts(l, counts);
      for (int64_t e = 0; e < kExperts; ++e) step_counts[l * kExperts + e] += counts[e];
    }
    rec.step_end();
    history.push_back(step_counts);
    rec.snapshot_window(snapshot);
    std::vector<int64_t> expected(kLayers * kExperts, 0);
    const size_t first = history.size() > kWindow ? history.size() - kWindow : 0;
    for (size_t s = first; s < history.size(); ++s) {
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += history[s][i];
    }
    ASSERT_EQ(snapshot, expected) << "step " << step;
    const std::vector<int64_t> steps = rec.window_steps();
    ASSERT_EQ(steps.size(), (history.size() - first) * kLayers * kExperts);
    ASSERT_TRUE(std::equal(history[first].begin(), history[first].end(), steps.begin()));
  }
  EXPECT_EQ(rec.steps_in_window(), kWindow);
  EXPECT_EQ(rec.steps_closed(), 23);
}

TEST(LoadRecorder, RejectsBadIdsWithoutCountingAnything) {
  LoadRecorder rec(2, 4, 2);
  const std::vector<int32_t> ids = {1, 2, 4};
  try {
    rec.record(1, ids);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 4 at position 2"), std::string::npos);
  }
  for (int64_t v : rec.current()) EXPECT_EQ(v, 0);
  EXPECT_THROW(rec.record(2, ids), InvalidArgument);
  EXPECT_THROW(rec.record_counts(0, std::vector<int64_t>{1, 2}), InvalidArgument);
  EXPECT_THROW(rec.record_counts(0, std::vector<int64_t>{1, 2, -1, 0}), InvalidArgument);
  EXPECT_THROW(LoadRecorder(2, 4, 0), InvalidArgument);
}

}  // namespace
}  // namespace eplb::stats
