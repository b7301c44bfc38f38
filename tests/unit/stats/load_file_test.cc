#include "eplb/stats/load_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "unit/invalid_message.h"

namespace eplb::stats {
namespace {

namespace fs = std::filesystem;

constexpr char kTracePath[] = EPLB_SOURCE_DIR "/data/flame-moe-290m/routing_top6.csv";

using eplb::test_util::invalid_message;

std::string parse_error(std::string_view content, std::string_view source = "f",
                        LoadFormat format = LoadFormat::kAuto, int64_t experts = 0) {
  return invalid_message([&] { parse_load_history(content, {format, experts}, source); });
}

LoadHistory parse(std::string_view content, LoadFormat format = LoadFormat::kAuto,
                  int64_t experts = 0) {
  return parse_load_history(content, {format, experts}, "test");
}

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("eplb_stats_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// Formats and detection.

TEST(LoadFormatNames, RoundTripAndRejectUnknown) {
  for (const auto format : {LoadFormat::kAuto, LoadFormat::kEplb, LoadFormat::kSglang,
                            LoadFormat::kVllm, LoadFormat::kCsv, LoadFormat::kTrace}) {
    EXPECT_EQ(parse_load_format(load_format_name(format)), format);
  }
  const std::string message = invalid_message([] { parse_load_format("npy"); });
  EXPECT_NE(message.find("'npy'"), std::string::npos) << message;
  EXPECT_NE(message.find("eplb, sglang, vllm, csv or trace"), std::string::npos) << message;
}

TEST(DetectLoadFormat, FromContent) {
  EXPECT_EQ(detect_load_format(R"({"load": [[1]]})"), LoadFormat::kEplb);
  EXPECT_EQ(detect_load_format(" \n{\"logical_count\": [[[1]]]}"), LoadFormat::kSglang);
  EXPECT_EQ(detect_load_format(R"({"load_history": []})"), LoadFormat::kVllm);
  EXPECT_EQ(detect_load_format("layer,token,experts,weights\n2,0,1 2,0.5 0.5\n"),
            LoadFormat::kTrace);
  EXPECT_EQ(detect_load_format("\nlayer, token, experts\n"), LoadFormat::kTrace);
  EXPECT_EQ(detect_load_format("1,2,3\n4,5,6\n"), LoadFormat::kCsv);
  EXPECT_EQ(detect_load_format("layer,expert,load\n"), LoadFormat::kCsv);
  EXPECT_EQ(detect_load_format("\xEF\xBB\xBF{\"load\": [[1]]}"), LoadFormat::kEplb);
  EXPECT_NE(invalid_message([] { detect_load_format(R"({"weights": 1})"); }).find("\"load\""),
            std::string::npos);
  EXPECT_NE(invalid_message([] { detect_load_format("  \n"); }).find("empty"), std::string::npos);
}

TEST(ParseLoad, EplbMatrix) {
  const LoadHistory h = parse(R"({"load": [[1, 2, 3], [4.5, 0, 6e2]]})");
  EXPECT_EQ(h.format, LoadFormat::kEplb);
  EXPECT_EQ(h.steps, 1);
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 3);
  EXPECT_EQ(h.values, (std::vector<double>{1, 2, 3, 4.5, 0, 600}));
  const LoadMatrix m = h.sum();
  EXPECT_EQ(m.layers, 2);
  EXPECT_EQ(m.experts, 3);
  EXPECT_EQ(m.values, h.values);
}

TEST(ParseLoad, EplbStepsAreSummed) {
  const LoadHistory h = parse(R"({"load": [[[1, 2], [3, 4]], [[10, 20], [30, 40]],
                                           [[0.5, 0], [0, 0]]]})");
  EXPECT_EQ(h.steps, 3);
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 2);
  EXPECT_EQ(h.step(1)[3], 40);
  EXPECT_EQ(h.sum().values, (std::vector<double>{11.5, 22, 33, 44}));
}

