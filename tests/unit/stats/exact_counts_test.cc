// Integer counts stay exact through the load files or are refused: loads are doubles, which
// hold every integer up to 2^53 and round some above it, so a count written as an integer
// above 2^53 is refused when read, a double above it is never written as if it were an exact
// integer, and CSV (which sums the steps) refuses a sum of counts past it.

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/core/types.h"
#include "eplb/stats/load_file.h"

namespace eplb::stats {
namespace {

LoadHistory parse(std::string_view content) { return parse_load_history(content, {}, "f"); }

std::string message_of(std::string_view content) {
  try {
    parse_load_history(content, {}, "f");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

std::string format_message(const LoadHistory& h, LoadFormat format) {
  try {
    format_load(h, format);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(ExactCounts, IntegersAboveTwoToThe53AreRefusedNamingTheirPlace) {
  struct Case {
    const char* content;
    const char* message;
  };
  const Case cases[] = {
      // int64's largest, which a double would read as 9223372036854775808.
      {R"({"load": [[1, 9223372036854775807]]})",
       "f: load[0][1] is 9223372036854775807, above 9007199254740992 (2^53)"},
      // One past 2^53, which a double would read as 2^53 itself.
      {R"({"logical_count": [[[9007199254740993, 1]]]})",
       "f: logical_count[0][0][0] is 9007199254740993, above 9007199254740992"},
      // Too long for 64 bits: nlohmann reads it as a float, its digits still say integer.
      {R"({"load_history": [{"logical_expert_load": [[2, 99999999999999999999]]}]})",
       "f: load_history[0].logical_expert_load[0][1] is 99999999999999999999, above"},
      {"1,9223372036854775807\n",
       "f line 1, column 2: '9223372036854775807' is an integer above 9007199254740992 (2^53)"},
      {"1,+9007199254740993\n", "f line 1, column 2: '+9007199254740993' is an integer above"},
      {"1,99999999999999999999\n", "f line 1, column 2: '99999999999999999999' is an integer"},
  };
  for (const Case& c : cases) {
    const std::string message = message_of(c.content);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "input: " << c.content << "\nmessage: " << message;
  }
}

TEST(ExactCounts, TwoToThe53AndFloatsAboveItAreTaken) {
  EXPECT_EQ(parse(R"({"load": [[9007199254740992, 1]]})").values,
            (std::vector<double>{9007199254740992.0, 1}));
  EXPECT_EQ(parse("9007199254740992,1\n").values,
            (std::vector<double>{9007199254740992.0, 1}));
  // Written as floats: approximate by their notation, taken as doubles.
  EXPECT_EQ(parse(R"({"load": [[1e20, 9223372036854775807.0]]})").values,
            (std::vector<double>{1e20, 9223372036854775807.0}));
  EXPECT_EQ(parse("1e20,9223372036854775807.0\n").values,
            (std::vector<double>{1e20, 9223372036854775807.0}));
  // A large integer outside the arrays of loads is no count.
  EXPECT_EQ(parse(R"({"load": [[1, 2]], "seen": 99999999999999999999})").values,
            (std::vector<double>{1, 2}));
}

// A double above 2^53 whose shortest text is all digits (9223372036854775808) is written in
// scientific notation: the file reads back to the same double and never states an exact count
// the double does not hold.
TEST(ExactCounts, DoublesAboveTwoToThe53AreWrittenAsFloats) {
  LoadHistory h;
  h.steps = 1;
  h.layers = 1;
  h.experts = 3;
  h.values = {9223372036854775808.0, 9007199254740992.0, 3};
  const std::string text = format_load_eplb(h);
  EXPECT_EQ(text, "{\"load\":[[[9.223372036854776e+18,9007199254740992,3]]]}\n");
  EXPECT_EQ(parse(text).values, h.values);
}

TEST(ExactCounts, CsvRefusesASumOfCountsPastTwoToThe53) {
  LoadHistory h;
  h.steps = 2;
  h.layers = 1;
  h.experts = 2;
  // 2^53 + 1 is rounded to 2^53 in a double: CSV would write a count that is off by one.
  h.values = {9007199254740992.0, 1, 1, 1};
  EXPECT_NE(format_message(h, LoadFormat::kCsv)
                .find("the counts of layer 0 expert 0 sum over 2 steps past 9007199254740992"),
            std::string::npos)
      << format_message(h, LoadFormat::kCsv);
  // The formats that keep the steps write them exactly.
  for (const LoadFormat format : {LoadFormat::kEplb, LoadFormat::kSglang, LoadFormat::kVllm}) {
    EXPECT_EQ(parse(format_load(h, format)).values, h.values);
  }
  // At 2^53 exactly, the sum is exact and written.
  h.values = {4503599627370496.0, 1, 4503599627370496.0, 1};
  EXPECT_EQ(format_load(h, LoadFormat::kCsv), "9007199254740992,2\n");
  // Floats (not counts) are summed as floats.
  h.values = {1e20, 1, 0.5, 1};
  EXPECT_NO_THROW(format_load(h, LoadFormat::kCsv));
}

}  // namespace
}  // namespace eplb::stats
