// The cost model (placement/cost.h): slot times, fits recovering known parameters, the roofline
// and presets, JSON both ways, bad input named; and balanced under a cost model.
#include "eplb/placement/cost.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "unit/invalid_message.h"
#include "placement/balanced.h"
#include "eplb/placement/policy.h"

namespace eplb::placement {
namespace {

// A model from its parameters (designated initializers would leave `source` out).
struct Params {
  double rank_us = 0, slot_us = 0, token_us = 1, knee_tokens = 0, token_us_above = 0;
};
CostModel model(Params p) {
  CostModel m;
  m.rank_us = p.rank_us;
  m.slot_us = p.slot_us;
  m.token_us = p.token_us;
  m.knee_tokens = p.knee_tokens;
  m.token_us_above = p.token_us_above;
  return m;
}

using ::testing::HasSubstr;
using eplb::test_util::invalid_message;

TEST(CostModel, SlotTimeIsFixedPlusTokensWithAKnee) {
  CostModel m = model({.rank_us = 5, .slot_us = 10, .token_us = 1, .knee_tokens = 0});
  EXPECT_EQ(m.slot_time_us(0), 0);
  EXPECT_EQ(m.slot_time_us(3), 13);
  const std::vector<int64_t> slots{0, 3, 4};
  EXPECT_EQ(m.rank_time_us(slots), 5 + 13 + 14);
  m.knee_tokens = 2;
  m.token_us_above = 4;
  EXPECT_EQ(m.slot_time_us(2), 12);
  EXPECT_EQ(m.slot_time_us(5), 12 + 3 * 4);
}

TEST(CostModel, BadParametersAreNamed) {
  EXPECT_THAT(invalid_message([] { model({.slot_us = -1}).validate(); }),
              HasSubstr("slot_us is -1"));
  EXPECT_THAT(invalid_message([] { model({.token_us = std::nan("")}).validate(); }),
              HasSubstr("token_us is nan"));
  EXPECT_THAT(invalid_message([] { model({.rank_us = 2e6}).validate(); }), HasSubstr("rank_us is"));
  EXPECT_THAT(invalid_message([] { model({.slot_us = 0, .token_us = 0}).validate(); }),
              HasSubstr("are all 0"));
  for (const double noise : {-0.1, 1.5, std::nan("")}) {
    CostModel m = model({.slot_us = 1});
    m.noise = noise;
    EXPECT_THAT(invalid_message([&] { m.validate(); }), HasSubstr("noise is")) << noise;
  }
}

TEST(CostModel, FitRecoversKnownParametersFromNoisySamples) {
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0, 2);
  std::vector<CostSample> samples;
  for (int i = 0; i < 200; ++i) {
    const double slots = 20 + static_cast<double>(rng() % 14);
    const double tokens = 100 + static_cast<double>(rng() % 300);
    samples.push_back({slots, tokens, 30 + 48 * slots + 14 * tokens + noise(rng)});
  }
  const CostModel m = fit_cost_model(samples);
  EXPECT_NEAR(m.slot_us, 48, 1);
  EXPECT_NEAR(m.token_us, 14, 0.1);
  EXPECT_NEAR(m.rank_us, 30, 25);
  EXPECT_THAT(m.source, HasSubstr("200 samples"));
}

TEST(CostModel, FitNeverReturnsANegativeParameter) {
  // Times that a line through the origin would fit with a negative intercept.
  std::vector<CostSample> samples;
  for (int i = 0; i < 20; ++i) {
    samples.push_back({static_cast<double>(1 + i % 5), static_cast<double>(10 + i),
                       std::max(0.0, 3.0 * (10 + i) - 20)});
  }
  const CostModel m = fit_cost_model(samples);
  EXPECT_GE(m.rank_us, 0);
  EXPECT_GE(m.slot_us, 0);
  EXPECT_GE(m.token_us, 0);
}

TEST(CostModel, FitRefusesTooFewOrDegenerateSamples) {
  std::vector<CostSample> few(static_cast<size_t>(kMinCostSamples - 1), {1, 2, 3});
  EXPECT_THAT(invalid_message([&] { fit_cost_model(few); }),
              HasSubstr("7 samples (need at least 8"));
  std::vector<CostSample> line;
  for (int i = 1; i <= 10; ++i) line.push_back({1.0 * i, 4.0 * i, 7.0 * i});
  EXPECT_THAT(invalid_message([&] { fit_cost_model(line); }), HasSubstr("cannot tell the slots"));
  std::vector<CostSample> bad(10, {1, 2, 3});
  bad[4] = {1, -2, 3};
  EXPECT_THAT(invalid_message([&] { fit_cost_model(bad); }), HasSubstr("sample 4 is"));
}

// The noise a fit finds is the spread of one rank's time against the others' at the same step:
// a slowdown of the whole step (every rank at once) is left out when the samples name their step.
TEST(CostModel, FitMeasuresTheNoiseWithinSteps) {
  std::mt19937 rng(11);
  std::normal_distribution<double> rank_noise(0, 0.08), step_noise(0, 0.15);
  std::vector<CostSample> samples, unnamed;
  for (int64_t step = 0; step < 40; ++step) {
    const double common = 1 + step_noise(rng);
    for (int rank = 0; rank < 8; ++rank) {
      const double slots = 20 + static_cast<double>(rng() % 14);
      const double tokens = 100 + static_cast<double>(rng() % 300);
      const double t = (48 * slots + 14 * tokens) * common * (1 + rank_noise(rng));
      samples.push_back({slots, tokens, t, step});
      unnamed.push_back({slots, tokens, t});
    }
  }
  const CostModel m = fit_cost_model(samples);
  EXPECT_NEAR(m.noise, 0.08, 0.015);
  // Without steps every deviation counts: the step's share too.
  EXPECT_GT(fit_cost_model(unnamed).noise, 0.12);
  // A noiseless fit has none.
  std::vector<CostSample> exact;
  for (int i = 0; i < 20; ++i) {
    exact.push_back({1.0 + i % 4, 10.0 + 3 * i, 5 * (1.0 + i % 4) + 2 * (10.0 + 3 * i), i % 3});
  }
  EXPECT_NEAR(fit_cost_model(exact).noise, 0, 1e-9);
}

// Too few samples: fit_cost_model names them; the fallback says so and prices tokens.
TEST(CostModel, AFitWithTooFewSamplesFallsBackToTokens) {
  std::vector<CostSample> few(3, {1, 2, 3});
  std::string why;
  const CostModel m = fit_cost_model_or_tokens(few, &why);
  EXPECT_THAT(why, HasSubstr("3 samples (need at least 8"));
  EXPECT_EQ(m.token_us, 1);
  EXPECT_EQ(m.slot_us, 0);
  EXPECT_THAT(m.source, HasSubstr("preset tokens (the fit failed: "));
  std::vector<CostSample> good;
  for (int i = 0; i < 20; ++i) good.push_back({1.0 + i % 4, 10.0 + 3 * i, 40.0 + i});
  fit_cost_model_or_tokens(good, &why);
  EXPECT_EQ(why, "");
}

// The expected largest of noisy rank times: the largest without noise, at least the largest
// with it, more for more ranks alike, symmetric, and never raised by evening the ranks out.
TEST(CostModel, ExpectedMaxOfNoisyRanks) {
  const std::vector<double> times{10, 40, 30, 35};
  EXPECT_EQ(expected_max_us(times, 0), 40);
  EXPECT_EQ(expected_max_us({}, 0.1), 0);
  // One rank: its mean (the quantiles are symmetric).
  EXPECT_NEAR(expected_max_us(std::vector<double>{50}, 0.1), 50, 1e-9);
  const double noisy = expected_max_us(times, 0.1);
  EXPECT_GT(noisy, 40);
  EXPECT_LT(noisy, 40 * 1.3);
  // Eight equal ranks: about 1.42 standard deviations above the mean (the expected largest of
  // eight standard normals is 1.4236; the 32-point quadrature is close to it).
  const std::vector<double> equal(8, 100);
  EXPECT_NEAR(expected_max_us(equal, 0.1), 100 * (1 + 0.1 * 1.4236), 0.1);
  std::vector<double> more(64, 100);
  EXPECT_GT(expected_max_us(more, 0.1), expected_max_us(equal, 0.1));
  // Symmetric, and spreading the same total evenly never raises it.
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0, 100);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> t(static_cast<size_t>(2 + trial % 9));
    double total = 0;
    for (double& x : t) total += x = u(rng);
    const double e = expected_max_us(t, 0.2);
    std::vector<double> shuffled = t;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    EXPECT_NEAR(expected_max_us(shuffled, 0.2), e, 1e-9 * e);
    const std::vector<double> even(t.size(), total / static_cast<double>(t.size()));
    EXPECT_LE(expected_max_us(even, 0.2), e * (1 + 1e-12));
    EXPECT_GE(e, *std::max_element(t.begin(), t.end()) * (1 - 1e-12));
  }
  // Many ranks: the product of their probabilities does not underflow, and the tails reach the
  // expected largest of 1024 standard normals (3.24).
  const std::vector<double> wide(1024, 10);
  EXPECT_NEAR(expected_max_us(wide, 0.1), 10 * (1 + 0.1 * 3.24), 0.05);
  CostModel m = model({.slot_us = 1});
  m.noise = 0.1;
  EXPECT_EQ(m.layer_time_us(times), noisy);
}

