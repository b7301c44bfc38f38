#include "eplb/stats/placement_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "unit/invalid_message.h"

namespace eplb::stats {
namespace {

namespace fs = std::filesystem;

using eplb::test_util::invalid_message;

std::string parse_error(std::string_view content, int64_t min_experts = 0) {
  return invalid_message([&] { parse_placement(content, min_experts, "p.json"); });
}

Layout layout_of(int64_t experts, int64_t physical, int64_t ranks, int64_t nodes) {
  Layout layout;
  layout.experts = experts;
  layout.physical = physical;
  layout.ranks = ranks;
  layout.nodes = nodes;
  return layout;
}

TEST(FormatPlacement, ExactFormat) {
  const Placement p = trivial_placement(1, 2, 4);
  EXPECT_EQ(format_placement(p, layout_of(2, 4, 2, 1)),
            "{\"version\":1,\"layers\":1,\"experts\":2,\"physical\":4,\"ranks\":2,\"nodes\":1,"
            "\"phy2log\":[[0,1,0,1]],\"log2phy\":[[[0,2],[1,3]]],\"replica_count\":[[2,2]]}");
}

TEST(FormatPlacement, PadsLog2phyWithMinusOne) {
  Placement p(2, 3, 4);
  p.phy2log = {0, 1, 2, 0, 2, 2, 1, 0};
  p.derive_from_phy2log();
  const std::string text = format_placement(p, layout_of(3, 4, 1, 1));
  EXPECT_NE(text.find("\"log2phy\":[[[0,3],[1,-1],[2,-1]],[[3,-1],[2,-1],[0,1]]]"),
            std::string::npos)
      << text;
  EXPECT_THROW(format_placement(p, layout_of(4, 4, 1, 1)), InvalidArgument);
}

TEST(ParsePlacement, RoundTripKeepsEverything) {
  // Replicas in an order that is not slot order (as the deepseek policy makes them).
  Placement p(2, 3, 6);
  p.phy2log = {0, 1, 2, 0, 1, 0, 2, 2, 1, 0, 1, 2};
  p.derive_from_phy2log();
  std::swap(p.log2phy[0], p.log2phy[2]);  // layer 0, expert 0: slots 5, 3, 0
  p.validate();
  const Layout layout = layout_of(3, 6, 3, 1);
  const PlacementFile back = parse_placement(format_placement(p, layout));
  EXPECT_EQ(back.ranks, 3);
  EXPECT_EQ(back.nodes, 1);
  EXPECT_EQ(back.placement.layers, 2);
  EXPECT_EQ(back.placement.experts, 3);
  EXPECT_EQ(back.placement.physical, 6);
  EXPECT_EQ(back.placement.max_replicas, p.max_replicas);
  EXPECT_EQ(back.placement.phy2log, p.phy2log);
  EXPECT_EQ(back.placement.replica_count, p.replica_count);
  EXPECT_EQ(back.placement.log2phy, p.log2phy);
  const auto replicas = back.placement.replicas(0, 0);
  EXPECT_EQ(std::vector<int32_t>(replicas.begin(), replicas.end()),
            (std::vector<int32_t>{5, 3, 0}));
}

TEST(ParsePlacement, WithoutLog2phyDerivesSlotOrder) {
  const PlacementFile f = parse_placement(R"({"phy2log": [[1, 0, 1, 2]]})");
  EXPECT_EQ(f.ranks, 0);
  EXPECT_EQ(f.nodes, 0);
  EXPECT_EQ(f.placement.experts, 3);
  EXPECT_EQ(f.placement.replica_count, (std::vector<int32_t>{1, 2, 1}));
  EXPECT_EQ(f.placement.log2phy, (std::vector<int32_t>{1, -1, 0, 2, 3, -1}));
}

TEST(ParsePlacement, Sglang) {
  const PlacementFile f =
      parse_placement(R"({"physical_to_logical_map": [[0, 1, 2, 0], [2, 1, 0, 1]]})");
  EXPECT_EQ(f.ranks, 0);
  const Placement& p = f.placement;
  EXPECT_EQ(p.layers, 2);
  EXPECT_EQ(p.experts, 3);
  EXPECT_EQ(p.physical, 4);
  EXPECT_EQ(p.replica_count, (std::vector<int32_t>{2, 1, 1, 1, 2, 1}));
  EXPECT_EQ(p.log2phy, (std::vector<int32_t>{0, 3, 1, -1, 2, -1, 2, -1, 1, 3, 0, -1}));
  p.validate();
}

TEST(ParsePlacement, MinExperts) {
  // SGLang's map does not say E: the caller's count wins when larger, and every expert needs a
  // slot.
  EXPECT_EQ(parse_placement(R"({"physical_to_logical_map": [[0, 1, 2, 3]]})", 4).placement.experts,
            4);
  EXPECT_EQ(parse_error(R"({"physical_to_logical_map": [[0, 1, 2, 0]]})", 4),
            "p.json: layer 0 expert 3 has no slot in physical_to_logical_map (4 experts; every "
            "one needs at least one slot)");
  EXPECT_NE(parse_error(R"({"physical_to_logical_map": [[0, 1, 2, 0]]})", 5)
                .find("p.json: 5 experts do not fit in 4 physical slots"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"phy2log": [[0, 1, 2, 0]], "experts": 3})", 4)
                .find("p.json: layer 0 expert 3 has no slot in phy2log"),
            std::string::npos);
}

class PlacementFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("eplb_placement_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(PlacementFiles, WriteThenRead) {
  const Placement p = trivial_placement(3, 4, 8);
  const std::string path = (dir_ / "placement.json").string();
  write_placement(path, p, layout_of(4, 8, 4, 2));
  const PlacementFile f = read_placement(path);
  EXPECT_EQ(f.ranks, 4);
  EXPECT_EQ(f.nodes, 2);
  EXPECT_EQ(f.placement.phy2log, p.phy2log);
  EXPECT_EQ(f.placement.log2phy, p.log2phy);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), format_placement(p, layout_of(4, 8, 4, 2)) + "\n");
}

