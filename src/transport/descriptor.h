#pragma once
// The envelope every transport descriptor shares, and bounds-checked encoding of its payload.
//
//   magic "EPLB" | backend name (8 bytes, zero-padded) | version u16 | reserved u16 |
//   length u32 (the whole descriptor) | rank i32 | payload...
//
// Fields are in the byte order of the machine that wrote them; peers are assumed to share it
// (every platform eplb builds for is little-endian). Any inconsistency is InvalidArgument with a
// message that says which rule the bytes broke, so a descriptor routed to the wrong rank, backend
// or build is caught at import, never at the first read.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace eplb::transport {

inline constexpr std::size_t kDescriptorHeaderBytes = 24;

class DescriptorWriter {
 public:
  DescriptorWriter(std::string_view backend, std::uint16_t version, int rank);

  template <typename T>
  void put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    put_bytes(&value, sizeof(T));
  }
  void put_bytes(const void* data, std::size_t bytes);

  // The finished descriptor, with its length field filled in.
  std::vector<std::byte> finish() &&;

 private:
  std::vector<std::byte> bytes_;
};

class DescriptorReader {
 public:
  // Checks the envelope: size, magic, backend, version, length; InvalidArgument otherwise.
  DescriptorReader(std::span<const std::byte> descriptor, std::string_view backend,
                   std::uint16_t version);

  int rank() const { return rank_; }

  template <typename T>
  T get(const char* what) {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    get_bytes(&value, sizeof(T), what);
    return value;
  }
  void get_bytes(void* out, std::size_t bytes, const char* what);
  // A u32 count of entries that follow, each at least `min_entry_bytes` long: InvalidArgument
  // ("malformed") when the descriptor cannot hold that many, before anything is sized by it.
  std::uint32_t get_count(const char* what, std::size_t min_entry_bytes);
  std::span<const std::byte> get_span(std::size_t bytes, const char* what);

  // InvalidArgument when bytes are left over.
  void expect_end() const;

 private:
  std::span<const std::byte> bytes_;
  std::size_t at_ = kDescriptorHeaderBytes;
  std::string backend_;
  int rank_ = -1;
};

}  // namespace eplb::transport
