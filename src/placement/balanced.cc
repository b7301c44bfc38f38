// Placement: balanced. Per layer:
//   Step 1 (hierarchical only): pack the groups' summed loads into nodes, groups/N per node.
//   Step 2: replica counts that minimise the largest per-replica load w_e / r_e (greedy: each
//           extra slot goes to the expert with the largest w_e / r_e; optimal for that max).
//   Step 3: pack the replicas (load w_e / r_e each) into ranks of P/G slots, never two replicas
//           of one expert on a rank: by differencing (longest processing time first for the
//           whole layer where differencing cannot avoid two replicas of an expert on a rank),
//           then local search (swaps off the most loaded rank) until no swap lowers it or it is
//           within 0.1% of the bound.
//   With one slot per rank Step 2 alone is optimal; with two, Steps 2-3 are two_slots::place:
//   counts searched together with their sorted pairing.
//   Step 4: keep deepseek's layer instead where it is better and follows the same rules
//           (happens only on tiny shapes; only layers left above the bound are compared).
// Every rank is full after Step 3, so a "move" of a replica off the most loaded rank is always a
// swap with a lighter replica of another rank; the swap search covers both.

#include "placement/balanced.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "placement/deepseek.h"
#include "eplb/placement/metrics.h"
#include "placement/replicas.h"
#include "placement/sort_keys.h"
#include "placement/packing.h"
#include "placement/two_slots.h"