TEST_F(PlacementFiles, IoErrors) {
  const std::string missing = (dir_ / "nope.json").string();
  try {
    read_placement(missing);
    ADD_FAILURE() << "did not throw";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos);
  }
  const Placement p = trivial_placement(1, 2, 2);
  EXPECT_THROW(write_placement((dir_ / "no" / "dir.json").string(), p, layout_of(2, 2, 1, 1)),
               IoError);
}

TEST(BadPlacement, Cases) {
  struct Case {
    const char* content;
    const char* message;
  };
  const Case cases[] = {
      {"", "p.json: the file is empty"},
      {"{\"phy2log\": [[0, 1]", "p.json: not valid JSON at byte"},
      {R"({"phy2log": []})", "p.json: phy2log is an empty array, expected an array of layers"},
      {R"({"phy2log": [[0, 1], [0]]})", "p.json: phy2log[1] has 1 entries, expected 2 (as "
                                        "phy2log[0])"},
      {R"({"phy2log": [[0, -1]]})", "p.json: phy2log[0][1] is -1, expected an integer in [0, "},
      {R"({"phy2log": [[0, 1.5]]})", "p.json: phy2log[0][1] is 1.5, expected an integer"},
      {R"({"phy2log": [[0, "1"]]})", "p.json: phy2log[0][1] is the string '1'"},
      {R"({"phy2log": [[0, 18446744073709551615]]})", "p.json: phy2log[0][1] is "
                                                      "18446744073709551615"},
      {R"({"phy2log": [[0, 2, 0]]})", "p.json: layer 0 expert 1 has no slot in phy2log"},
      {R"({"phy2log": [[0, 2]]})", "p.json: 3 experts do not fit in 2 physical slots"},
      {R"({"phy2log": [[0, 1]], "version": 2})", "p.json: placement file version 2 is not "
                                                 "supported"},
      {R"({"phy2log": [[0, 1]], "layers": 2})", "p.json: \"layers\" is 2 but phy2log has 1 "
                                                "layers"},
      {R"({"phy2log": [[0, 1]], "physical": 3})", "p.json: \"physical\" is 3 but phy2log has 2"},
      {R"({"phy2log": [[0, 1, 2]], "experts": 2})", "p.json: phy2log holds expert 2 but "
                                                    "\"experts\" is 2"},
      {R"({"phy2log": [[0, 1, 0]], "ranks": 2})", "p.json: physical 3 is not a multiple of "
                                                  "ranks 2"},
      {R"({"phy2log": [[0, 1, 0, 1]], "ranks": 2, "nodes": 4})", "p.json: ranks 2 is not a "
                                                                 "multiple of nodes 4"},
      {R"({"phy2log": [[0, 1, 0]], "ranks": 0})", "p.json: ranks is 0, expected an integer in "
                                                  "[1, "},
      {R"({"phy2log": [[0, 1, 0]], "replica_count": [[2, 2]]})",
       "p.json: replica_count[0][1] is 2 but phy2log holds expert 1 in 1 slots"},
      {R"({"phy2log": [[0, 1, 0]], "replica_count": [[2]]})",
       "p.json: replica_count is 1 x 1, expected 1 x 2"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": [[[0], [1]]]})",
       "p.json: log2phy has room for 1 replicas per expert, but phy2log holds an expert in 2"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": [[[0, 1], [1, -1]]]})",
       "p.json: layer 0 expert 0: log2phy replica 1 is slot 1, which does not hold it"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": [[[0, 2], [-1, 1]]]})", "p.json: layer 0 expert 1"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": [[[0, 2], [1, 3]]]})",
       "p.json: log2phy[0][1][1] is 3, expected an integer in [-1, 2]"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": [[[0, 2]]]})", "p.json: log2phy[0] has 1 experts, "
                                                             "expected 2"},
      {R"({"phy2log": [[0, 1, 0]], "log2phy": []})", "p.json: log2phy is an empty array, "
                                                     "expected an array of 1 layers"},
      {R"({"physical_to_logical_map": [[0, 1], [1]]})",
       "p.json: physical_to_logical_map[1] has 1 entries, expected 2"},
      {R"({"physical_to_logical_map": [[0, 2, 2]]})", "p.json: layer 0 expert 1 has no slot"},
      {R"({"placement": 1})", "p.json: a placement file is a JSON object with key \"phy2log\" "
                              "(eplb) or \"physical_to_logical_map\" (SGLang); found keys "
                              "'placement'"},
      {R"([1])", "p.json: a placement file is a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.content);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "input: " << c.content << "\nmessage: " << message;
  }
}

TEST(BadPlacement, DamagedFilesOnlyThrowInvalidArgument) {
  const Placement p = trivial_placement(2, 3, 6);
  const std::vector<std::string> seeds = {
      format_placement(p, layout_of(3, 6, 2, 1)),
      R"({"physical_to_logical_map": [[0, 1, 2, 0], [2, 1, 0, 1]]})",
  };
  const unsigned seed = 7;
  std::mt19937 rng(seed);
  const std::string alphabet = "{}[],:\"0123456789-+eE. \n";
  int parsed = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string text = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < edits && !text.empty(); ++i) {
      const size_t at = rng() % text.size();
      switch (rng() % 3) {
        case 0: text[at] = alphabet[rng() % alphabet.size()]; break;
        case 1: text.erase(at, 1 + rng() % 3); break;
        default: text.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
      }
    }
    try {
      parse_placement(text, rng() % 2 ? 0 : 3, "fuzz").placement.validate();
      ++parsed;
    } catch (const InvalidArgument&) {
    } catch (const std::exception& e) {
      FAIL() << "seed " << seed << ", round " << round << ": input " << text << " threw "
             << e.what();
    }
  }
  EXPECT_GT(parsed, 0);
}

}  // namespace
}  // namespace eplb::stats