TEST(ParseLoad, SglangLogicalCount) {
  const LoadHistory h = parse(R"({"logical_count": [[[1, 2, 3]], [[4, 5, 6]]], "other": 1})");
  EXPECT_EQ(h.format, LoadFormat::kSglang);
  EXPECT_EQ(h.steps, 2);
  EXPECT_EQ(h.layers, 1);
  EXPECT_EQ(h.sum().values, (std::vector<double>{5, 7, 9}));
  // SGLang also accepts a single [layers][experts] matrix.
  EXPECT_EQ(parse(R"({"logical_count": [[1, 2], [3, 4]]})").steps, 1);
}

TEST(ParseLoad, VllmLoadHistory) {
  const LoadHistory h = parse(R"({"load_history": [
      {"logical_expert_load": [[1, 2], [3, 4]], "step": 0},
      {"logical_expert_load": [[5, 6], [7, 8]]}]})");
  EXPECT_EQ(h.format, LoadFormat::kVllm);
  EXPECT_EQ(h.steps, 2);
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 2);
  EXPECT_EQ(h.sum().values, (std::vector<double>{6, 8, 10, 12}));
}

TEST(ParseLoad, CsvMatrix) {
  const LoadHistory h = parse("# loads\r\n1, 2,3\r\n\r\n4,5.5,+6\r\n");
  EXPECT_EQ(h.format, LoadFormat::kCsv);
  EXPECT_EQ(h.steps, 1);
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 3);
  EXPECT_EQ(h.values, (std::vector<double>{1, 2, 3, 4, 5.5, 6}));
  // Whitespace-separated, as numpy.savetxt writes by default.
  const LoadHistory w = parse("1.000000000000000000e+00 2\t3\n4 5 6\n");
  EXPECT_EQ(w.values, (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

TEST(ParseLoad, TraceCountsEveryListedExpert) {
  // Layers listed out of order and interleaved; numbers 7 and 3 become layers 1 and 0.
  const std::string trace =
      "layer,token,experts,weights\n"
      "7,0,1 2,0.5 0.5\n"
      "3,1,0 4,0.5 0.5\n"
      "3,0,4 1,0.5 0.5\n"
      "7,1,2 0,0.5 0.5\n";
  const LoadHistory h = parse(trace);
  EXPECT_EQ(h.format, LoadFormat::kTrace);
  EXPECT_EQ(h.steps, 2);  // one per token
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.experts, 5);  // largest id + 1
  EXPECT_EQ(h.sum().values, (std::vector<double>{1, 1, 0, 0, 2, 1, 1, 2, 0, 0}));
  // Step 0 is token 0 of both layers.
  EXPECT_EQ(std::vector<double>(h.step(0), h.step(0) + 10),
            (std::vector<double>{0, 1, 0, 0, 1, 0, 1, 1, 0, 0}));

  const RoutingTrace t = parse_routing_trace(trace, 0, "t");
  EXPECT_EQ(t.layers, 2);
  EXPECT_EQ(t.tokens, 2);
  EXPECT_EQ(t.top_k, 2);
  EXPECT_EQ(t.experts, 5);
  EXPECT_EQ(t.layer_ids, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(t.routes, (std::vector<int32_t>{4, 1, 0, 4, 1, 2, 2, 0}));
}

TEST(ParseLoad, TraceExpertsOptionWidensAndBounds) {
  const std::string trace = "layer,token,experts,weights\n2,0,1 3,0.1 0.1\n";
  EXPECT_EQ(parse(trace).experts, 4);
  const LoadHistory h = parse(trace, LoadFormat::kAuto, 8);
  EXPECT_EQ(h.experts, 8);
  EXPECT_EQ(h.sum().values, (std::vector<double>{0, 1, 0, 1, 0, 0, 0, 0}));
  EXPECT_EQ(parse_routing_trace(trace, 8).experts, 8);
  // A smaller value is refused (it never cuts the file's experts), naming the line.
  EXPECT_EQ(parse_error(trace, "t.csv", LoadFormat::kAuto, 2),
            "t.csv line 2, column 3: expert 3 is outside [0, 2), the 2 experts per layer given");
}

TEST(ParseLoad, TraceWeightsAreOptional) {
  const LoadHistory a = parse("layer,token,experts\n0,0,1 0\n0,1,1 2\n");
  EXPECT_EQ(a.sum().values, (std::vector<double>{1, 2, 1}));
  const LoadHistory b = parse("layer,token,experts,weights\n0,0,\"1 0\",\n0,1,1 2,x y\n");
  EXPECT_EQ(b.sum().values, a.sum().values);
}

TEST(ParseLoad, ExpertsOptionWidensOtherFormats) {
  const LoadHistory h = parse(R"({"load": [[1, 2], [3, 4]]})", LoadFormat::kAuto, 3);
  EXPECT_EQ(h.experts, 3);
  EXPECT_EQ(h.values, (std::vector<double>{1, 2, 0, 3, 4, 0}));
}

TEST(BundledTrace, MatchesItsReadme) {
  const LoadHistory h = read_load_history(kTracePath);
  EXPECT_EQ(h.format, LoadFormat::kTrace);
  EXPECT_EQ(h.steps, 2048);
  EXPECT_EQ(h.layers, 8);
  EXPECT_EQ(h.experts, 64);
  const LoadMatrix m = read_load(kTracePath);
  // The data README's per-layer max/mean, to 2 decimals, and the exact busiest expert of each
  // layer (the README rounds layer 0's 358/192 = 1.8646 up to 1.87).
  const std::vector<double> readme = {1.87, 1.66, 1.38, 1.43, 1.39, 1.46, 1.43, 1.59};
  const std::vector<double> busiest = {358, 319, 264, 274, 267, 280, 275, 306};
  for (int64_t l = 0; l < m.layers; ++l) {
    const auto row = m.row(l);
    const double total = std::accumulate(row.begin(), row.end(), 0.0);
    EXPECT_EQ(total, 2048.0 * 6) << "layer " << l;
    const double most = *std::max_element(row.begin(), row.end());
    EXPECT_EQ(most, busiest[l]) << "layer " << l;
    EXPECT_NEAR(most / (total / 64), readme[l], 0.01) << "layer " << l;
  }

  const RoutingTrace t = read_routing_trace(kTracePath);
  EXPECT_EQ(t.layers, 8);
  EXPECT_EQ(t.tokens, 2048);
  EXPECT_EQ(t.top_k, 6);
  EXPECT_EQ(t.experts, 64);
  EXPECT_EQ(t.layer_ids, (std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9}));
  // First row of the file: "2,0,34 28 21 47 3 12,...".
  EXPECT_EQ(std::vector<int32_t>(t.routes.begin(), t.routes.begin() + 6),
            (std::vector<int32_t>{34, 28, 21, 47, 3, 12}));
  EXPECT_EQ(read_routing_trace(kTracePath, 128).experts, 128);
}

// ---------------------------------------------------------------------------------------------
// Overrides.

TEST(ParseLoad, FormatOverrides) {
  const std::string trace = "layer,token,experts,weights\n2,0,1 3,0.1 0.1\n";
  // As a matrix, the header is not numbers.
  const std::string as_csv = parse_error(trace, "t.csv", LoadFormat::kCsv);
  EXPECT_NE(as_csv.find("t.csv line 1, column 1: 'layer' is not a number"), std::string::npos)
      << as_csv;
  // A matrix read as a trace lacks the header.
  const std::string as_trace = parse_error("1,2\n", "m.csv", LoadFormat::kTrace);
  EXPECT_NE(as_trace.find("m.csv line 1: expected the header"), std::string::npos) << as_trace;
  // A JSON format on CSV content.
  EXPECT_NE(parse_error("1,2\n", "m.csv", LoadFormat::kEplb).find("not valid JSON at byte"),
            std::string::npos);
  // The key of the named format is required even when another one is there.
  const std::string doc = R"({"load": [[1]], "logical_count": [[[2, 3]]]})";
  EXPECT_EQ(parse(doc).values, (std::vector<double>{1}));
  EXPECT_EQ(parse(doc, LoadFormat::kSglang).values, (std::vector<double>{2, 3}));
  EXPECT_EQ(parse(doc, LoadFormat::kSglang).format, LoadFormat::kSglang);
  const std::string missing = parse_error(doc, "x.json", LoadFormat::kVllm);
  EXPECT_NE(missing.find("x.json: as vllm loads, expected a JSON object with key "
                         "\"load_history\""),
            std::string::npos)
      << missing;
}

// ---------------------------------------------------------------------------------------------
// Broken files: InvalidArgument naming the source and the position.

TEST(BadLoad, EveryBrokenFileKind) {
  EXPECT_EQ(parse_error(R"({"load": [[1,2,3],[4,5]]})", "ragged.json"),
            "ragged.json: load[1] has 2 experts, expected 3 (as load[0])");
  const std::string neg = parse_error(R"({"load": [[1,-2,3,4]]})", "neg.json");
  EXPECT_NE(neg.find("neg.json: load[0][1] is -2"), std::string::npos) << neg;
  const std::string trunc = parse_error(R"({"load": [[1,2,)", "trunc.json");
  EXPECT_NE(trunc.find("trunc.json: not valid JSON at byte 16"), std::string::npos) << trunc;
  const std::string empty = parse_error("", "empty.json");
  EXPECT_NE(empty.find("empty.json: the file is empty"), std::string::npos) << empty;
  EXPECT_EQ(parse_error("1,2,x,4\n", "bad.csv"), "bad.csv line 1, column 3: 'x' is not a number");
  const std::string nan = parse_error(R"({"load": [[NaN,1,2,3]]})", "nan.json");
  EXPECT_NE(nan.find("nan.json: not valid JSON at byte 12"), std::string::npos) << nan;
  EXPECT_NE(nan.find("NaN"), std::string::npos) << nan;
  // A trace may name any expert id: the caller decides whether its slots suffice.
  EXPECT_EQ(parse("layer,token,experts,weights\n2,0,1 2 999,0.1 0.1 0.1\n").experts, 1000);
}

TEST(BadLoad, JsonShapesAndValues) {
  struct Case {
    const char* content;
    const char* message;
  };
  const Case cases[] = {
      {R"({"load": []})", "f: load is an empty array, expected an array of layers"},
      {R"({"load": [[]]})", "f: load[0] is an empty array, expected an array of loads"},
      {R"({"load": [1, 2]})", "f: load[0] is 1, expected an array of loads"},
      {R"({"load": 3})", "f: load is 3, expected an array of layers"},
      {R"({"load": [[1, "2"]]})", "f: load[0][1] is the string '2', expected a non-negative"},
      {R"({"load": [[1, null]]})", "f: load[0][1] is null, expected a non-negative number"},
      {R"({"load": [[1, true]]})", "f: load[0][1] is true"},
      {R"({"load": [[1, [2]]]})", "f: load[0][1] is an array"},
      {R"({"load": [[1, -0.5]]})", "f: load[0][1] is -0.5 (loads must be finite, non-negative"},
      {R"({"load": [[[1, 2]], [[3]]]})",
       "f: load[1][0] has 1 experts, expected 2 (as load[0][0])"},
      {R"({"load": [[[1, 2]], [[3, 4], [5, 6]]]})",
       "f: load[1] has 2 layers, expected 1 (as load[0])"},
      {R"({"load": [[[1, 2]], [3, 4]]})", "f: load[1] has 2 layers, expected 1 (as load[0])"},
      {R"({"load": [[[1, 2]], [3]]})", "f: load[1][0] is 3, expected an array of loads"},
      {R"({"load": [[1, 1e999]]})", "f: not valid JSON: number overflow"},
      {R"({"load": [[1, Infinity]]})", "NaN and Infinity are not JSON numbers"},
      {R"({"logical_count": [[[1, 2]], [[1, 2, 3]]]})",
       "f: logical_count[1][0] has 3 experts, expected 2 (as logical_count[0][0])"},
      {R"({"load_history": []})", "f: load_history is an empty array"},
      {R"({"load_history": [{"x": 1}]})",
       "f: load_history[0] is an object without key \"logical_expert_load\""},
      {R"({"load_history": [{"logical_expert_load": [[1]]}, {"logical_expert_load": [[1, 2]]}]})",
       "f: load_history[1].logical_expert_load[0] has 2 experts, expected 1 (as "
       "load_history[0].logical_expert_load[0])"},
      {R"({"weights": [[1]]})", "f: a JSON load file needs key \"load\""},
      {R"([[1, 2]])", "f: a JSON load file is an object"},
      {R"({"load": [[1]]} trailing)", "f: not valid JSON at byte 19"},
      {"{\"load\": [[1, 2]], \"\xff\": 1}", "f: not valid JSON at byte"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.content);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "input: " << c.content << "\nmessage: " << message;
  }
}

TEST(BadLoad, CsvCases) {
  struct Case {
    const char* content;
    const char* message;
  };
  const Case cases[] = {
      {"1,2,3\n4,5\n", "f line 2 has 2 loads, expected 3 (as line 1)"},
      {"# c\n1,2\n\n4,5,6\n", "f line 4 has 3 loads, expected 2 (as line 2)"},
      {"1,-2\n", "f line 1, column 2: '-2' is negative"},
      {"1,nan\n", "f line 1, column 2: 'nan' is not finite"},
      {"1,inf\n", "f line 1, column 2: 'inf' is not finite"},
      {"1,,3\n", "f line 1, column 2: '' is empty, expected a number"},
      {"1,2,\n", "f line 1, column 3: '' is empty"},
      {"1,1e999\n", "f line 1, column 2: '1e999' is out of range"},
      {"1,2 3\n", "f line 1, column 2: '2 3' is not a number"},
      {"1,0x10\n", "f line 1, column 2: '0x10' is not a number"},
      {"1,++2\n", "f line 1, column 2: '++2' is not a number"},
      {"# only a comment\n", "f: no loads found"},
      {"1,\x01\n", "f line 1, column 2: '\\x01' is not a number"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.content);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "input: " << c.content << "\nmessage: " << message;
  }
}

TEST(BadLoad, TraceCases) {
  struct Case {
    const char* content;
    const char* message;
  };
  const std::string h = "layer,token,experts,weights\n";
  const Case cases[] = {
      {"layer,token,experts,weights\n", "f: the routing trace has a header but no rows"},
      {"layer,token,experts,weights\n2,0\n", "f line 2 has 2 columns, expected"},
      {"layer,token,experts,weights\nx,0,1,0.1\n", "f line 2, column 1: layer 'x' is not"},
      {"layer,token,experts,weights\n2,1.5,1,0.1\n", "f line 2, column 2: token '1.5' is not"},
      {"layer,token,experts,weights\n2,0,,\n", "f line 2, column 3: no experts listed"},
      {"layer,token,experts,weights\n2,0,1 -3,0.1 0.1\n",
       "f line 2, column 3: expert '-3' is not an expert id"},
      {"layer,token,experts,weights\n2,0,1 a,0.1 0.1\n", "f line 2, column 3: expert 'a'"},
      {"layer,token,experts,weights\n2,0,1 99999999,0.1 0.1\n", "expert '99999999' is not"},
      {"layer,token,experts,weights\n2,0,1 1,0.1 0.1\n", "f line 2, column 3: expert 1 is "
                                                         "listed twice"},
      {"layer,token,experts,weights\n2,0,1 2,.1 .1\n2,1,1,.1\n",
       "f line 3: token 1 of layer 2 lists 1 experts, expected 2 (as line 2)"},
      {"layer,token,experts,weights\n2,0,1,.1\n2,0,2,.1\n",
       "f: layer 2 lists token 0 twice (lines 2 and 3)"},
      {"layer,token,experts,weights\n2,0,1,.1\n2,1,1,.1\n3,0,1,.1\n",
       "f: layer 3 has 1 tokens, expected 2 (as layer 2)"},
      {"layer,token,experts,weights\n2,0,1,.1\n3,1,1,.1\n",
       "f: layer 3 has no token 0 but layer 2 has it"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.content);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "input: " << c.content << "\nmessage: " << message;
    const std::string trace_message =
        invalid_message([&] { parse_routing_trace(c.content, 0, "f"); });
    EXPECT_EQ(trace_message, message);
  }
  EXPECT_NE(invalid_message([] { parse_routing_trace("1,2\n", 0, "f"); })
                .find("f line 1: expected the header 'layer,token,experts,weights'"),
            std::string::npos);
  EXPECT_NE(invalid_message([] { parse_routing_trace("", 0, "f"); }).find("f: the file is empty"),
            std::string::npos);
}

TEST(BadLoad, ExpertsOptionOutOfRange) {
  EXPECT_NE(invalid_message([] { parse("1\n", LoadFormat::kAuto, -1); }).find("experts -1"),
            std::string::npos);
}

TEST_F(TempDir, MissingFileIsAnIoError) {
  const std::string path = (dir_ / "nope.json").string();
  try {
    read_load(path);
    ADD_FAILURE() << "did not throw";
  } catch (const IoError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("No such file or directory"), std::string::npos) << message;
  }
  EXPECT_NE(invalid_message([&] { read_load(dir_.string()); }).find("is a directory, not a file"),
            std::string::npos);
}

