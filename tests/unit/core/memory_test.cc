#include "eplb/core/memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "eplb/core/error.h"
#include "eplb/core/types.h"

namespace eplb {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

TEST(Memory, AvailableIsKnownOnLinux) {
  const int64_t available = memory_available();
  EXPECT_GT(available, 0);
}

TEST(Memory, HumanBytes) {
  EXPECT_EQ(human_bytes(17), "17 B");
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(human_bytes(int64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(human_bytes(kInt64Max), "8.0 EiB");
}

TEST(Memory, CheckFitsNamesBothFigures) {
  EXPECT_NO_THROW(check_fits_in_memory(1024, "a small thing", ""));
  try {
    check_fits_in_memory(kInt64Max, "the load window of 9 steps", "lower the window");
    ADD_FAILURE() << "8 EiB fit";
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("the load window of 9 steps needs 8.0 EiB (9223372036854775807 B) of "
                            "memory, more than the ", 0),
              0u)
        << message;
    EXPECT_NE(message.find("; lower the window"), std::string::npos) << message;
  }
}

TEST(Memory, CheckedArithmetic) {
  EXPECT_EQ(checked_mul(3, 4, "x"), 12);
  EXPECT_EQ(checked_add(3, 4, "x"), 7);
  EXPECT_THROW(checked_mul(kInt64Max, 2, "x"), InvalidArgument);
  EXPECT_THROW(checked_mul(-1, 2, "x"), InvalidArgument);
  EXPECT_THROW(checked_add(kInt64Max, 1, "x"), InvalidArgument);
  try {
    checked_mul(int64_t{1} << 40, int64_t{1} << 40, "the bytes of a rank");
    ADD_FAILURE() << "2^80 fit";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "the bytes of a rank: 1099511627776 x 1099511627776 does not fit a 64-bit count");
  }
}

TEST(Layout, SizesPastTheSupportedAreRefused) {
  Layout ok{.experts = 256, .physical = 288, .ranks = 32, .nodes = 4, .groups = 8};
  EXPECT_NO_THROW(ok.validate());
  Layout experts = ok;
  experts.experts = kMaxExperts + 1;
  experts.physical = kMaxExperts + 1;
  experts.ranks = 1;
  experts.nodes = 1;
  experts.groups = 1;
  EXPECT_THROW(experts.validate(), InvalidArgument);
  Layout ranks{.experts = 8, .physical = 100000, .ranks = 100000, .nodes = 1, .groups = 1};
  try {
    ranks.validate();
    ADD_FAILURE() << "100000 ranks";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "ranks 100000 is outside [1, 65536]");
  }
  Layout physical{.experts = 8, .physical = kMaxPhysical * 2, .ranks = 8, .nodes = 1, .groups = 1};
  EXPECT_THROW(physical.validate(), InvalidArgument);
}

}  // namespace
}  // namespace eplb
