// greedy_replica_counts (replicas.h). Only the slots - experts heaviest experts (lowest index
// on a tie) can get an extra replica: before an expert's first one, every expert ahead of it
// in that order has had one (its load per replica would be at least as large otherwise, and it
// comes first on a tie; a capped expert has had cap - 1 >= 1). So only they enter the heap: 64
// instead of 384 at 448 slots for 384 experts, where the heap of all experts was a tenth of
// balanced's time.

#include "placement/replicas.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "eplb/core/error.h"

namespace eplb::placement {

std::vector<int32_t> greedy_replica_counts(std::span<const double> w, int64_t slots,
                                           int64_t cap) {
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<int32_t> count(w.size(), 1);
  const int64_t extra = slots - n;
  if (extra <= 0) return count;
  std::vector<int32_t> candidates(w.size());
  std::iota(candidates.begin(), candidates.end(), 0);
  if (extra < n) {
    auto ahead = [&](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
    std::nth_element(candidates.begin(), candidates.begin() + extra, candidates.end(), ahead);
    candidates.resize(static_cast<size_t>(extra));
  }
  // Max-heap of (load per replica, -expert): the top is the expert served next.
  std::vector<std::pair<double, int32_t>> heap;
  heap.reserve(candidates.size());
  for (const int32_t e : candidates) {
    if (count[e] < cap) heap.emplace_back(w[e], -e);
  }
  std::make_heap(heap.begin(), heap.end());
  for (int64_t left = extra; left > 0; --left) {
    EPLB_CHECK(!heap.empty(), "no expert can take another replica");
    std::pop_heap(heap.begin(), heap.end());
    const int32_t e = -heap.back().second;
    heap.pop_back();
    ++count[e];
    if (count[e] < cap) {
      heap.emplace_back(w[e] / count[e], -e);
      std::push_heap(heap.begin(), heap.end());
    }
  }
  return count;
}

}  // namespace eplb::placement