namespace eplb::placement {
namespace {

// Relative margin below which a swap does not count as an improvement: keeps the local search
// from cycling on rounding noise.
constexpr double kMinGain = 1e-12;

// The local search stops once the most loaded bin is within this fraction of the lower bound
// max(total / bins, heaviest item): the last 0.1% would cost more rounds than all the rest.
constexpr double kCloseEnough = 1e-3;

// The items by descending weight (descending_key: near-equal weights go by index). [n]
std::vector<int32_t> heaviest_first(std::span<const double> weight) {
  std::vector<SortKey> keys(weight.size()), scratch;
  for (size_t i = 0; i < weight.size(); ++i) keys[i] = descending_key(weight[i], i);
  sort_keys(keys, scratch);
  std::vector<int32_t> order(weight.size());
  for (size_t i = 0; i < keys.size(); ++i) order[i] = static_cast<int32_t>(key_index(keys[i]));
  return order;
}

// Step 3a: longest processing time first. Items by descending weight (`order`, from
// heaviest_first), each into the lightest bin with room that holds no item of its class
// (lowest bin on a tie). When every bin with room already holds the class, an item of another
// class moves from a full bin into the bin with room, which frees a place for this one (always
// possible: the full bin holds more distinct classes than the one with room).
Packing pack_lpt(std::span<const double> weight, std::span<const int32_t> cls,
                 std::span<const int32_t> order, int64_t classes, int64_t bins, int64_t capacity,
                 std::vector<uint8_t>& holds) {
  const int64_t n = static_cast<int64_t>(weight.size());
  Packing pack{bins, capacity, std::vector<int32_t>(static_cast<size_t>(n), -1),
               std::vector<double>(static_cast<size_t>(bins), 0.0)};
  std::vector<int64_t> fill(static_cast<size_t>(bins), 0);
  holds.assign(static_cast<size_t>(bins * classes), 0);
  auto put = [&](int64_t b, int64_t pos, int32_t i) {
    pack.item[b * capacity + pos] = i;
    pack.load[b] += weight[i];
    holds[b * classes + cls[i]] = 1;
  };
  // Bins with room, lightest first (lowest index on a tie).
  auto heavier = [&](int64_t a, int64_t b) {
    return pack.load[a] > pack.load[b] || (pack.load[a] == pack.load[b] && a > b);
  };
  std::vector<int64_t> open(static_cast<size_t>(bins));
  std::iota(open.begin(), open.end(), 0);
  std::vector<int64_t> skipped;
  for (const int32_t i : order) {
    int64_t best = -1;
    while (!open.empty()) {
      std::pop_heap(open.begin(), open.end(), heavier);
      const int64_t b = open.back();
      open.pop_back();
      if (!holds[b * classes + cls[i]]) {
        best = b;
        break;
      }
      skipped.push_back(b);
    }
    if (best >= 0) {
      put(best, fill[best]++, i);
      if (fill[best] < capacity) skipped.push_back(best);
    }
    for (const int64_t b : skipped) {
      open.push_back(b);
      std::push_heap(open.begin(), open.end(), heavier);
    }
    skipped.clear();
    if (best >= 0) continue;
    // Repair: `room` has space but holds the class; `full` lacks it.
    int64_t room = -1, full = -1;
    for (int64_t b = 0; b < bins; ++b) {
      if (fill[b] < capacity && (room < 0 || pack.load[b] < pack.load[room])) room = b;
      if (!holds[b * classes + cls[i]] && (full < 0 || pack.load[b] < pack.load[full])) full = b;
    }
    EPLB_CHECK(room >= 0 && full >= 0, "no bin can take item ", i);
    int64_t pos = 0;
    while (pos < capacity && holds[room * classes + cls[pack.item[full * capacity + pos]]]) ++pos;
    EPLB_CHECK_LT(pos, capacity, "no item can leave the full bin");
    const int32_t moved = pack.item[full * capacity + pos];
    pack.load[full] -= weight[moved];
    holds[full * classes + cls[moved]] = 0;
    put(room, fill[room]++, moved);
    put(full, pos, i);
    open.clear();  // two loads changed: rebuild the heap
    for (int64_t b = 0; b < bins; ++b) {
      if (fill[b] < capacity) open.push_back(b);
    }
    std::make_heap(open.begin(), open.end(), heavier);
  }
  return pack;
}

// Step 3a by differencing (the largest differencing method, for bins of equal size): items by
// descending weight (`order`) form `capacity` partial packings, round k holding items
// k * bins .. (k + 1) * bins - 1 one per bin. The two partial packings whose bins differ most
// are merged, the heaviest bin of one with the lightest of the other, until one is left.
// Merging the widest spreads first cancels them against each other, which leaves the bins far
// closer than handing the rounds out one by one (fewer swaps after it). Two bins that would
// hold one class twice are not merged: the lightest bin that can is taken instead; false when
// none can (pack_lpt then packs).
bool pack_differencing(std::span<const double> weight, std::span<const int32_t> cls,
                       std::span<const int32_t> order, int64_t classes, int64_t bins,
                       int64_t capacity, std::vector<uint8_t>& holds, Packing& pack) {
  const int64_t n = static_cast<int64_t>(weight.size());
  // A bin of a partial packing: its load and its items, a list through `next`.
  struct Part {
    double load;
    int32_t head, tail;
  };
  std::vector<int32_t> next(static_cast<size_t>(n), -1);
  // [capacity][bins]: each partial packing's bins by descending load.
  std::vector<Part> parts(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) parts[i] = {weight[order[i]], order[i], order[i]};
  auto spread = [&](int64_t k) {
    return parts[k * bins].load - parts[k * bins + bins - 1].load;
  };
  auto clash = [&](const Part& a, const Part& b) {
    for (int32_t x = a.head; x >= 0; x = next[x]) {
      for (int32_t y = b.head; y >= 0; y = next[y]) {
        if (cls[x] == cls[y]) return true;
      }
    }
    return false;
  };
  // Max-heap of (spread, -packing): the widest first, lowest index on a tie.
  std::vector<std::pair<double, int64_t>> heap;
  for (int64_t k = 0; k < capacity; ++k) heap.emplace_back(spread(k), -k);
  std::make_heap(heap.begin(), heap.end());
  std::vector<uint8_t> taken(static_cast<size_t>(bins));  // b's bins already merged
  std::vector<int64_t> partner(static_cast<size_t>(bins));  // a's bin i merged with b's
  std::vector<Part> merged(static_cast<size_t>(bins));
  std::vector<SortKey> keys(static_cast<size_t>(bins)), scratch;
  while (heap.size() > 1) {
    std::pop_heap(heap.begin(), heap.end());
    const int64_t a = -heap.back().second;
    heap.pop_back();
    std::pop_heap(heap.begin(), heap.end());
    const int64_t b = -heap.back().second;
    heap.pop_back();
    Part* pa = parts.data() + a * bins;
    Part* pb = parts.data() + b * bins;
    std::fill(taken.begin(), taken.end(), 0);
    // b's lightest bin not yet taken: the partner of a's next bin unless the two clash.
    auto link = [&](int64_t i, int64_t j) {
      partner[i] = j;
      taken[j] = 1;
      next[pa[i].tail] = pb[j].head;
      merged[i] = {pa[i].load + pb[j].load, pa[i].head, pb[j].tail};
    };
    int64_t lightest = bins - 1;
    for (int64_t i = 0; i < bins; ++i) {
      while (lightest >= 0 && taken[lightest]) --lightest;
      int64_t j = lightest;
      while (j >= 0 && (taken[j] || clash(pa[i], pb[j]))) --j;
      if (j >= 0) {
        link(i, j);
        continue;
      }
      // Every bin left clashes with a's bin i (the last few bins, where one expert's replicas
      // meet): i takes the partner of an earlier bin of a, the latest that it can, and that
      // bin takes the lightest bin left it does not clash with. Without it the whole layer
      // fell back to longest processing time first (11 of 61 layers at 384 experts on 64
      // ranks).
      bool traded = false;
      for (int64_t k = i - 1; k >= 0 && !traded; --k) {
        const int64_t was = partner[k];
        if (clash(pa[i], pb[was])) continue;
        next[pa[k].tail] = -1;  // a's bin k alone again, to be tested against the bins left
        int64_t left = lightest;
        while (left >= 0 && (taken[left] || clash(pa[k], pb[left]))) --left;
        if (left < 0) {
          next[pa[k].tail] = pb[was].head;
          continue;
        }
        taken[was] = 0;
        link(k, left);
        link(i, was);
        traded = true;
      }
      if (!traded) return false;
    }
    for (int64_t i = 0; i < bins; ++i) keys[i] = descending_key(merged[i].load, i);
    sort_keys(keys, scratch);
    for (int64_t i = 0; i < bins; ++i) pa[i] = merged[key_index(keys[i])];
    heap.emplace_back(spread(a), -a);
    std::push_heap(heap.begin(), heap.end());
  }
  const Part* last = parts.data() + (-heap.front().second) * bins;
  pack = Packing{bins, capacity, std::vector<int32_t>(static_cast<size_t>(n), -1),
                 std::vector<double>(static_cast<size_t>(bins), 0.0)};
  holds.assign(static_cast<size_t>(bins * classes), 0);
  for (int64_t b = 0; b < bins; ++b) {
    int64_t pos = 0;
    for (int32_t x = last[b].head; x >= 0; x = next[x]) {
      pack.item[b * capacity + pos++] = x;
      pack.load[b] += weight[x];
      holds[b * classes + cls[x]] = 1;
    }
  }
  return true;
}

// Step 3b: while some swap of an item on the most loaded bin with a lighter item of another bin
// lowers the larger of the two bins' loads below the old maximum, apply the best such swap
// (the first one found that leaves both bins at most `good_enough` or the second most loaded
// bin's load, when there is one).
// Each step lowers the sorted vector of bin loads, so the search ends.
//
// A swap of a (weight wa, on the top bin, load top) with b (wb, on bin h, load lh) moves
// delta = wa - wb and leaves max(top - delta, lh + delta) = mid + |delta - half|, with
// mid = (top + lh) / 2 and half = (top - lh) / 2: the best partner of a is the item of h whose
// weight is nearest wa - half, and the others are worse the farther they are. Each bin keeps its
// items sorted by weight, so the search walks out from that point and stops as soon as a
// partner cannot beat the best so far: a few pairs per bin instead of every pair.
void improve_by_swaps(Packing& pack, std::span<const double> weight,
                      std::span<const int32_t> cls, int64_t classes,
                      std::vector<uint8_t>& holds, double good_enough) {
  const int64_t bins = pack.bins;
  const int64_t cap = pack.capacity;
  if (bins < 2) return;
  // (load, bin), ascending. A swap changes two loads, so only those two entries move.
  std::vector<std::pair<double, int64_t>> lighter(static_cast<size_t>(bins));
  for (int64_t b = 0; b < bins; ++b) lighter[b] = {pack.load[b], b};
  std::sort(lighter.begin(), lighter.end());
  auto reorder = [&](int64_t bin) {
    lighter.erase(std::find_if(lighter.begin(), lighter.end(),
                               [&](const auto& entry) { return entry.second == bin; }));
    const std::pair<double, int64_t> entry{pack.load[bin], bin};
    lighter.insert(std::lower_bound(lighter.begin(), lighter.end(), entry), entry);
  };
  // [bins][cap]: each bin's places by ascending weight of their item (place on a tie), and
  // those weights side by side.
  std::vector<int64_t> by_weight(static_cast<size_t>(bins * cap));
  std::vector<double> sorted_weight(by_weight.size());
  auto sort_bin = [&](int64_t b) {
    int64_t* first = by_weight.data() + b * cap;
    std::iota(first, first + cap, b * cap);
    // Insertion sort: a bin holds a handful of items.
    for (int64_t i = 1; i < cap; ++i) {
      const int64_t pos = first[i];
      const double wp = weight[pack.item[pos]];
      int64_t j = i;
      for (; j > 0 && weight[pack.item[first[j - 1]]] > wp; --j) first[j] = first[j - 1];
      first[j] = pos;
    }
    for (int64_t i = 0; i < cap; ++i) sorted_weight[b * cap + i] = weight[pack.item[first[i]]];
  };
  for (int64_t b = 0; b < bins; ++b) sort_bin(b);
  for (int64_t round = 0; round < 64 * bins * cap; ++round) {
    const int64_t g = lighter.back().second;
    const double top = pack.load[g];
    if (top <= good_enough) return;
    double best = top - kMinGain * top;
    // A swap that leaves both bins at most the next bin's load (or good enough) is taken at
    // once: the next round lowers that bin, and the search for the very best swap visited
    // every bin for a gain the following rounds make anyway.
    const double enough = std::max(good_enough, lighter[bins - 2].first);
    int64_t best_a = -1, best_b = -1;
    bool done = false;
    for (int64_t k = 0; k + 1 < bins && !done; ++k) {
      const auto [lh, h] = lighter[k];
      const double mid = 0.5 * (top + lh), half = 0.5 * (top - lh);
      // The best a swap with h can reach is the mean of the two loads; bins come lightest
      // first, so no later bin can beat `best` either.
      if (mid >= best) break;
      const double* hw = sorted_weight.data() + h * cap;
      const int64_t* hp = by_weight.data() + h * cap;
      // g's items by ascending weight, so the point nearest each target only moves right.
      int64_t at = 0;
      for (int64_t i = 0; i < cap && !done; ++i) {
        const int64_t pa = by_weight[g * cap + i];
        const int32_t ia = pack.item[pa];
        const double wa = sorted_weight[g * cap + i];
        const double target = wa - half;
        while (at < cap && hw[at] < target) ++at;
        if (holds[h * classes + cls[ia]]) continue;
        auto visit = [&](int64_t j) {
          const double delta = wa - hw[j];
          const double peak = std::max(top - delta, lh + delta);
          // The rule is looked up last: most candidates already fail on the loads.
          if (delta > 0 && peak < best && !holds[g * classes + cls[pack.item[hp[j]]]]) {
            best = peak;
            best_a = pa;
            best_b = hp[j];
            done = peak <= enough;
          }
        };
        for (int64_t j = at; j < cap && !done && mid + (hw[j] - target) < best; ++j) visit(j);
        for (int64_t j = at - 1; j >= 0 && !done && mid + (target - hw[j]) < best; --j) visit(j);
      }
    }
    if (best_a < 0) return;
    const int64_t h = best_b / cap;
    const int32_t ia = pack.item[best_a];
    const int32_t ib = pack.item[best_b];
    const double delta = weight[ia] - weight[ib];
    pack.item[best_a] = ib;
    pack.item[best_b] = ia;
    pack.load[g] -= delta;
    pack.load[h] += delta;
    holds[g * classes + cls[ia]] = 0;
    holds[h * classes + cls[ib]] = 0;
    holds[g * classes + cls[ib]] = 1;
    holds[h * classes + cls[ia]] = 1;
    sort_bin(g);
    sort_bin(h);
    reorder(g);
    reorder(h);
  }
}

}  // namespace

// Steps 3a and 3b together (placement/packing.h).
Packing pack_balanced(std::span<const double> weight, std::span<const int32_t> cls,
                      int64_t classes, int64_t bins, int64_t capacity) {
  std::vector<uint8_t> holds;  // [bins][classes]
  const std::vector<int32_t> order = heaviest_first(weight);
  Packing pack;
  if (!pack_differencing(weight, cls, order, classes, bins, capacity, holds, pack)) {
    pack = pack_lpt(weight, cls, order, classes, bins, capacity, holds);
  }
  double total = 0, heaviest = 0;
  for (const double v : weight) {
    total += v;
    heaviest = std::max(heaviest, v);
  }
  const double bound = std::max(total / static_cast<double>(bins), heaviest);
  improve_by_swaps(pack, weight, cls, classes, holds, bound * (1 + kCloseEnough));
  return pack;
}

namespace {

// Two slots per rank: writes two_slots::place's pairs (local ids) as global ids, each rank's
// two in ascending order.
void write_pairs(std::span<const int32_t> paired, std::span<const int32_t> experts,
                 int64_t first_slot, std::span<int32_t> phy2log) {
  for (size_t k = 0; k + 1 < paired.size(); k += 2) {
    const int32_t a = experts[paired[k]], b = experts[paired[k + 1]];
    phy2log[first_slot + k] = std::min(a, b);
    phy2log[first_slot + k + 1] = std::max(a, b);
  }
}

// Steps 2 and 3 for one set of experts on one set of ranks. `experts` lists the global ids;
// writes phy2log[first_slot .. first_slot + ranks * slots_per_rank), each rank's experts in
// ascending id order.
// Returns false where the result may be beaten by another packing (two slots per rank, where a
// pair had to trade a replica): Step 4 then compares it with deepseek's.
bool place_experts(std::span<const double> w, std::span<const int32_t> experts, int64_t ranks,
                   int64_t slots_per_rank, int64_t first_slot, std::span<int32_t> phy2log,
                   bool thorough) {
  const int64_t n = static_cast<int64_t>(experts.size());
  std::vector<double> local(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) local[i] = w[experts[i]];
  std::vector<int32_t> paired;  // two slots per rank: two_slots.h's placement
  double paired_top = 0;
  std::vector<int32_t> count;  // the greedy counts (two_slots::place computes them too)
  double greedy_top = 0;       // two slots: their sorted pairing's largest pair
  if (slots_per_rank == 2) {
    paired.resize(static_cast<size_t>(2 * ranks));
    bool traded = false;
    paired_top = two_slots::place(local, ranks, paired, traded, count, greedy_top, thorough);
    // Unless a pair had to trade a replica (tiny layers), it beats any packing below.
    if (!traded) {
      write_pairs(paired, experts, first_slot, phy2log);
      return true;
    }
  } else {
    count = greedy_replica_counts(local, ranks * slots_per_rank, ranks);
  }
  // Where a pair traded a replica: any packing of these counts has a rank at least their sorted
  // pairing's largest pair, so where the pairs are not above that the packing below cannot win
  // (and it is a large share of balanced's time at many ranks). two_slots::place has that
  // pairing already.
  if (!paired.empty() && paired_top <= greedy_top) {
    write_pairs(paired, experts, first_slot, phy2log);
    return false;
  }
  if (slots_per_rank == 1) {
    // One slot per rank: a rank's load is its replica's, so the counts alone are optimal.
    int64_t slot = first_slot;
    for (int64_t i = 0; i < n; ++i) {
      for (int32_t k = 0; k < count[i]; ++k) phy2log[slot++] = experts[i];
    }
    return true;
  }

  // One item per replica: weight w_e / r_e, class e (local index).
  std::vector<double> weight;
  std::vector<int32_t> cls;
  weight.reserve(static_cast<size_t>(ranks * slots_per_rank));
  cls.reserve(weight.capacity());
  for (int32_t i = 0; i < n; ++i) {
    const double share = local[i] / count[i];
    for (int32_t k = 0; k < count[i]; ++k) {
      weight.push_back(share);
      cls.push_back(i);
    }
  }
  const Packing pack = pack_balanced(weight, cls, n, ranks, slots_per_rank);
  if (!paired.empty() && paired_top <= *std::max_element(pack.load.begin(), pack.load.end())) {
    write_pairs(paired, experts, first_slot, phy2log);
    return false;
  }
  std::vector<int32_t> rank_experts(static_cast<size_t>(slots_per_rank));
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t k = 0; k < slots_per_rank; ++k) {
      rank_experts[k] = experts[cls[pack.item[r * slots_per_rank + k]]];
    }
    std::sort(rank_experts.begin(), rank_experts.end());
    std::copy(rank_experts.begin(), rank_experts.end(),
              phy2log.begin() + first_slot + r * slots_per_rank);
  }
  return slots_per_rank > 2;
}

