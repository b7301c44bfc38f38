// What a rebalance buys and costs (placement/gain.h): the modeled step time of a placement by
// hand, the slots that do not serve, and the decision with its bad inputs named.
#include "eplb/placement/gain.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "unit/invalid_message.h"

namespace eplb::placement {
namespace {

using ::testing::HasSubstr;
using eplb::test_util::invalid_message;

CostModel linear(double rank_us, double slot_us, double token_us) {
  CostModel m;
  m.rank_us = rank_us;
  m.slot_us = slot_us;
  m.token_us = token_us;
  return m;
}

// Two ranks of two slots; experts 0, 1, 2, with expert 0 on both ranks.
Placement two_ranks(std::vector<int32_t> phy2log, int64_t layers = 1) {
  Placement p(layers, 3, 4);
  for (int64_t l = 0; l < layers; ++l) {
    std::copy(phy2log.begin(), phy2log.end(), p.phy2log.begin() + l * 4);
  }
  p.derive_from_phy2log();
  return p;
}

const Layout kLayout{.experts = 3, .physical = 4, .ranks = 2};

TEST(ModeledStep, EachExpertSplitEvenlyOverItsReplicas) {
  LoadMatrix load(1, 3);
  load.values = {40, 10, 0};
  const CostModel m = linear(5, 10, 1);
  // Rank 0: expert 0 (20 tokens) and 1 (10): 5 + 30 + 20 = 55. Rank 1: expert 0 (20) and
  // expert 2, idle: 5 + 30 = 35. The layer waits for rank 0.
  EXPECT_DOUBLE_EQ(modeled_step_us(m, load, two_ranks({0, 1, 0, 2}), kLayout), 55);
  // Expert 0 alone on rank 0, twice: 5 + 2 * (10 + 20) = 65; rank 1: 5 + (10 + 10) = 25.
  EXPECT_DOUBLE_EQ(modeled_step_us(m, load, two_ranks({0, 0, 1, 2}), kLayout), 65);
  // Noise lifts the layer time above the largest rank time.
  CostModel noisy = m;
  noisy.noise = 0.1;
  EXPECT_GT(modeled_step_us(noisy, load, two_ranks({0, 1, 0, 2}), kLayout), 55);
}

TEST(ModeledStep, DenseLayersAndSlotsThatDoNotServeAreLeftOut) {
  LoadMatrix load(2, 3);
  load.values = {0, 0, 0, 40, 10, 0};  // layer 0 dense
  const CostModel m = linear(5, 10, 1);
  const Placement p = two_ranks({0, 1, 0, 2}, 2);
  EXPECT_DOUBLE_EQ(modeled_step_us(m, load, p, kLayout), 55);
  // Slot 2 (expert 0 on rank 1) does not serve: rank 0 takes all 40 of expert 0.
  std::vector<uint8_t> usable{1, 1, 1, 1, 1, 1, 0, 1};
  EXPECT_DOUBLE_EQ(modeled_step_us(m, load, p, kLayout, usable), 5 + 50 + 20);
  // Rank 1 serves nothing: it takes no part (its rank_us is not paid).
  usable = {1, 1, 1, 1, 1, 1, 0, 0};
  EXPECT_DOUBLE_EQ(modeled_step_us(m, load, p, kLayout, usable), 75);
  EXPECT_THAT(
      invalid_message([&] { modeled_step_us(m, load, p, kLayout, std::vector<uint8_t>(3)); }),
      HasSubstr("usable has 3 entries, expected 8"));
  LoadMatrix wrong(1, 3);
  EXPECT_THAT(invalid_message([&] { modeled_step_us(m, wrong, p, kLayout); }),
              HasSubstr("do not fit together"));
}

TEST(DecideRebalance, SkipsWhenTheGainDoesNotPayItsPrice) {
  // 10 us a step over 100 steps: 1000 us. Moving 1 GB at 1 GB/s is 1 s.
  const RebalancePrice price{.bytes = 1e9, .bytes_per_s = 1e9, .stall_us = 500};
  EXPECT_DOUBLE_EQ(price.us(), 1e6 + 500);
  GainDecision d = decide_rebalance(110, 100, 100, price, 1);
  EXPECT_FALSE(d.rebalance);
  EXPECT_DOUBLE_EQ(d.gain_us, 1000);
  EXPECT_DOUBLE_EQ(d.price_us, 1e6 + 500);
  EXPECT_THAT(d.reason, HasSubstr("below min_gain 1 x the price"));
  // A small enough factor lets it pay; 0 never skips, even a loss.
  EXPECT_TRUE(decide_rebalance(110, 100, 100, price, 1e-4).rebalance);
  EXPECT_TRUE(decide_rebalance(100, 120, 100, price, 0).rebalance);
  // With min_gain > 0 a predicted loss never pays, even for free.
  EXPECT_FALSE(decide_rebalance(100, 120, 100, RebalancePrice{}, 0.5).rebalance);
  // No bandwidth measured yet: not priced, goes ahead.
  d = decide_rebalance(110, 100, 100, {.bytes = 1e9}, 1);
  EXPECT_TRUE(d.rebalance);
  EXPECT_FALSE(d.priced);
  // Nothing to move: the stall alone is the price.
  d = decide_rebalance(110, 100, 100, {.stall_us = 2000}, 1);
  EXPECT_TRUE(d.priced);
  EXPECT_FALSE(d.rebalance);
}

TEST(DecideRebalance, BadInputIsNamed) {
  const double inf = std::numeric_limits<double>::infinity();
  for (const double g : {-1.0, std::nan(""), inf}) {
    EXPECT_THAT(invalid_message([&] { decide_rebalance(1, 1, 1, {}, g); }),
                HasSubstr("min_gain is"))
        << g;
  }
  EXPECT_THAT(invalid_message([] { check_min_gain(-0.5, "--min-gain"); }),
              HasSubstr("--min-gain is -0.5 (must be a finite number >= 0"));
  EXPECT_THAT(invalid_message([] { decide_rebalance(1, 1, 0, {}, 1); }), HasSubstr("steps is 0"));
  EXPECT_THAT(invalid_message([] { decide_rebalance(-1, 1, 1, {}, 1); }),
              HasSubstr("current_us is -1"));
  EXPECT_THAT(invalid_message([] { decide_rebalance(1, 1, 1, {.bytes = -5}, 1); }),
              HasSubstr("bytes is -5"));
  EXPECT_THAT(invalid_message([&] { decide_rebalance(1, 1, 1, {.bytes_per_s = inf}, 1); }),
              HasSubstr("bytes_per_s is inf"));
}

}  // namespace
}  // namespace eplb::placement
