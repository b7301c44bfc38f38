#pragma once
// Whole files: reading one into memory and writing one out, with the checks every reader of a
// file eplb takes (loads, placements, metrics snapshots) shares: what is refused (devices,
// directories, endless pipes) and how running out of memory is said.

#include <cstdint>
#include <string>
#include <string_view>

namespace eplb {

// The whole file as a string; IoError naming the path and the reason when it cannot be read
// or memory runs out while reading it (with the bytes read). A regular file is read whatever
// its size; a pipe, FIFO or socket up to kMaxStreamBytes; a device or a directory is refused
// (InvalidArgument).
inline constexpr int64_t kMaxStreamBytes = int64_t{4} << 30;
std::string read_file(const std::string& path);

// Writes `text` to `path` (created or truncated); IoError naming the path and the reason.
void write_file(const std::string& path, std::string_view text);

}  // namespace eplb