// Step 1: the experts of each node, [nodes][E/N], ordered by (position of the group in the
// node's pack, offset in the group) as deepseek orders them.
std::vector<int32_t> experts_by_node(std::span<const double> w, const Layout& layout) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<double> group_load(static_cast<size_t>(layout.groups), 0.0);
  std::vector<int32_t> group_cls(static_cast<size_t>(layout.groups));
  for (int64_t k = 0; k < layout.groups; ++k) {
    group_cls[k] = static_cast<int32_t>(k);
    for (int64_t j = 0; j < per_group; ++j) group_load[k] += w[k * per_group + j];
  }
  const int64_t per_node = layout.groups / layout.nodes;
  const Packing pack = pack_balanced(group_load, group_cls, layout.groups, layout.nodes, per_node);
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(layout.experts));
  for (int64_t n = 0; n < layout.nodes; ++n) {
    for (int64_t pos = 0; pos < per_node; ++pos) {
      const int64_t k = pack.item[n * per_node + pos];
      for (int64_t j = 0; j < per_group; ++j) out.push_back(static_cast<int32_t>(k * per_group + j));
    }
  }
  return out;
}

// Step 4 helper: whether a layer's placement keeps at most one replica of an expert per rank.
bool one_replica_per_rank(std::span<const int32_t> phy2log, int64_t slots_per_rank) {
  std::vector<int32_t> rank(static_cast<size_t>(slots_per_rank));
  for (size_t first = 0; first < phy2log.size(); first += slots_per_rank) {
    std::copy(phy2log.begin() + first, phy2log.begin() + first + slots_per_rank, rank.begin());
    std::sort(rank.begin(), rank.end());
    if (std::adjacent_find(rank.begin(), rank.end()) != rank.end()) return false;
  }
  return true;
}

