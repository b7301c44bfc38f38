#pragma once
// Checks shared by the backends' post(): every read is checked before any starts.

#include <cstddef>
#include <cstdint>
#include <span>

#include "eplb/transport/transport.h"

namespace eplb::transport {

// InvalidArgument unless `read` (number `index` of its batch) addresses a region of
// `region_bytes` (the sizes of the peer's regions, by id) within bounds.
void check_read(const Read& read, std::size_t index, std::span<const std::uint64_t> region_bytes);

// InvalidArgument for a peer outside [0, peers) or one not imported.
[[noreturn]] void fail_unknown_peer(const Read& read, std::size_t index, std::size_t peers);

}  // namespace eplb::transport
