#pragma once
// Where a Rebalancer's first placement comes from.

#include <string>

#include "eplb/core/types.h"
#include "eplb/runtime/config.h"

namespace eplb::runtime {

// Start from any placement (all validated against `layout`, InvalidArgument naming the
// mismatch):
//   a placement file, eplb's or SGLang's physical_to_logical_map;
Placement placement_from_file(const std::string& path, const Layout& layout);
//   a load file (any format stats::read_load reads), placed with the configured policy
//   (sticky starts from the trivial placement);
Placement placement_from_load(const std::string& path, const Config& config);
//   or the trivial one: eplb::trivial_placement (core/types.h).

}  // namespace eplb::runtime