// Step 4 helpers, two slots per rank. deepseek places every expert on every rank when it is
// global (its hierarchy needs groups % nodes == 0; one group on one node is the same).
bool deepseek_is_global(const Layout& layout) {
  return layout.groups % layout.nodes != 0 || (layout.groups == 1 && layout.nodes == 1);
}

// Whether deepseek's layer cannot be better than `ours`: its counts' sorted pairing is the least
// largest rank any packing of its replicas can have, and ours is below it. At 256 ranks most
// layers trade a replica, and deepseek, run on them to be compared, never won: it was a sixth
// of the policy's time. The margin covers the two placements' means being summed in other
// orders.
bool deepseek_cannot_win(std::span<const double> w, std::span<const int32_t> ours,
                         const Layout& layout) {
  constexpr double kMargin = 1e-9;
  const std::vector<int32_t> counts = deepseek_global_counts(w, layout.physical);
  const double floor = two_slots::pairing_top(w, counts, layout.ranks);
  const std::vector<double> ranks = rank_loads(w, ours, layout);
  return *std::max_element(ranks.begin(), ranks.end()) < floor * (1 - kMargin);
}

}  // namespace

void check_balanced_inputs(const LoadMatrix& load, const Layout& layout, bool hierarchical) {
  layout.validate();
  load.validate();
  if (load.experts != layout.experts) {
    fail("the load has ", load.experts, " experts per layer but the layout has ", layout.experts);
  }
  if (hierarchical && layout.groups % layout.nodes != 0) {
    fail("hierarchical placement needs groups ", layout.groups, " to be a multiple of nodes ",
         layout.nodes, " (whole groups are packed onto nodes); drop --hierarchical or change "
         "--groups");
  }
  const int64_t experts = hierarchical ? layout.experts / layout.nodes : layout.experts;
  if (layout.slots_per_rank() > experts) {
    fail("each rank holds ", layout.slots_per_rank(), " slots but only ", experts,
         hierarchical ? " experts live on each node" : " experts exist",
         ", so a rank would hold two replicas of one expert (need physical / ranks <= ",
         experts, ")");
  }
}