// Devices are refused before a byte is read (/dev/zero would never end); a pipe is read, up
// to kMaxStreamBytes; a regular file whatever its size.
TEST_F(TempDir, DevicesAreRefusedPipesRead) {
  EXPECT_EQ(invalid_message([] { read_file("/dev/zero"); }),
            "/dev/zero is a character device, not a file (give a regular file, or a pipe of at "
            "most 4 GiB)");
  EXPECT_NE(invalid_message([] { read_load("/dev/null"); }).find("character device"),
            std::string::npos);
  const std::string fifo = (dir_ / "loads.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::thread writer([&] { std::ofstream(fifo) << R"({"load": [[3, 1]]})"; });
  const LoadMatrix load = read_load(fifo);
  writer.join();
  EXPECT_EQ(load.values, (std::vector<double>{3, 1}));
}

// A row of more loads than eplb has experts is refused while parsing, naming where it is.
TEST(LoadLimits, RowsLongerThanTheLargestExpertCountAreRefused) {
  const auto row = [](int64_t n) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += i == 0 ? "1" : ",1";
    return out;
  };
  EXPECT_EQ(parse_error(R"({"load": [[1, 2], [)" + row(kMaxExperts + 1) + "]]}"),
            "f: load[1] holds more than 65536 numbers; eplb supports at most 65536 experts per "
            "layer");
  EXPECT_EQ(parse_error(R"({"load_history": [{"logical_expert_load": [[)" +
                        row(kMaxExperts + 1) + "]]}]}"),
            "f: load_history[0].logical_expert_load[0] holds more than 65536 numbers; eplb "
            "supports at most 65536 experts per layer");
  EXPECT_EQ(parse_load_history(R"({"load": [[)" + row(kMaxExperts) + "]]}", {}).experts,
            kMaxExperts);
  EXPECT_EQ(parse_error(row(kMaxExperts + 1) + "\n"),
            "f line 1 has more than 65536 loads; eplb supports at most 65536 experts per layer");
  // Many steps of short rows are no long row.
  std::string steps = R"({"load": [)";
  for (int i = 0; i < 70000; ++i) steps += i == 0 ? "[[1]]" : ",[[1]]";
  EXPECT_EQ(parse_load_history(steps + "]}", {}).steps, 70000);
}

