#include "eplb/transport/shareable.h"

#include <iterator>
#include <map>
#include <mutex>

#include "eplb/core/error.h"
#include "transport/memfd.h"

namespace eplb::transport {
namespace {

// Every live allocation by its address. Segments own their memfd and mapping.
struct Registry {
  std::mutex mu;
  std::map<std::uintptr_t, Segment> by_address;  // guarded by mu
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: frees may come during static teardown
  return *r;
}

}  // namespace

void* allocate_shareable(std::size_t bytes) {
  EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate_shareable() needs a positive size");
  Segment s = create_segment("shareable", "eplb-shareable", bytes);
  void* data = s.data;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_address.emplace(reinterpret_cast<std::uintptr_t>(data), std::move(s));
  return data;
}

void free_shareable(void* data) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.by_address.find(reinterpret_cast<std::uintptr_t>(data));
  if (it == r.by_address.end()) {
    fail("free_shareable(): ", data, " does not come from allocate_shareable()");
  }
  r.by_address.erase(it);
}

bool find_shareable(const void* data, std::size_t bytes, ShareableSlice& out) {
  const auto at = reinterpret_cast<std::uintptr_t>(data);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_address.upper_bound(at);
  if (it == r.by_address.begin()) return false;
  it = std::prev(it);
  const Segment& s = it->second;
  const std::uintptr_t offset = at - it->first;
  if (offset > s.bytes || bytes > s.bytes - offset) return false;
  out = {.fd = s.fd, .inode = s.inode, .segment_bytes = s.bytes,
         .offset = static_cast<std::size_t>(offset)};
  return true;
}

}  // namespace eplb::transport
