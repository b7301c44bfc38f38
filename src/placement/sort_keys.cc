// Sort keys for nonnegative doubles (sort_keys.h).

#include "placement/sort_keys.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace eplb::placement {

void sort_keys(std::vector<SortKey>& keys, std::vector<SortKey>& scratch) {
  constexpr size_t kRadixFrom = 256;
  if (keys.size() < kRadixFrom) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  constexpr int kFirst = kIndexBits / 8, kBytes = sizeof(SortKey) - kFirst;
  static_assert(kIndexBits % 8 == 0, "the index fills whole bytes");
  std::array<std::array<uint32_t, 256>, kBytes> count{};
  for (const SortKey k : keys) {
    for (int d = 0; d < kBytes; ++d) ++count[d][(k >> (8 * (kFirst + d))) & 0xff];
  }
  scratch.resize(keys.size());
  for (int d = 0; d < kBytes; ++d) {
    const int shift = 8 * (kFirst + d);
    std::array<uint32_t, 256>& at = count[d];
    if (at[(keys[0] >> shift) & 0xff] == keys.size()) continue;
    uint32_t sum = 0;
    for (uint32_t& c : at) sum += std::exchange(c, sum);
    for (const SortKey k : keys) scratch[at[(k >> shift) & 0xff]++] = k;
    keys.swap(scratch);
  }
}


}  // namespace eplb::placement
