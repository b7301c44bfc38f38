#pragma once
// Placement files. eplb writes
//   {"version":1,"layers":L,"experts":E,"physical":P,"ranks":G,"nodes":N,
//    "phy2log":[[...]],"log2phy":[[[...]]],"replica_count":[[...]]}   (log2phy padded with -1)
// and reads that or SGLang's {"physical_to_logical_map": [[...]]} (experts = largest id + 1,
// unless the caller knows more). Malformed files throw InvalidArgument naming the position.

#include <cstdint>
#include <string>
#include <string_view>

#include "eplb/core/types.h"

namespace eplb::stats {

struct PlacementFile {
  Placement placement;
  int64_t ranks = 0;  // 0 when the file does not say (SGLang's)
  int64_t nodes = 0;  // 0 when the file does not say
};

PlacementFile parse_placement(std::string_view content, int64_t min_experts = 0,
                              std::string_view source = "<input>");
PlacementFile read_placement(const std::string& path, int64_t min_experts = 0);

enum class PlacementFormat { kEplb, kSglang };
// "eplb" | "sglang"; else InvalidArgument listing them.
PlacementFormat parse_placement_format(std::string_view name);
std::string_view placement_format_name(PlacementFormat format);

std::string format_placement(const Placement& placement, const Layout& layout);
// SGLang's {"physical_to_logical_map": [[...P]...L]}: what its --init-expert-location reads
// (it derives the replicas' lists and counts itself).
std::string format_placement_sglang(const Placement& placement);
void write_placement(const std::string& path, const Placement& placement, const Layout& layout,
                     PlacementFormat format = PlacementFormat::kEplb);

}  // namespace eplb::stats
