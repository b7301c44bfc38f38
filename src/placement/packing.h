#pragma once
// balanced's packing of replicas into ranks (balanced.cc, Steps 3a-3b), shared with the
// placement under a cost model (cost_placement.cc).

#include <cstdint>
#include <span>
#include <vector>

namespace eplb::placement {

// n items packed into `bins` bins of `capacity` items each (n == bins * capacity).
// No bin holds two items of the same class (replicas of one expert share a class).
struct Packing {
  int64_t bins = 0;
  int64_t capacity = 0;
  std::vector<int32_t> item;  // [bins][capacity]: the item in each place
  std::vector<double> load;   // [bins]: sum of the bin's item weights
};

// Packs items of `weight` and class `cls` (classes in [0, classes)) by largest differencing
// (longest processing time first where that cannot keep classes apart), then swaps off the
// heaviest bin while they lower it. Deterministic.
Packing pack_balanced(std::span<const double> weight, std::span<const int32_t> cls,
                      int64_t classes, int64_t bins, int64_t capacity);

}  // namespace eplb::placement
