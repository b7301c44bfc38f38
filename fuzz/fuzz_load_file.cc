// parse_load_history with format detection, then the invariants of a LoadHistory and round
// trips through eplb's writers (eplb's format, and CSV's sum of the steps).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace eplb::stats;
  const std::string_view content(reinterpret_cast<const char*>(data), size);
  LoadHistory history;
  try {
    history = parse_load_history(content, {}, "<fuzz>");
  } catch (const eplb::InvalidArgument&) {
    return 0;
  }
  EPLB_FUZZ_ASSERT(history.steps > 0 && history.layers > 0 && history.experts > 0);
  EPLB_FUZZ_ASSERT(history.format != LoadFormat::kAuto);
  EPLB_FUZZ_ASSERT(history.values.size() ==
                   static_cast<size_t>(history.steps * history.layers * history.experts));
  for (const double v : history.values) EPLB_FUZZ_ASSERT(std::isfinite(v) && v >= 0);
  const eplb::LoadMatrix sum = history.sum();
  EPLB_FUZZ_ASSERT(sum.layers == history.layers && sum.experts == history.experts);

  // The experts per layer given (LoadReadOptions::experts): a history narrower than that is
  // widened with zero loads, a wider one is refused, and nothing else changes.
  const int64_t given = 1 + (size > 0 ? data[size - 1] % 16 : 0);
  try {
    const LoadHistory wide = parse_load_history(content, {LoadFormat::kAuto, given}, "<fuzz>");
    EPLB_FUZZ_ASSERT(history.experts <= given && wide.experts == given);
    EPLB_FUZZ_ASSERT(wide.steps == history.steps && wide.layers == history.layers);
    for (int64_t r = 0; r < history.steps * history.layers; ++r) {
      for (int64_t e = 0; e < given; ++e) {
        const double v = wide.values[static_cast<size_t>(r * given + e)];
        EPLB_FUZZ_ASSERT(v == (e < history.experts
                                   ? history.values[static_cast<size_t>(r * history.experts + e)]
                                   : 0.0));
      }
    }
  } catch (const eplb::InvalidArgument&) {
    EPLB_FUZZ_ASSERT(history.experts > given);
  }

  // Small histories only: a trace may legitimately expand into many dense values.
  if (history.values.size() <= (size_t{1} << 16)) {
    try {
      const LoadHistory back = parse_load_history(format_load_eplb(history), {}, "<round trip>");
      EPLB_FUZZ_ASSERT(back.steps == history.steps && back.layers == history.layers &&
                       back.experts == history.experts && back.values == history.values);
    } catch (const eplb::InvalidArgument&) {
      EPLB_FUZZ_ASSERT(!"a written history did not read back");
    }
    // CSV holds the steps' sum: it reads back exactly, or is refused (a sum past the largest
    // double, or a sum of integer counts past 2^53 that a double may have rounded).
    try {
      const LoadHistory csv =
          parse_load_history(format_load(history, LoadFormat::kCsv), {}, "<csv round trip>");
      EPLB_FUZZ_ASSERT(csv.values == sum.values);
    } catch (const eplb::InvalidArgument&) {
    }
  }
  return 0;
}
