#pragma once
// Shared memory between the processes of one machine, as the shm and cuda backends use it: a
// memfd its owner maps read-write, which a peer opens through /proc/<owner pid>/fd/<fd> (same
// user) and maps read-only. Also the control page both backends keep in one: its owner clears
// `open` when it closes, which readers check after every batch (process.h has the rest of
// liveness).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

namespace eplb::transport {

std::size_t page_size();
std::size_t round_to_pages(std::size_t bytes);

// A memfd and this process's mapping of it. Owns both (a peer's mapping keeps no fd).
struct Segment {
  int fd = -1;
  std::uint64_t inode = 0;
  std::byte* data = nullptr;
  std::size_t bytes = 0;   // usable size (the region's)
  std::size_t mapped = 0;  // mapping size (whole pages)

  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept {
    std::swap(fd, o.fd);
    std::swap(inode, o.inode);
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    std::swap(mapped, o.mapped);
    return *this;
  }
  ~Segment();
};

// A new zero-filled memfd of `bytes`, mapped read-write. IoError (prefixed with `backend`).
Segment create_segment(std::string_view backend, const char* name, std::size_t bytes);

// Maps rank `peer`'s memfd read-only; the fd is closed right away, the mapping keeps the memory.
// IoError when it cannot be opened, or is gone (the owner closed or replaced it: another inode).
Segment map_peer_segment(std::string_view backend, int peer, std::int32_t pid, std::int32_t fd,
                         std::uint64_t inode, std::size_t bytes);

// The first page of a backend's control memfd. `magic` tells the backends' pages apart.
struct ControlPage {
  std::uint64_t magic;
  std::atomic<std::uint32_t> open;
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

inline const ControlPage* control_page(const Segment& s) {
  return reinterpret_cast<const ControlPage*>(s.data);
}
inline ControlPage* control_page(Segment& s) { return reinterpret_cast<ControlPage*>(s.data); }

}  // namespace eplb::transport
