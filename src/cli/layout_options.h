#pragma once
// The --physical / --redundant pair that `plan` and `simulate` share.

#include <cstdint>
#include <optional>

namespace eplb::cli {

// Physical slots per layer from --physical P or --redundant R (P = experts + R; neither: P =
// experts). Throws InvalidArgument naming the option for both given, a negative R, or an R
// whose P is not a multiple of `ranks`; the rest is Layout::validate's.
int64_t physical_slots(int64_t experts, int64_t ranks, std::optional<int64_t> physical,
                       std::optional<int64_t> redundant);

}  // namespace eplb::cli