// LoadReadOptions::experts is the number of experts, not a minimum: an id or a row beyond it
// is an error naming where it is; fewer are widened with zero loads.
TEST(LoadLimits, GivenExpertsBoundTheInput) {
  const std::string trace = "layer,token,experts\n0,0,1 2 999\n0,1,3 4 5\n";
  EXPECT_EQ(invalid_message([&] { parse_routing_trace(trace, 8, "t.csv"); }),
            "t.csv line 2, column 3: expert 999 is outside [0, 8), the 8 experts per layer given");
  EXPECT_EQ(invalid_message([&] { parse_load_history(trace, {LoadFormat::kAuto, 8}, "t.csv"); }),
            "t.csv line 2, column 3: expert 999 is outside [0, 8), the 8 experts per layer given");
  EXPECT_EQ(parse_routing_trace(trace, 1000).experts, 1000);
  EXPECT_EQ(parse_error(R"({"load": [[1, 2, 3]]})", "f", LoadFormat::kAuto, 2),
            "f: 3 experts per layer, more than the 2 given");
  const LoadHistory wide = parse_load_history("1,2\n", {LoadFormat::kAuto, 4});
  EXPECT_EQ(wide.values, (std::vector<double>{1, 2, 0, 0}));
}

TEST_F(TempDir, ReadNamesThePathInMessages) {
  const std::string path = write("ragged.json", R"({"load": [[1,2,3],[4,5]]})");
  const std::string message = invalid_message([&] { read_load(path); });
  EXPECT_EQ(message, path + ": load[1] has 2 experts, expected 3 (as load[0])");
  const std::string huge = write("huge.json", R"({"load": [[[1e308, 1]], [[1e308, 1]]]})");
  EXPECT_EQ(read_load_history(huge).steps, 2);
  EXPECT_EQ(invalid_message([&] { read_load(huge); }),
            huge + ": the load of layer 0 expert 0 summed over steps is too large for a double");
  const std::string ok = write("ok.csv", "1,2\n3,4\n");
  EXPECT_EQ(read_load(ok).values, (std::vector<double>{1, 2, 3, 4}));
}

