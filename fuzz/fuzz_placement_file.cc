// parse_placement (eplb's format and SGLang's), then Placement::validate and a round trip
// through eplb's writer.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "eplb/core/error.h"
#include "eplb/stats/placement_file.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace eplb::stats;
  const std::string_view content(reinterpret_cast<const char*>(data), size);
  PlacementFile file;
  try {
    file = parse_placement(content, 0, "<fuzz>");
  } catch (const eplb::InvalidArgument&) {
    return 0;
  }
  const eplb::Placement& p = file.placement;
  try {
    p.validate();
    eplb::Layout layout;
    layout.experts = p.experts;
    layout.physical = p.physical;
    layout.ranks = file.ranks > 0 ? file.ranks : 1;
    layout.nodes = file.nodes > 0 ? file.nodes : 1;
    const PlacementFile back = parse_placement(format_placement(p, layout), 0, "<round trip>");
    EPLB_FUZZ_ASSERT(back.ranks == layout.ranks && back.nodes == layout.nodes);
    EPLB_FUZZ_ASSERT(back.placement.layers == p.layers && back.placement.experts == p.experts &&
                     back.placement.physical == p.physical &&
                     back.placement.max_replicas == p.max_replicas);
    EPLB_FUZZ_ASSERT(back.placement.phy2log == p.phy2log);
    EPLB_FUZZ_ASSERT(back.placement.replica_count == p.replica_count);
    EPLB_FUZZ_ASSERT(back.placement.log2phy == p.log2phy);
  } catch (const eplb::InvalidArgument&) {
    EPLB_FUZZ_ASSERT(!"a parsed placement is invalid or does not read back");
  }
  return 0;
}
