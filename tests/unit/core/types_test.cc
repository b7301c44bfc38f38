#include "eplb/core/types.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

#include "eplb/core/error.h"

namespace eplb {
namespace {

std::string message_of(const Layout& layout) {
  try {
    layout.validate();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Layout, AcceptsDeepSeekV3Shape) {
  Layout layout{.experts = 256, .physical = 288, .ranks = 32, .nodes = 4, .groups = 8};
  EXPECT_NO_THROW(layout.validate());
  EXPECT_EQ(layout.slots_per_rank(), 9);
  EXPECT_EQ(layout.ranks_per_node(), 8);
  EXPECT_EQ(layout.rank_of_slot(17), 1);
  EXPECT_EQ(layout.node_of_slot(287), 3);
  EXPECT_EQ(layout.redundant(), 32);
}

TEST(Layout, MessagesNameTheValueAndTheRule) {
  EXPECT_EQ(message_of({.experts = 256, .physical = 300, .ranks = 32}),
            "physical 300 is not a multiple of ranks 32 (every rank holds the same number of "
            "slots)");
  EXPECT_NE(message_of({.experts = 8, .physical = 4, .ranks = 2}).find("physical 4 is below "
                                                                        "experts 8"),
            std::string::npos);
  EXPECT_NE(message_of({.experts = 8, .physical = 8, .ranks = 0}).find("ranks 0"),
            std::string::npos);
  EXPECT_NE(message_of({.experts = 8, .physical = 8, .ranks = 4, .nodes = 3}).find("nodes 3"),
            std::string::npos);
  EXPECT_NE(message_of({.experts = 4, .physical = 8, .ranks = 2, .groups = 3}).find("groups 3"),
            std::string::npos);
}

TEST(LoadMatrix, RejectsNegativeAndNonFinite) {
  LoadMatrix m(2, 3);
  EXPECT_NO_THROW(m.validate());
  m.at(1, 2) = -1;
  try {
    m.validate();
    FAIL() << "negative load accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1 expert 2"), std::string::npos) << e.what();
  }
  m.at(1, 2) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(m.validate(), InvalidArgument);
  EXPECT_THROW(LoadMatrix().validate(), InvalidArgument);
}

// Every value finite, but the layer's sum is not (or is past what float32, in which the
// deepseek policy computes, holds): refused with the layer and the sum, before any policy would
// turn it into NaN or an internal check.
TEST(LoadMatrix, RejectsALayerWhoseSumOverflows) {
  LoadMatrix m(2, 8);
  std::fill(m.values.begin(), m.values.begin() + 8, 1.0);
  std::fill(m.values.begin() + 8, m.values.end(), 1e308);
  try {
    m.validate();
    FAIL() << "a layer summing to inf was accepted";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the loads of layer 1 sum to inf"), std::string::npos) << what;
    EXPECT_NE(what.find("above 1e+38"), std::string::npos) << what;
  }
  // Finite in double, past float32's largest (3.4e38).
  std::fill(m.values.begin() + 8, m.values.end(), 5e37);
  try {
    m.validate();
    FAIL() << "a layer summing to 4e38 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the loads of layer 1 sum to 4e+38"), std::string::npos)
        << e.what();
  }
  // At the bound: taken.
  std::fill(m.values.begin() + 8, m.values.end(), kMaxLayerLoad / 8);
  EXPECT_NO_THROW(m.validate());
}

TEST(LoadMatrix, RejectsMoreLayersThanSupported) {
  LoadMatrix m(kMaxLayers + 1, 1);
  try {
    m.validate();
    FAIL() << "65537 layers accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("65537 layers"), std::string::npos) << e.what();
  }
}

TEST(Placement, TrivialIsValidAndDerivesLog2phy) {
  Placement p = trivial_placement(2, 4, 6);
  EXPECT_NO_THROW(p.validate());
  EXPECT_EQ(p.max_replicas, 2);
  EXPECT_EQ(p.replica_count[0], 2);  // expert 0 in slots 0 and 4
  EXPECT_EQ(p.replicas(1, 1)[1], 5);
  EXPECT_EQ(p.replica_count[3], 1);
  EXPECT_EQ(p.log2phy[3 * 2 + 1], -1);
}

TEST(Placement, ValidateFindsInconsistencies) {
  Placement p = trivial_placement(1, 4, 4);
  p.phy2log[0] = 1;  // expert 0 lost
  EXPECT_THROW(p.validate(), InvalidArgument);
  p = trivial_placement(1, 4, 4);
  p.replica_count[2] = 2;
  EXPECT_THROW(p.validate(), InvalidArgument);
}

TEST(Check, MacrosCarryBothValues) {
  try {
    EPLB_CHECK_EQ(3, 4, "sizes differ");
    FAIL();
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("sizes differ"), std::string::npos);
    EXPECT_NE(what.find("3 vs 4"), std::string::npos);
    EXPECT_NE(what.find("types_test.cc"), std::string::npos);
  }
}

}  // namespace
}  // namespace eplb