TEST(CostModel, KernelTableFitFindsTheKnee) {
  // A roofline: 10 us up to 50 tokens, then 0.2 us per token.
  std::vector<SlotTiming> table;
  for (const double n : {1, 2, 4, 8, 16, 32, 50, 64, 128, 256}) {
    table.push_back({n, std::max(10.0, 0.2 * n)});
  }
  const CostModel m = fit_slot_table(table);
  EXPECT_NEAR(m.slot_us, 10, 1e-6);
  EXPECT_NEAR(m.token_us, 0, 1e-6);
  EXPECT_EQ(m.knee_tokens, 50);
  EXPECT_NEAR(m.token_us_above, 0.2, 1e-6);
  EXPECT_THAT(invalid_message([] { fit_slot_table(std::vector<SlotTiming>(3, {1, 1})); }),
              HasSubstr("3 rows"));
}

TEST(CostModel, RooflineAndPresets) {
  const CostModel h100 = cost_model_preset("h100-v3-decode");
  // 44,040,192 bytes at 3.35 TB/s; 88 MFLOP per token at 1979 TFLOP/s.
  EXPECT_NEAR(h100.slot_us, 44040192 / 3.35e12 * 1e6, 1e-9);
  EXPECT_NEAR(h100.token_us_above, 2 * 44040192 / 1979e12 * 1e6, 1e-12);
  EXPECT_NEAR(h100.knee_tokens, 295.4, 0.1);
  EXPECT_EQ(h100.token_us, 0);
  // Below the knee every token count costs the weights' read; above it, the math.
  EXPECT_NEAR(h100.slot_time_us(1), h100.slot_time_us(290), 1e-9);
  EXPECT_NEAR(h100.slot_time_us(600), 600 * h100.token_us_above, 1e-6);
  EXPECT_LT(cost_model_preset("h200-v3-decode").slot_us, h100.slot_us);
  EXPECT_THAT(invalid_message([] { cost_model_preset("a100"); }),
              HasSubstr("'a100' is not a preset (h100-v3-decode, h200-v3-decode, tokens)"));
  EXPECT_THAT(invalid_message([] {
                roofline_cost_model({.hbm_bytes_per_s = 1e12, .peak_flops = 0,
                                     .expert_bytes = 1, .flops_per_token = 1});
              }),
              HasSubstr("peak_flops is 0"));
}

