#pragma once
// The slots of each expert of one layer, in slot order, as one array (a counting sort): the
// previous placement's slots in sticky's search, its ranks in relabel, the slots an expert
// keeps in the two-slot repair.

#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace eplb::placement {

// Expert e's slots of `phy2log` are slots[start[e], start[e + 1]), ascending; a slot holding a
// negative value (none) is left out. Values are below `experts`. Fills `start` [experts + 1]
// and `slots`.
inline void slots_by_expert(std::span<const int32_t> phy2log, int64_t experts,
                            std::vector<int64_t>& start, std::vector<int64_t>& slots) {
  start.assign(static_cast<size_t>(experts) + 1, 0);
  for (const int32_t e : phy2log) {
    if (e >= 0) ++start[static_cast<size_t>(e) + 1];
  }
  std::partial_sum(start.begin(), start.end(), start.begin());
  slots.resize(static_cast<size_t>(start.back()));
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    if (phy2log[p] >= 0) slots[static_cast<size_t>(next[phy2log[p]]++)] = static_cast<int64_t>(p);
  }
}

}  // namespace eplb::placement
