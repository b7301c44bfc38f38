#pragma once
// Sort keys for nonnegative doubles (balanced's packings, the sorted pairing, sticky's settle
// and search): one integer compare per pair, and a radix sort from a few hundred keys on.

#include <bit>
#include <cstdint>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::placement {

// The top 40 bits of the value (sign, exponent, 28 bits of mantissa), inverted, above a 24-bit
// index, so one integer compare sorts by descending value, then ascending index. Values whose
// top 40 bits agree (within about 4e-9 relative, in buckets) count as equal and go by index.
// The pair compare this replaces was a sixth of balanced's time at 7 slots per rank. Indices
// stay below 2^24 (a layer's slots).
using SortKey = uint64_t;
inline constexpr int kIndexBits = 24;
inline constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
inline SortKey descending_key(double v, int64_t index) {
  EPLB_CHECK(index >= 0 && static_cast<uint64_t>(index) <= kIndexMask, "sort index ", index,
             " needs more than ", kIndexBits, " bits");
  const uint64_t bits = std::bit_cast<uint64_t>(v + 0.0);  // + 0.0: -0 sorts as 0
  return (~bits & ~kIndexMask) | static_cast<uint64_t>(index);
}
// The same, ascending by value.
inline SortKey ascending_key(double v, int64_t index) {
  EPLB_CHECK(index >= 0 && static_cast<uint64_t>(index) <= kIndexMask, "sort index ", index,
             " needs more than ", kIndexBits, " bits");
  const uint64_t bits = std::bit_cast<uint64_t>(v + 0.0);
  return (bits & ~kIndexMask) | static_cast<uint64_t>(index);
}
inline int64_t key_index(SortKey key) { return static_cast<int64_t>(key & kIndexMask); }

// Sorts `keys`, built in ascending order of their index, ascending; `scratch` is working space.
// From a few hundred keys on, one byte of the value at a time from the lowest (a stable
// counting sort per byte, skipping bytes every key shares): a stable sort of keys in index
// order leaves equal values by index, so the index bytes need no pass. A comparison sort
// mispredicted about half its branches on these keys; sorting was a seventh of balanced's
// time at 448 slots per layer. Keys are distinct, so every correct sort gives the same order.
void sort_keys(std::vector<SortKey>& keys, std::vector<SortKey>& scratch);

}  // namespace eplb::placement