TEST(CostModel, JsonRoundTripAndErrors) {
  CostModel m =
      model({.rank_us = 1.5, .slot_us = 48, .token_us = 14, .knee_tokens = 30, .token_us_above = 20});
  m.source = "test";
  const CostModel back = cost_model_from_json(cost_model_to_json(m));
  EXPECT_EQ(back.rank_us, 1.5);
  EXPECT_EQ(back.slot_us, 48);
  EXPECT_EQ(back.knee_tokens, 30);
  EXPECT_EQ(back.token_us_above, 20);
  EXPECT_EQ(back.source, "test");
  EXPECT_EQ(back.noise, 0);
  EXPECT_FALSE(back.heldout_error.has_value());
  m.noise = 0.07;
  m.heldout_error = -0.021;
  m.heldout_steps = 16;
  const CostModel fitted = cost_model_from_json(cost_model_to_json(m));
  EXPECT_EQ(fitted.noise, 0.07);
  EXPECT_EQ(fitted.heldout_error, -0.021);
  EXPECT_EQ(fitted.heldout_steps, 16);
  EXPECT_THAT(invalid_message([] { cost_model_from_json(R"({"slot_us": 1, "noise": 3})"); }),
              HasSubstr("noise is 3"));
  EXPECT_THAT(
      invalid_message([] { cost_model_from_json(R"({"slot_us": 1, "heldout_steps": 1.5})"); }),
      HasSubstr("\"heldout_steps\" is 1.5"));
  EXPECT_EQ(cost_model_from_json(R"({"preset": "tokens"})").token_us, 1);
  const CostModel roof = cost_model_from_json(
      R"({"roofline": {"hbm_bytes_per_s": 1e12, "peak_flops": 1e15, "expert_bytes": 1e6,
          "flops_per_token": 2e6}})");
  EXPECT_NEAR(roof.slot_us, 1, 1e-12);
  EXPECT_THAT(invalid_message([] { cost_model_from_json(R"({"slot": 1})", "m.json"); }),
              HasSubstr("m.json: unknown field \"slot\""));
  EXPECT_THAT(invalid_message([] { cost_model_from_json(R"({"slot_us": "fast"})"); }),
              HasSubstr("\"slot_us\" is \"fast\" (expected a number)"));
  EXPECT_THAT(invalid_message([] { cost_model_from_json(R"({"slot_us": -3})"); }),
              HasSubstr("slot_us is -3"));
  EXPECT_THAT(invalid_message([] {
                cost_model_from_json(R"({"roofline": {"hbm_bytes_per_s": 1e12}})", "r.json");
              }),
              HasSubstr("peak_flops is 0"));
}