namespace {

// Steps 1-3 for one layer into phy2log; returns whether Step 4 must compare it with deepseek's:
// on small shapes (2-3 slots per rank) the local search can stop above deepseek's packing.
// deepseek runs only on the layers the search left more than kCloseEnough above the lower
// bound: on the others it could gain that much at most, and computing it cost as much as the
// rest of the policy at 256 ranks.
// With one or two slots per rank and all experts on all ranks, the layer is already the best
// packing of counts that only improve on deepseek's greedy ones (with one slot the counts are
// optimal; with two the sorted pairing is the best packing of any counts), unless a pair had to
// trade a replica; those layers, and hierarchical ones, are compared, unless even the best
// packing of deepseek's counts is above ours (deepseek_cannot_win).
bool place_layer(std::span<const double> w, const Layout& layout, bool hierarchical,
                 bool thorough, std::span<const int32_t> all, std::span<int32_t> phy2log) {
  const int64_t spr = layout.slots_per_rank();
  bool compare = false;
  if (!hierarchical) {
    compare = !place_experts(w, all, layout.ranks, spr, 0, phy2log, thorough);
  } else {
    const std::vector<int32_t> node_experts = experts_by_node(w, layout);
    const int64_t per_node = layout.experts / layout.nodes;
    const int64_t rpn = layout.ranks_per_node();
    for (int64_t n = 0; n < layout.nodes; ++n) {
      place_experts(w, std::span<const int32_t>(node_experts).subspan(n * per_node, per_node), rpn,
                    spr, n * rpn * spr, phy2log, thorough);
    }
    // balanced's nodes are its own packing of the groups; deepseek's may be better.
    compare = spr <= 2;
  }
  if (spr <= 2) {
    return compare &&
           !(spr == 2 && deepseek_is_global(layout) && deepseek_cannot_win(w, phy2log, layout));
  }
  const std::vector<double> ranks = rank_loads(w, phy2log, layout);
  double total = 0, most = 0;
  for (const double r : ranks) {
    total += r;
    most = std::max(most, r);
  }
  // The bound is at least the mean rank load: a layer within kCloseEnough of the mean needs no
  // bound (it cost a tenth of the policy).
  const double close = 1 + kCloseEnough;
  return most > total / static_cast<double>(layout.ranks) * close &&
         most > layer_lower_bound(w, layout) * close;
}

// Step 4 for one layer: deepseek's layer `theirs` replaces `ours` where it is better and keeps
// at most one replica of an expert per rank (each rank's experts in ascending order). Where
// deepseek's better layer puts two replicas of an expert on one rank it cannot be taken; that
// happens only with 2-3 slots per rank. deepseek is hierarchical exactly when groups % nodes ==
// 0, so its layers keep whole groups on one node whenever `hierarchical` is allowed.
void take_if_better(std::span<const double> w, std::span<const int32_t> theirs,
                    const Layout& layout, std::span<int32_t> ours) {
  const int64_t spr = layout.slots_per_rank();
  if (layer_balancedness(w, theirs, layout) <= layer_balancedness(w, ours, layout) ||
      !one_replica_per_rank(theirs, spr)) {
    return;
  }
  std::copy(theirs.begin(), theirs.end(), ours.begin());
  for (int64_t r = 0; r < layout.ranks; ++r) {
    std::sort(ours.begin() + r * spr, ours.begin() + (r + 1) * spr);
  }
}

std::vector<int32_t> all_experts(const Layout& layout) {
  std::vector<int32_t> all(static_cast<size_t>(layout.experts));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

}  // namespace

Placement balanced(const LoadMatrix& load, const Layout& layout, bool hierarchical,
                   bool thorough) {
  check_balanced_inputs(load, layout, hierarchical);
  Placement out(load.layers, layout.experts, layout.physical);
  const std::vector<int32_t> all = all_experts(layout);
  // Steps 1-3; the layers Step 4 compares with deepseek's, which runs on them all at once.
  std::vector<int64_t> open_layers;
  for (int64_t l = 0; l < load.layers; ++l) {
    if (place_layer(load.row(l), layout, hierarchical, thorough, all, out.layer_phy2log(l))) {
      open_layers.push_back(l);
    }
  }
  if (!open_layers.empty()) {
    LoadMatrix open_load(static_cast<int64_t>(open_layers.size()), load.experts);
    for (size_t i = 0; i < open_layers.size(); ++i) {
      std::copy_n(load.row(open_layers[i]).begin(), load.experts,
                  open_load.row(static_cast<int64_t>(i)).begin());
    }
    const Placement reference = deepseek(open_load, layout);
    for (size_t i = 0; i < open_layers.size(); ++i) {
      const int64_t l = open_layers[i];
      take_if_better(load.row(l), reference.layer_phy2log(static_cast<int64_t>(i)), layout,
                     out.layer_phy2log(l));
    }
  }
  out.derive_from_phy2log();
  return out;
}

std::vector<int32_t> balanced_layer(std::span<const double> w, const Layout& layout,
                                    bool hierarchical, bool thorough) {
  std::vector<int32_t> out(static_cast<size_t>(layout.physical));
  if (place_layer(w, layout, hierarchical, thorough, all_experts(layout), out)) {
    LoadMatrix one(1, layout.experts);
    std::copy(w.begin(), w.end(), one.row(0).begin());
    take_if_better(w, deepseek(one, layout).layer_phy2log(0), layout, out);
  }
  return out;
}

}  // namespace eplb::placement
