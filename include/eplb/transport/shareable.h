#pragma once
// Host memory the ranks of one machine can map: what an engine allocates its expert tensors
// from when it wants them served at memcpy speed. Registered with the shm backend (or hybrid's
// shm half), memory from here is exported as its memfd and an offset, and peers map it and copy
// from it, as they do the transport's own allocations; any other registered memory is read
// through cross-memory attach (process_vm_readv), slower and subject to ptrace permission.
//
// The memory is the caller's: zero-filled, page-aligned, valid until free_shareable(), which
// must come after every Transport that registered it is closed. Thread-safe.

#include <cstddef>
#include <cstdint>

namespace eplb::transport {

// `bytes` (> 0) of shareable memory; IoError when the memfd cannot be made or mapped.
void* allocate_shareable(std::size_t bytes);

// Releases memory from allocate_shareable(); InvalidArgument for any other address.
void free_shareable(void* data);

// Where shareable memory lives, for the backends: the memfd, its inode, its mapped size, and
// the offset of `data` in it. False when [data, data + bytes) is not inside one allocation.
struct ShareableSlice {
  int fd = -1;
  std::uint64_t inode = 0;
  std::size_t segment_bytes = 0;
  std::size_t offset = 0;
};
bool find_shareable(const void* data, std::size_t bytes, ShareableSlice& out);

}  // namespace eplb::transport
