#include "transport/descriptor.h"

#include <algorithm>
#include <array>

#include "eplb/core/error.h"

namespace eplb::transport {
namespace {

constexpr std::array<char, 4> kMagic{'E', 'P', 'L', 'B'};
constexpr std::size_t kBackendBytes = 8;

std::string backend_of(const std::byte* field) {
  std::string name(reinterpret_cast<const char*>(field), kBackendBytes);
  name.resize(std::find(name.begin(), name.end(), '\0') - name.begin());
  for (char& c : name) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return name;
}

}  // namespace

DescriptorWriter::DescriptorWriter(std::string_view backend, std::uint16_t version, int rank) {
  EPLB_CHECK_LE(backend.size(), kBackendBytes, "backend name too long for a descriptor");
  std::array<char, kBackendBytes> name{};
  std::copy(backend.begin(), backend.end(), name.begin());
  const std::uint16_t reserved = 0;
  const std::uint32_t length = 0;  // filled by finish()
  const std::int32_t rank32 = rank;
  put_bytes(kMagic.data(), kMagic.size());
  put_bytes(name.data(), name.size());
  put(version);
  put(reserved);
  put(length);
  put(rank32);
}

void DescriptorWriter::put_bytes(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const std::byte*>(data);
  bytes_.insert(bytes_.end(), p, p + bytes);
}

std::vector<std::byte> DescriptorWriter::finish() && {
  const auto length = static_cast<std::uint32_t>(bytes_.size());
  std::memcpy(bytes_.data() + 16, &length, sizeof length);
  return std::move(bytes_);
}

DescriptorReader::DescriptorReader(std::span<const std::byte> descriptor,
                                   std::string_view backend, std::uint16_t version)
    : bytes_(descriptor), backend_(backend) {
  if (bytes_.size() < kDescriptorHeaderBytes) {
    fail<InvalidArgument>("transport descriptor is truncated: ", bytes_.size(),
                          " bytes, shorter than the ", kDescriptorHeaderBytes,
                          "-byte header every descriptor starts with");
  }
  if (std::memcmp(bytes_.data(), kMagic.data(), kMagic.size()) != 0) {
    fail<InvalidArgument>("not an eplb transport descriptor (", bytes_.size(),
                          " bytes without the 'EPLB' magic): pass the bytes a peer's "
                          "export_descriptor() returned, unchanged");
  }
  const std::string from = backend_of(bytes_.data() + 4);
  if (from != backend) {
    fail<InvalidArgument>("transport descriptor comes from backend '", from, "' but was given to ",
                          "backend '", backend, "': every rank must use the same backend");
  }
  std::uint16_t got_version;
  std::uint32_t length;
  std::int32_t rank;
  std::memcpy(&got_version, bytes_.data() + 12, sizeof got_version);
  std::memcpy(&length, bytes_.data() + 16, sizeof length);
  std::memcpy(&rank, bytes_.data() + 20, sizeof rank);
  if (got_version != version) {
    fail<InvalidArgument>("'", backend, "' transport descriptor has version ", got_version,
                          ", this build reads version ", version,
                          ": every rank must run the same eplb build");
  }
  if (length != bytes_.size()) {
    fail<InvalidArgument>("'", backend, "' transport descriptor of rank ", rank, " has ",
                          bytes_.size(), " bytes but its header says ", length,
                          length > bytes_.size() ? " (truncated)" : " (extra bytes appended)");
  }
  rank_ = rank;
}

std::uint32_t DescriptorReader::get_count(const char* what, std::size_t min_entry_bytes) {
  const auto count = get<std::uint32_t>(what);
  const std::size_t remaining = bytes_.size() - at_;
  if (min_entry_bytes > 0 && count > remaining / min_entry_bytes) {
    fail<InvalidArgument>("'", backend_, "' transport descriptor of rank ", rank_,
                          " is malformed: ", what, " ", count, " needs at least ",
                          min_entry_bytes, " bytes each but only ", remaining, " remain");
  }
  return count;
}

void DescriptorReader::get_bytes(void* out, std::size_t bytes, const char* what) {
  std::memcpy(out, get_span(bytes, what).data(), bytes);
}

std::span<const std::byte> DescriptorReader::get_span(std::size_t bytes, const char* what) {
  if (bytes > bytes_.size() - at_) {
    fail<InvalidArgument>("'", backend_, "' transport descriptor of rank ", rank_,
                          " is malformed: ", what, " needs ", bytes, " bytes at offset ", at_,
                          " but only ", bytes_.size() - at_, " remain");
  }
  auto span = bytes_.subspan(at_, bytes);
  at_ += bytes;
  return span;
}

void DescriptorReader::expect_end() const {
  if (at_ != bytes_.size()) {
    fail<InvalidArgument>("'", backend_, "' transport descriptor of rank ", rank_,
                          " is malformed: ", bytes_.size() - at_,
                          " bytes left over after its last field");
  }
}

}  // namespace eplb::transport