// ---------------------------------------------------------------------------------------------
// Writers round-trip through the readers.

TEST(WriteLoad, RoundTrips) {
  LoadHistory h;
  h.steps = 2;
  h.layers = 2;
  h.experts = 3;
  h.values = {0, 1, 2, 0.1, 1e-7, 123456789.125, 3, 4, 5, 1e20, 2.5, 1.0 / 3};
  const std::string eplb = format_load_eplb(h);
  EXPECT_EQ(eplb.substr(0, 20), "{\"load\":[[[0,1,2],[0");
  const LoadHistory a = parse(eplb);
  EXPECT_EQ(a.format, LoadFormat::kEplb);
  EXPECT_EQ(a.steps, 2);
  EXPECT_EQ(a.layers, 2);
  EXPECT_EQ(a.experts, 3);
  EXPECT_EQ(a.values, h.values);  // exact: shortest round-trip representation

  const std::string sglang = format_load_sglang(h);
  EXPECT_EQ(sglang.substr(0, 18), "{\"logical_count\":[");
  const LoadHistory b = parse(sglang);
  EXPECT_EQ(b.format, LoadFormat::kSglang);
  EXPECT_EQ(b.steps, 2);
  EXPECT_EQ(b.values, h.values);

  // A trace's history written as eplb's format reads back with the same sum.
  const LoadHistory trace = read_load_history(kTracePath);
  const LoadHistory back = parse(format_load_eplb(trace));
  EXPECT_EQ(back.steps, trace.steps);
  EXPECT_EQ(back.sum().values, trace.sum().values);
}

