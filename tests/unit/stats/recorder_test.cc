#include "eplb/stats/recorder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <random>
#include <string>

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

// A plain int64 window: every closed step kept whole, summed on demand.
struct NaiveWindow {
  int64_t cells, window;
  std::vector<int64_t> open;
  std::deque<std::vector<int64_t>> steps;
  NaiveWindow(int64_t c, int64_t w) : cells(c), window(w), open(static_cast<size_t>(c), 0) {}
  void step_end() {
    steps.push_back(open);
    if (static_cast<int64_t>(steps.size()) > window) steps.pop_front();
    open.assign(open.size(), 0);
  }
  std::vector<int64_t> sum() const {
    std::vector<int64_t> out(static_cast<size_t>(cells), 0);
    for (const auto& s : steps) {
      for (size_t i = 0; i < out.size(); ++i) out[i] += s[i];
    }
    return out;
  }
  std::vector<int64_t> flat() const {
    std::vector<int64_t> out;
    for (const auto& s : steps) out.insert(out.end(), s.begin(), s.end());
    return out;
  }
};

// Counts from small to the per-step limit: most small, some a few below or at the limit.
int64_t draw_count(std::mt19937_64& rng, int64_t room) {
  if (room <= 0) return 0;
  switch (rng() % 6) {
    case 0:
      return 0;
    case 1:
      return room;
    case 2:
      return room - static_cast<int64_t>(rng() % std::min<uint64_t>(room, 3));
    case 3:
      return static_cast<int64_t>(rng() % 70000) % (room + 1);  // around uint16's limit
    default:
      return static_cast<int64_t>(rng() % 5) % (room + 1);
  }
}

TEST(LoadRecorder, MatchesAnInt64WindowOnRandomCountsUpToTheStepLimit) {
  constexpr int64_t kLimit = LoadRecorder::kMaxStepCount;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int64_t layers = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t experts = 1 + static_cast<int64_t>(rng() % 6);
    const int64_t window = 1 + static_cast<int64_t>(rng() % 9);
    const int64_t cells = layers * experts;
    LoadRecorder rec(layers, experts, window);
    NaiveWindow ref(cells, window);
    std::vector<int64_t> snapshot(static_cast<size_t>(cells));
    const int steps = static_cast<int>(rng() % (3 * window + 6));
    for (int step = 0; step < steps; ++step) {
      for (int call = 0; call < 4; ++call) {
        const int64_t l = static_cast<int64_t>(rng() % layers);
        int64_t* open = ref.open.data() + l * experts;
        const std::vector<int64_t> before(rec.current().begin(), rec.current().end());
        if (rng() % 2 == 0) {
          std::vector<int64_t> counts(static_cast<size_t>(experts));
          for (int64_t e = 0; e < experts; ++e) counts[e] = draw_count(rng, kLimit - open[e]);
          const bool over = rng() % 5 == 0;
          const int64_t bad = static_cast<int64_t>(rng() % experts);
          if (over) counts[bad] = kLimit - open[bad] + 1 + static_cast<int64_t>(rng() % 3);
          if (over) {
            ASSERT_THROW(rec.record_counts(l, counts), InvalidArgument);
            ASSERT_TRUE(std::ranges::equal(rec.current(), before)) << "step " << step;
          } else {
            rec.record_counts(l, counts);
            for (int64_t e = 0; e < experts; ++e) open[e] += counts[e];
          }
        } else {
          std::vector<int32_t> ids(rng() % 6);
          for (auto& id : ids) id = static_cast<int32_t>(rng() % experts);
          std::vector<int64_t> would(open, open + experts);
          for (int32_t id : ids) ++would[id];
          const bool over = std::ranges::any_of(would, [](int64_t v) { return v > kLimit; });
          if (over) {
            ASSERT_THROW(rec.record(l, ids), InvalidArgument);
            ASSERT_TRUE(std::ranges::equal(rec.current(), before)) << "step " << step;
          } else {
            rec.record(l, ids);
            std::copy(would.begin(), would.end(), open);
          }
        }
        ASSERT_TRUE(std::ranges::equal(rec.current(), ref.open)) << "step " << step;
      }
      rec.step_end();
      ref.step_end();
      rec.snapshot_window(snapshot);
      ASSERT_EQ(snapshot, ref.sum()) << "step " << step;
      ASSERT_EQ(rec.window_steps(), ref.flat()) << "step " << step;
      ASSERT_EQ(rec.steps_in_window(), static_cast<int64_t>(ref.steps.size()));
    }
    EXPECT_EQ(rec.steps_closed(), steps);
  }
}

