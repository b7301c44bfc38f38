// parse_routing_trace, then the invariants of a RoutingTrace and agreement with the trace read
// as a load history.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace eplb::stats;
  const std::string_view content(reinterpret_cast<const char*>(data), size);
  RoutingTrace trace;
  try {
    trace = parse_routing_trace(content, 0, "<fuzz>");
  } catch (const eplb::InvalidArgument&) {
    return 0;
  }
  EPLB_FUZZ_ASSERT(trace.layers > 0 && trace.tokens > 0 && trace.top_k > 0 && trace.experts > 0);
  EPLB_FUZZ_ASSERT(trace.layer_ids.size() == static_cast<size_t>(trace.layers));
  for (size_t i = 1; i < trace.layer_ids.size(); ++i) {
    EPLB_FUZZ_ASSERT(trace.layer_ids[i - 1] < trace.layer_ids[i]);
  }
  EPLB_FUZZ_ASSERT(trace.routes.size() ==
                   static_cast<size_t>(trace.layers * trace.tokens * trace.top_k));
  int32_t largest = -1;
  for (const int32_t e : trace.routes) {
    EPLB_FUZZ_ASSERT(e >= 0 && e < trace.experts);
    if (e > largest) largest = e;
  }
  EPLB_FUZZ_ASSERT(largest + 1 == trace.experts);

  // With the experts per layer given, an id at or above it is refused, fewer widen the trace.
  const int64_t given = 1 + (size > 0 ? data[size - 1] % 32 : 0);
  try {
    const RoutingTrace bounded = parse_routing_trace(content, given, "<fuzz>");
    EPLB_FUZZ_ASSERT(trace.experts <= given && bounded.experts == given);
    EPLB_FUZZ_ASSERT(bounded.routes == trace.routes);
  } catch (const eplb::InvalidArgument&) {
    EPLB_FUZZ_ASSERT(trace.experts > given);
  }

  if (trace.tokens * trace.layers * trace.experts <= (int64_t{1} << 20)) {
    try {
      const eplb::LoadMatrix load = parse_load_history(content, {LoadFormat::kTrace, 0}).sum();
      EPLB_FUZZ_ASSERT(load.layers == trace.layers && load.experts == trace.experts);
      for (int64_t l = 0; l < load.layers; ++l) {
        double total = 0;
        for (const double v : load.row(l)) total += v;
        EPLB_FUZZ_ASSERT(total == static_cast<double>(trace.tokens * trace.top_k));
      }
    } catch (const eplb::InvalidArgument&) {
      EPLB_FUZZ_ASSERT(!"a trace read as a routing trace failed as a load history");
    }
  }
  return 0;
}