TEST(WriteLoad, EveryFormatReadsBackTheSameLoads) {
  LoadHistory h;
  h.steps = 2;
  h.layers = 2;
  h.experts = 3;
  h.values = {0, 1, 2, 0.1, 1e-7, 123456789.125, 3, 4, 5, 1e20, 2.5, 1.0 / 3};
  for (const LoadFormat format : {LoadFormat::kEplb, LoadFormat::kSglang, LoadFormat::kVllm}) {
    const LoadHistory back = parse(format_load(h, format));
    EXPECT_EQ(back.format, format);
    EXPECT_EQ(back.steps, 2);
    EXPECT_EQ(back.values, h.values) << load_format_name(format);
  }
  // A matrix has no steps: CSV holds their sum.
  const LoadHistory csv = parse(format_load(h, LoadFormat::kCsv));
  EXPECT_EQ(csv.format, LoadFormat::kCsv);
  EXPECT_EQ(csv.steps, 1);
  EXPECT_EQ(csv.values, h.sum().values);
  // One step of SGLang's is [L][E], as its published statistics are.
  h.steps = 1;
  h.values.resize(6);
  EXPECT_EQ(format_load(h, LoadFormat::kSglang).substr(0, 22), "{\"logical_count\":[[0,1");
  EXPECT_EQ(parse(format_load(h, LoadFormat::kSglang)).values, h.values);
  EXPECT_THROW(format_load(h, LoadFormat::kTrace), InvalidArgument);
  EXPECT_THROW(format_load(h, LoadFormat::kAuto), InvalidArgument);
}