TEST(LoadRecorder, KeepsTheLimitInEveryStepAndSumsPastInt32) {
  // Every step at the limit: the window sum passes int32 many times over, each step does not.
  constexpr int64_t kLimit = LoadRecorder::kMaxStepCount;
  LoadRecorder rec(1, 2, 5);
  for (int step = 0; step < 8; ++step) {
    rec.record_counts(0, std::vector<int64_t>{kLimit - 1, step});
    rec.record(0, std::vector<int32_t>{0});
    rec.step_end();
  }
  std::vector<int64_t> snapshot(2);
  rec.snapshot_window(snapshot);
  EXPECT_EQ(snapshot, (std::vector<int64_t>{5 * kLimit, 3 + 4 + 5 + 6 + 7}));
  const std::vector<int64_t> steps = rec.window_steps();
  ASSERT_EQ(steps.size(), 10u);
  EXPECT_EQ(steps[0], kLimit);
  EXPECT_EQ(steps[1], 3);
  EXPECT_EQ(steps[9], 7);
}

TEST(LoadRecorder, RefusesAStepCountPastTheLimitNamingItAndCountsNothing) {
  constexpr int64_t kLimit = LoadRecorder::kMaxStepCount;
  LoadRecorder rec(2, 3, 2);
  rec.record_counts(1, std::vector<int64_t>{0, kLimit - 1, 4});
  const std::vector<int64_t> before(rec.current().begin(), rec.current().end());
  // Two more tokens for expert 1 than the step can keep: the call is refused whole.
  try {
    rec.record(1, std::vector<int32_t>{2, 1, 0, 1});
    FAIL() << "record past the limit was accepted";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layer 1 expert 1 would count 2147483646 + 2"), std::string::npos) << what;
    EXPECT_NE(what.find("2147483647"), std::string::npos) << what;
  }
  EXPECT_TRUE(std::ranges::equal(rec.current(), before));
  try {
    rec.record_counts(1, std::vector<int64_t>{5, 0, std::numeric_limits<int64_t>::max()});
    FAIL() << "record_counts past the limit was accepted";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layer 1 expert 2 would count 4 + 9223372036854775807"), std::string::npos)
        << what;
  }
  EXPECT_TRUE(std::ranges::equal(rec.current(), before));
  // Up to the limit is fine, by either call.
  rec.record(1, std::vector<int32_t>{1});
  rec.record_counts(1, std::vector<int64_t>{kLimit, 0, kLimit - 4});
  rec.step_end();
  EXPECT_EQ(rec.window_steps(), (std::vector<int64_t>{0, 0, 0, kLimit, kLimit, kLimit}));
  // A new step starts from zero again.
  rec.record_counts(1, std::vector<int64_t>{kLimit, kLimit, kLimit});
  rec.step_end();
  std::vector<int64_t> snapshot(6);
  rec.snapshot_window(snapshot);
  EXPECT_EQ(snapshot, (std::vector<int64_t>{0, 0, 0, 2 * kLimit, 2 * kLimit, 2 * kLimit}));
}

TEST(LoadRecorder, HoldsHalfTheBytesOfAnInt64RingAtProductionShapes) {
  struct Shape {
    int64_t layers, experts, window, bytes;
  };
  // DeepSeek-V3 (58 MoE layers x 256 experts) at vLLM's default window; Kimi-K2's 61 x 384 at
  // 3000 steps. The int64 ring with its open step and sum held 119021568 and 562550784 bytes.
  for (const Shape& s : {Shape{58, 256, 1000, 59630032}, Shape{61, 384, 3000, 281463272}}) {
    const int64_t cells = s.layers * s.experts;
    const int64_t int64_ring = cells * (s.window + 2) * 8;
    EXPECT_EQ(LoadRecorder::bytes_for(s.layers, s.experts, s.window), s.bytes);
    EXPECT_LE(s.bytes * 100, int64_ring * 51);  // at most 51% of the int64 ring
    EXPECT_EQ(s.bytes, cells * (4 * s.window + 16) + 8 * s.layers);
  }
  EXPECT_THROW(LoadRecorder::bytes_for(int64_t{1} << 16, int64_t{1} << 16, int64_t{1} << 40),
               InvalidArgument);
}

}  // namespace
}  // namespace eplb::stats
