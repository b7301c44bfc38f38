#include "transport/checks.h"

#include "eplb/core/error.h"

namespace eplb::transport {

void check_read(const Read& read, std::size_t index, std::span<const std::uint64_t> region_bytes) {
  if (read.region < 0 || static_cast<std::size_t>(read.region) >= region_bytes.size()) {
    fail<InvalidArgument>("read ", index, " names region ", read.region, " of rank ", read.peer,
                          ", which has ", region_bytes.size(), " regions (ids 0..",
                          static_cast<long>(region_bytes.size()) - 1, ")");
  }
  const std::uint64_t size = region_bytes[static_cast<std::size_t>(read.region)];
  if (read.offset > size || read.bytes > size - read.offset) {
    fail<InvalidArgument>("read ", index, " of ", read.bytes, " bytes at offset ", read.offset,
                          " runs past the end of region ", read.region, " of rank ", read.peer,
                          " (", size, " bytes)");
  }
  if (read.bytes > 0 && read.dst == nullptr) {
    fail<InvalidArgument>("read ", index, " of ", read.bytes, " bytes has a null destination");
  }
}

void fail_unknown_peer(const Read& read, std::size_t index, std::size_t peers) {
  if (read.peer < 0) fail<InvalidArgument>("read ", index, " names peer ", read.peer, " (< 0)");
  fail<InvalidArgument>("read ", index, " names peer ", read.peer,
                        " whose descriptor was not imported (", peers,
                        " slots known): import_descriptor() every peer before reading from it");
}

Progress SettledBatch::poll() {
  if (!error_.empty()) fail<IoError>(error_);
  return Progress::kDone;
}

}  // namespace eplb::transport