TEST(ParseLoad, SglangStatisticsWithDenseLayers) {
  const LoadHistory h = read_load_history(EPLB_SOURCE_DIR
                                          "/data/deepseek-v3-sglang/prefill_in1024.json");
  EXPECT_EQ(h.format, LoadFormat::kSglang);
  EXPECT_EQ(h.steps, 1);
  EXPECT_EQ(h.layers, 61);
  EXPECT_EQ(h.experts, 256);
  for (int64_t l = 0; l < 61; ++l) {
    const double total = std::accumulate(h.values.begin() + l * 256,
                                         h.values.begin() + (l + 1) * 256, 0.0);
    EXPECT_EQ(total == 0, l < 3) << "layer " << l;  // DeepSeek-V3's dense layers 0-2
  }
}

TEST(WriteLoad, RejectsBrokenHistories) {
  LoadHistory h;
  h.steps = 1;
  h.layers = 1;
  h.experts = 2;
  h.values = {1};
  EXPECT_THROW(format_load_eplb(h), InvalidArgument);
  h.values = {1, std::nan("")};
  EXPECT_THROW(format_load_sglang(h), InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Damaged copies of valid files: only InvalidArgument may come out (a small, fixed-seed cousin
// of the fuzzers under fuzz/).

TEST(BadLoad, DamagedFilesOnlyThrowInvalidArgument) {
  const std::vector<std::string> seeds = {
      R"({"load": [[1, 2, 3], [4, 5, 6]]})",
      R"({"load": [[[1, 2]], [[3, 4]]]})",
      R"({"logical_count": [[[1, 2.5]], [[3, 4]]]})",
      R"({"load_history": [{"logical_expert_load": [[1, 2]]}]})",
      "1,2,3\n4,5,6\n",
      "layer,token,experts,weights\n2,0,1 2,0.5 0.5\n2,1,0 3,0.5 0.5\n3,0,1 2,.5 .5\n"
      "3,1,2 3,.5 .5\n",
  };
  const unsigned seed = 20240611;
  std::mt19937 rng(seed);
  const std::string alphabet = "{}[],:\"0123456789.-+eE \n\r\tNaI#layertokn";
  int parsed = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string text = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < edits && !text.empty(); ++i) {
      const size_t at = rng() % text.size();
      switch (rng() % 4) {
        case 0: text[at] = alphabet[rng() % alphabet.size()]; break;
        case 1: text.erase(at, 1 + rng() % 3); break;
        case 2: text.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: text.resize(at); break;
      }
    }
    try {
      const LoadHistory h = parse_load_history(text, {}, "fuzz");
      ASSERT_EQ(h.values.size(), static_cast<size_t>(h.steps * h.layers * h.experts)) << text;
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