TEST(CostModel, LeastExpertTimeSplitsOnlyWhereItPays) {
  const CostModel linear = model({.slot_us = 10, .token_us = 1});
  EXPECT_EQ(least_expert_time_us(linear, 100, 4), 110);  // one slot: the fixed part once
  const CostModel steep =
      model({.slot_us = 1, .token_us = 0, .knee_tokens = 10, .token_us_above = 5});
  // 40 tokens: one slot 1 + 30 * 5 = 151; four slots of 10: 4.
  EXPECT_EQ(least_expert_time_us(steep, 40, 4), 4);
}

// balanced under the roofline gives no replica that only adds its fixed part, and every layer
// keeps one slot per expert at least.
TEST(BalancedCost, ReplicatesOnlyWhereItLowersTheModeledTime) {
  const Layout layout{.experts = 16, .physical = 24, .ranks = 8, .nodes = 1, .groups = 1};
  LoadMatrix load(1, 16);
  for (int64_t e = 0; e < 16; ++e) load.at(0, e) = 4.0 * static_cast<double>(1 + e % 5);
  const CostModel roof = cost_model_preset("h100-v3-decode");
  PolicyOptions o;
  o.cost = roof;
  o.cost_steps = 4;
  const Placement p = place(load, layout, o);
  for (int64_t e = 0; e < 16; ++e) EXPECT_GE(p.replica_count[e], 1);
  // Deterministic.
  EXPECT_EQ(place(load, layout, o).phy2log, p.phy2log);
  // Every rank holds distinct experts.
  for (int64_t g = 0; g < 8; ++g) {
    EXPECT_NE(p.phy2log[3 * g], p.phy2log[3 * g + 1]);
    EXPECT_NE(p.phy2log[3 * g + 1], p.phy2log[3 * g + 2]);
    EXPECT_NE(p.phy2log[3 * g], p.phy2log[3 * g + 2]);
  }
  o.policy = Policy::kDeepseek;
  EXPECT_THAT(invalid_message([&] { place(load, layout, o); }), HasSubstr("balanced policy only"));
}

}  // namespace
}  // namespace eplb::placement
