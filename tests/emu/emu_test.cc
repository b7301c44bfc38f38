#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "emu/expert.h"
#include "emu/emulator.h"
#include "emu/workload.h"

namespace eplb::emu {
namespace {

const ExpertShape kShape{.hidden = 24, .intermediate = 12};

std::vector<float> forward(int64_t layer, int32_t expert, int64_t step, int64_t token) {
  std::vector<float> gate_up(kShape.gate_up_floats()), down(kShape.down_floats());
  generate_weights(kShape, layer, expert, Tensor::kGateUp, gate_up);
  generate_weights(kShape, layer, expert, Tensor::kDown, down);
  std::vector<float> x(kShape.hidden), scratch(2 * kShape.intermediate), y(kShape.hidden);
  generate_activation(kShape.hidden, step, token, layer, x);
  expert_forward(kShape, gate_up.data(), down.data(), x.data(), scratch.data(), y.data());
  return y;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(Expert, OutputsAreDeterministicAndDifferPerExpertLayerAndToken) {
  const std::vector<float> y = forward(3, 17, 5, 99);
  EXPECT_TRUE(same_bits(y, forward(3, 17, 5, 99)));
  EXPECT_FALSE(same_bits(y, forward(3, 18, 5, 99)));  // another expert
  EXPECT_FALSE(same_bits(y, forward(4, 17, 5, 99)));  // another layer
  EXPECT_FALSE(same_bits(y, forward(3, 17, 6, 99)));  // another step
  EXPECT_FALSE(same_bits(y, forward(3, 17, 5, 98)));  // another token
  bool nonzero = false;
  for (const float v : y) nonzero = nonzero || v != 0;
  EXPECT_TRUE(nonzero);
}

TEST(Expert, BytesMatchFloats) {
  std::vector<float> floats(kShape.down_floats());
  std::vector<std::byte> bytes(kShape.down_bytes());
  generate_weights(kShape, 1, 2, Tensor::kDown, floats);
  generate_weights_bytes(kShape, 1, 2, Tensor::kDown, bytes);
  EXPECT_EQ(std::memcmp(floats.data(), bytes.data(), bytes.size()), 0);
  EXPECT_EQ(kShape.expert_bytes(), 3 * 24 * 12 * 4);
}

TEST(Expert, ShapeIsValidated) {
  EXPECT_THROW((ExpertShape{.hidden = 0, .intermediate = 4}.validate()), InvalidArgument);
  EXPECT_THROW((ExpertShape{.hidden = 4, .intermediate = -1}.validate()), InvalidArgument);
}

TEST(Workload, BundledTraceCyclesWithItsPeriod) {
  const Workload w = workload_from_trace(EPLB_SOURCE_DIR "/data/flame-moe-290m/routing_top6.csv");
  EXPECT_EQ(w.layers, 8);
  EXPECT_EQ(w.experts, 64);
  EXPECT_EQ(w.top_k, 6);
  EXPECT_EQ(w.tokens, 2048);
  EXPECT_EQ(w.period(4, 128), 4);
  EXPECT_EQ(w.period(4, 96), 16);  // 2048 / gcd(2048, 384)
  const auto a = w.experts_of(2, 5);
  const auto b = w.experts_of(2, 5 + 2048);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
}

TEST(Workload, MissingTraceNamesThePath) {
  try {
    workload_from_trace("/nonexistent/trace.csv");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/trace.csv"), std::string::npos);
  }
}

TEST(Workload, SamplerDrawsDistinctExpertsInProportionToLoad) {
  const std::string path = testing::TempDir() + "/emu_load.json";
  std::ofstream(path) << R"({"load": [[100, 0, 300, 600], [1, 1, 1, 1]]})";
  const Workload w = workload_from_load(path, 2, 4000, 7);
  ASSERT_EQ(w.layers, 2);
  ASSERT_EQ(w.experts, 4);
  std::vector<int64_t> first(4, 0);
  for (int64_t t = 0; t < w.tokens; ++t) {
    for (int64_t l = 0; l < 2; ++l) {
      const auto e = w.experts_of(l, t);
      EXPECT_NE(e[0], e[1]);
      for (const int32_t x : e) ASSERT_TRUE(x >= 0 && x < 4);
    }
    ++first[w.experts_of(0, t)[0]];
  }
  // Expert 1 has no load: drawn only when nothing else is left, which top-2 of 3 never needs.
  EXPECT_EQ(first[1], 0);
  EXPECT_GT(first[3], first[2]);
  EXPECT_GT(first[2], first[0]);
  // Same seed, same trace.
  EXPECT_EQ(workload_from_load(path, 2, 4000, 7).routes, w.routes);
  EXPECT_THROW(workload_from_load(path, 5, 10, 7), InvalidArgument);
  std::remove(path.c_str());
}

TEST(Workload, DenseLayersOfALoadFileAreLeftOutAndLayersCanBeCut) {
  const std::string path = testing::TempDir() + "/emu_dense.json";
  std::ofstream(path) << R"({"load": [[0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]]})";
  Workload w = workload_from_load(path, 2, 100, 3);
  EXPECT_EQ(w.layers, 2);
  EXPECT_NE(w.source.find("2 dense layers left out"), std::string::npos);
  keep_layers(w, 1);
  EXPECT_EQ(w.layers, 1);
  EXPECT_EQ(w.routes.size(), static_cast<size_t>(100 * 2));
  keep_layers(w, 0);  // all: no change
  EXPECT_EQ(w.layers, 1);
  EXPECT_THROW(keep_layers(w, -1), InvalidArgument);
  std::ofstream(path) << R"({"load": [[0, 0, 0, 0]]})";
  EXPECT_THROW(workload_from_load(path, 2, 100, 3), InvalidArgument);
  std::remove(path.c_str());
}

// Sampling only the layers a run keeps gives the tokens sampling every layer and cutting does.
TEST(Workload, SamplingTheKeptLayersOnlyGivesTheSameTokens) {
  const std::string path = testing::TempDir() + "/emu_kept.json";
  std::ofstream(path) << R"({"load": [[0, 0, 0, 0], [1, 2, 3, 4], [4, 3, 2, 1], [2, 2, 9, 1]]})";
  Workload all = workload_from_load(path, 2, 100, 3);
  keep_layers(all, 2);
  const Workload kept = workload_from_load(path, 2, 100, 3, 2);
  EXPECT_EQ(kept.layers, 2);
  EXPECT_EQ(kept.routes, all.routes);
  EXPECT_EQ(kept.source, all.source);
  EXPECT_THROW(workload_from_load(path, 2, 100, 3, 4), InvalidArgument);  // 3 MoE layers
  EXPECT_THROW(workload_from_load(path, 2, 100, 3, -1), InvalidArgument);
  std::remove(path.c_str());
}

// More layers than the input has are refused, not clamped: the run would serve fewer layers
// than asked without a word.
TEST(Workload, MoreLayersThanTheInputHasAreRefused) {
  const std::string path = testing::TempDir() + "/emu_layers.json";
  std::ofstream(path) << R"({"load": [[1, 2, 3, 4], [4, 3, 2, 1]]})";
  Workload w = workload_from_load(path, 2, 100, 3);
  ASSERT_EQ(w.layers, 2);
  keep_layers(w, 2);  // exactly the input's: every layer
  EXPECT_EQ(w.layers, 2);
  for (const int64_t layers : {int64_t{3}, int64_t{99999999999}}) {
    try {
      keep_layers(w, layers);
      ADD_FAILURE() << "--layers " << layers << " of 2 accepted";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--layers " + std::to_string(layers) + " is more than the 2 MoE "
                             "layers"), std::string::npos) << message;
      EXPECT_NE(message.find("(1 to 2, or 0: every layer)"), std::string::npos) << message;
    }
  }
  EXPECT_EQ(w.layers, 2);
  std::remove(path.c_str());
}

TEST(Workload, BundledDeepSeekLoadsAreFound) {
  const Workload w = workload_from_load(default_load_path(), 8, 64, 1);
  EXPECT_EQ(w.layers, 58);  // 61 layers, the first 3 dense
  EXPECT_EQ(w.experts, 256);
}

// The fitted cost model and its predictions travel with a result (eplb run --compare).
TEST(Result, CostModelRoundTrips) {
  RunResult r;
  r.mode = "off";
  placement::CostModel m;
  m.slot_us = 48.5;
  m.token_us = 14.25;
  m.source = "fit of 768 samples";
  r.cost_model = m;
  r.cost_samples = 768;
  r.moe_ms_predicted_before = 41.5;
  r.moe_ms_predicted_after = 31.75;
  r.moe_ms_floor_after = 28.25;
  r.time_balancedness_after = 0.875;
  r.per_step.push_back({});
  r.per_step.back().moe_ms_predicted = 30.5;
  r.per_step.back().moe_ms_floor = 27.5;
  r.per_step.back().time_balancedness = 0.9375;
  const RunResult back = result_from_json(result_to_json(r));
  ASSERT_TRUE(back.cost_model.has_value());
  EXPECT_DOUBLE_EQ(back.cost_model->slot_us, 48.5);
  EXPECT_EQ(back.cost_model->source, "fit of 768 samples");
  EXPECT_EQ(back.cost_samples, 768);
  EXPECT_DOUBLE_EQ(back.moe_ms_predicted_after, 31.75);
  EXPECT_DOUBLE_EQ(back.per_step[0].moe_ms_predicted, 30.5);
  EXPECT_DOUBLE_EQ(back.moe_ms_floor_after, 28.25);
  EXPECT_DOUBLE_EQ(back.time_balancedness_after, 0.875);
  EXPECT_DOUBLE_EQ(back.per_step[0].moe_ms_floor, 27.5);
  EXPECT_DOUBLE_EQ(back.per_step[0].time_balancedness, 0.9375);
  RunResult none;
  none.mode = "off";
  none.cost_fit_error = "cost model fit: 3 samples";
  const RunResult back_none = result_from_json(result_to_json(none));
  EXPECT_FALSE(back_none.cost_model.has_value());
  EXPECT_EQ(back_none.cost_fit_error, none.cost_fit_error);
}

TEST(Result, RoundTripsThroughJson) {
  RunResult r;
  r.mode = "async";
  r.steps = 48;
  r.rebalances = 1;
  r.after_first = 34;
  r.after_last = 48;
  r.moe_ms_after = 33.25;
  r.metrics = R"([{"name":"x"}])";
  r.per_step.push_back({.balancedness = 0.5, .moe_ms = 1.5, .moe_wall_ms = 2.5, .stall_ms = 0.25,
                        .installs = 3, .unavailable = true, .dropped = 7});
  r.kills = 2;
  r.tokens_dropped = 7;
  r.lost.push_back({.rank = 5, .step = 37, .planned = false, .how = "killed by signal 9"});
  r.stopped = "too few ranks left";
  r.per_rebalance.push_back({});
  r.per_rebalance.back().outcome = "completed";
  r.per_rebalance.back().bytes_moved = 1 << 20;
  const RunResult back = result_from_json(result_to_json(r));
  EXPECT_EQ(back.mode, "async");
  EXPECT_EQ(back.after_first, 34);
  EXPECT_DOUBLE_EQ(back.moe_ms_after, 33.25);
  EXPECT_EQ(back.metrics, r.metrics);
  ASSERT_EQ(back.per_step.size(), 1u);
  EXPECT_EQ(back.per_step[0].installs, 3);
  EXPECT_DOUBLE_EQ(back.per_step[0].stall_ms, 0.25);
  EXPECT_TRUE(back.per_step[0].unavailable);
  EXPECT_EQ(back.per_step[0].dropped, 7);
  EXPECT_EQ(back.kills, 2);
  EXPECT_EQ(back.tokens_dropped, 7);
  ASSERT_EQ(back.lost.size(), 1u);
  EXPECT_EQ(back.lost[0].rank, 5);
  EXPECT_EQ(back.lost[0].step, 37);
  EXPECT_FALSE(back.lost[0].planned);
  EXPECT_EQ(back.lost[0].how, "killed by signal 9");
  EXPECT_EQ(back.stopped, "too few ranks left");
  ASSERT_EQ(back.per_rebalance.size(), 1u);
  EXPECT_EQ(back.per_rebalance[0].bytes_moved, 1 << 20);
  EXPECT_THROW(result_from_json("{}"), IoError);
  EXPECT_THROW(result_from_json("not json"), IoError);
}

}  // namespace
}  // namespace eplb::emu
