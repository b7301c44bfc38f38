#pragma once
// Checks shared by the backends' post(): every read is checked before any starts.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "eplb/transport/transport.h"

namespace eplb::transport {

// InvalidArgument unless `read` (number `index` of its batch) addresses a region of
// `region_bytes` (the sizes of the peer's regions, by id) within bounds.
void check_read(const Read& read, std::size_t index, std::span<const std::uint64_t> region_bytes);

// InvalidArgument for a peer outside [0, peers) or one not imported.
[[noreturn]] void fail_unknown_peer(const Read& read, std::size_t index, std::size_t peers);

// A batch whose copies all happened inside post() (inproc, shm): done, or failed with `error`
// (an owner that was gone), from the start.
class SettledBatch final : public Batch {
 public:
  explicit SettledBatch(std::string error) : error_(std::move(error)) {}
  Progress poll() override;
  void wait(std::chrono::milliseconds) override { poll(); }

 private:
  std::string error_;
};

}  // namespace eplb::transport
