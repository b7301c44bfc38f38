// sticky's Step 3a': settling the ranks above the cap by swaps before the search
// (sticky_search.h).

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "placement/sort_keys.h"
#include "placement/sticky_search.h"

namespace eplb::placement::sticky_search {

inline bool Incremental::swap_fits(int64_t g, int64_t a, int64_t b, double cap) const {
  const int64_t h = rank_of(b);
  const int32_t x = cur_[a], y = cur_[b];
  return h != g && load_[h] + (slot_share_[a] - slot_share_[b]) <= cap && y != x &&
         !holds(h, x) && !holds(g, y) && allowed(x, h) && allowed(y, g);
}

void Incremental::settle(double cap, int64_t budget) {
  stuck_cap_ = -1;
  const int64_t slots = static_cast<int64_t>(cur_.size());
  // The slots by the share of their expert, descending (sort_keys.h); a swap trades the slots
  // of two entries, so the shares stay in order.
  std::vector<SortKey> keys(static_cast<size_t>(slots)), scratch;
  for (int64_t p = 0; p < slots; ++p) keys[p] = descending_key(slot_share_[p], p);
  sort_keys(keys, scratch);
  std::vector<double> sorted_share(static_cast<size_t>(slots));
  std::vector<int64_t> by_share(static_cast<size_t>(slots)), at(static_cast<size_t>(slots));
  for (int64_t i = 0; i < slots; ++i) {
    by_share[i] = key_index(keys[i]);
    sorted_share[i] = slot_share_[by_share[i]];
    at[by_share[i]] = i;
  }
  // The first entry whose share is at most v.
  auto first_at_most = [&](double v) {
    return std::partition_point(sorted_share.begin(), sorted_share.end(),
                                [v](double share) { return share > v; }) -
           sorted_share.begin();
  };
  std::vector<int64_t> over;
  for (int64_t r = 0; r < ranks_; ++r) {
    if (load_[r] > cap) over.push_back(r);
  }
  std::stable_sort(over.begin(), over.end(),
                   [&](int64_t a, int64_t b) { return load_[a] > load_[b]; });
  for (const int64_t g : over) {
    for (int64_t tries = 0; tries < spr_ && load_[g] > cap; ++tries) {
      if (moved_ > budget) return;
      const double excess = load_[g] - cap;
      const double room = cap - min_load();  // the most any rank can take
      // A swap that brings g to the cap: b's share at most sa - excess, from the largest
      // down, until the shift is more than any rank can take; the first that fits for each a.
      int64_t best_a = -1, best_b = -1, best_cost = 3;
      double best_delta = kInf;
      for (int64_t a = g * spr_; a < (g + 1) * spr_ && room >= excess; ++a) {
        const double sa = slot_share_[a];
        for (int64_t i = first_at_most(sa - excess); i < slots && sa - sorted_share[i] <= room;
             ++i) {
          const int64_t b = by_share[i];
          if (!swap_fits(g, a, b, cap)) continue;
          const int64_t c = cost(a, cur_[b]) + cost(b, cur_[a]);
          const double delta = sa - sorted_share[i];
          if (c < best_cost || (c == best_cost && delta < best_delta)) {
            best_a = a;
            best_b = b;
            best_cost = c;
            best_delta = delta;
          }
          break;
        }
      }
      // Else the one that lowers g most: b's share just above sa - excess, upwards.
      if (best_a < 0) {
        best_delta = 0;
        for (int64_t a = g * spr_; a < (g + 1) * spr_; ++a) {
          const double sa = slot_share_[a];
          for (int64_t i = first_at_most(sa - excess) - 1;
               i >= 0 && sorted_share[i] < sa - best_delta; --i) {
            const int64_t b = by_share[i];
            if (!swap_fits(g, a, b, cap)) continue;
            best_a = a;
            best_b = b;
            best_cost = cost(a, cur_[b]) + cost(b, cur_[a]);
            best_delta = sa - sorted_share[i];
            break;
          }
        }
      }
      if (best_a < 0) break;
      moved_ += best_cost;
      std::swap(by_share[at[best_a]], by_share[at[best_b]]);
      std::swap(at[best_a], at[best_b]);
      apply_swap(best_a, best_b);
    }
  }
}

}  // namespace eplb::placement::sticky_search
