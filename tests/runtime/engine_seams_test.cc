// The engine's seams (engine_maps.h): its map tensors written in place and its per-pass counters
// read once per step, on thread ranks with random delays (the harness checks the bound maps
// against the tables at every step, on every rank, and compares them across ranks), and every
// bad input refused at the call with nothing changed.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/transport/registry.h"
#include "runtime/scenarios.h"

namespace eplb::runtime {
namespace {

using testing::Scenario;

TEST(EngineSeams, MapsAndPassCountersAsync) {
  for (const auto counters : {Scenario::Counters::kPassSlots, Scenario::Counters::kPassExperts}) {
    Scenario s = testing::skewed("engine-maps-async", Mode::kAsync);
    s.engine_maps = true;
    s.counters = counters;
    s.delays = true;
    const auto results = testing::run_scenario(s);
    testing::expect_consistent(s, results);
    EXPECT_GE(testing::count(results[0], Outcome::kCompleted), s.completed);
    EXPECT_GT(testing::moved_slots(results[0]), 0);
  }
}

TEST(EngineSeams, MapsAndPassCountersSyncOnTheTrace) {
  Scenario s = testing::flame("engine-maps-sync", Mode::kSync);
  s.engine_maps = true;
  s.counters = Scenario::Counters::kPassSlots;
  const auto results = testing::run_scenario(s);
  testing::expect_consistent(s, results);
  EXPECT_GE(testing::count(results[0], Outcome::kCompleted), s.completed);
}

TEST(EngineSeams, PassCountersRecordWhatPerLayerCallsRecord) {
  // The same loads through record_counts and through record_pass (per slot, per expert) give
  // the same rebalances: the same history and the same per-step tables on every rank. Sync
  // mode: an async rebalance's steps depend on how fast the workers run, not only on the loads.
  std::vector<std::vector<std::string>> logs;
  for (const auto counters : {Scenario::Counters::kPerLayer, Scenario::Counters::kPassSlots,
                              Scenario::Counters::kPassExperts}) {
    Scenario s = testing::skewed("pass-equals-layers", Mode::kSync);
    s.counters = counters;
    const auto results = testing::run_scenario(s);
    testing::expect_consistent(s, results);
    logs.push_back(results[0].log);
  }
  ASSERT_EQ(logs[1].size(), logs[0].size());
  ASSERT_EQ(logs[2].size(), logs[0].size());
  for (size_t i = 0; i < logs[0].size(); ++i) {
    ASSERT_EQ(logs[1][i], logs[0][i]) << "per slot, line " << i;
    ASSERT_EQ(logs[2][i], logs[0][i]) << "per expert, line " << i;
  }
}

// One rank, inproc: the bad inputs of the seams.
class OneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.layout = Layout{.experts = 4, .physical = 6, .ranks = 1, .nodes = 1, .groups = 1};
    config_.interval = 100;
    config_.window = 4;
    config_.placement.policy = placement::Policy::kDeepseek;  // two replicas on the one rank
    control::Options options;
    options.rendezvous = "engine-seams-one";
    comm_ = control::connect("inproc", options);
    transport_ = transport::create("inproc", transport::Options{});
    WeightSpec spec;
    spec.layers = 2;
    spec.tensors = {{"w", 8}};
    rb_ = std::make_unique<Rebalancer>(config_, *comm_, *transport_, spec,
                                       trivial_placement(2, 4, 6));
    rb_->connect();
  }
  void TearDown() override {
    if (rb_) rb_->shutdown();
  }

  static IntTensor view(std::vector<int64_t>& v, std::vector<int64_t> shape) {
    return IntTensor{.data = v.data(), .type = IntTensor::Type::kInt64, .shape = shape, .strides = {}};
  }

  Config config_;
  std::unique_ptr<control::Communicator> comm_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<Rebalancer> rb_;
};

void expect_invalid(const std::function<void()>& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying \"" << words << "\"";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST_F(OneRank, MapsAreWrittenAtBindAndRefusedWhenMisshapen) {
  std::vector<int64_t> phy2log(12, -9), log2phy(2 * 4 * 3, -9), count(8, -9);
  rb_->bind_maps({{MapKind::kPhysicalToLogical, view(phy2log, {2, 6}), "phy2log"},
                  {MapKind::kLogicalToPhysical, view(log2phy, {2, 4, 3}), "log2phy"},
                  {MapKind::kReplicaCount, view(count, {2, 4}), "logcnt"}});
  EXPECT_EQ(phy2log, (std::vector<int64_t>{0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(count, (std::vector<int64_t>{2, 2, 1, 1, 2, 2, 1, 1}));
  EXPECT_EQ(std::vector<int64_t>(log2phy.begin(), log2phy.begin() + 12),
            (std::vector<int64_t>{0, 4, -1, 1, 5, -1, 2, -1, -1, 3, -1, -1}));

  std::vector<int64_t> other(64, -9);
  expect_invalid([&] { rb_->bind_maps({{MapKind::kPhysicalToLogical, view(other, {2, 5}),
                                        "physical_to_logical_map"}}); },
                 "physical_to_logical_map is int64 [2, 5], expected [2, 6]");
  expect_invalid([&] { rb_->bind_maps({{MapKind::kLogicalToPhysical, view(other, {2, 4, 2}),
                                        "logical_to_physical_map"}}); },
                 "R must be at least 3");
  expect_invalid([&] { rb_->bind_maps({{MapKind::kReplicaCount, view(other, {3, 4}),
                                        "logical_replica_count"}}); },
                 "expected [2, 4]");
  // Nothing was bound by the failed calls: the first binding still stands, untouched.
  EXPECT_EQ(std::count(other.begin(), other.end(), -9), 64);
}

TEST_F(OneRank, RecordPassOncePerStepAndNothingOnError) {
  std::vector<int64_t> slots(12, 1), experts(8, 2), bad(8, 1);
  rb_->record_pass(view(slots, {2, 6}), CountsOf::kSlots);
  expect_invalid([&] { rb_->record_pass(view(experts, {2, 4}), CountsOf::kExperts); },
                 "already called at step 0");
  rb_->step_end();
  bad[5] = -3;
  expect_invalid([&] { rb_->record_pass(view(bad, {2, 4}), CountsOf::kExperts); },
                 "counts[1][1] is -3");
  expect_invalid([&] { rb_->record_pass(view(experts, {2, 4}), CountsOf::kSlots); },
                 "expected [2, 6]");
  rb_->record_pass(view(experts, {2, 4}), CountsOf::kExperts);  // the failed calls counted nothing
  rb_->step_end();
  // Step 0: one token per slot, counted for the slot's expert (experts 0 and 1 hold two slots);
  // step 1: two per expert.
  const std::string path = ::testing::TempDir() + "engine-seams-window.json";
  rb_->save_stats(path);
  const LoadMatrix window = stats::read_load(path);
  EXPECT_EQ(window.values, (std::vector<double>{4, 4, 3, 3, 4, 4, 3, 3}));
}

}  // namespace
}  // namespace eplb::runtime
