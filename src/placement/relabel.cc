// sticky's Step 2 (sticky.cc): a fresh placement relabelled onto the previous one, its ranks
// matched to the previous ranks so that most experts stay on their rank.

#include "placement/relabel.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "placement/slots_by_expert.h"

namespace eplb::placement {
namespace {

// Minimum-cost perfect matching of an n x n matrix (Hungarian algorithm, O(n^3)).
// cost: [n][n]. Returns match[row] = column. Deterministic: ties go to the lowest index.
std::vector<int64_t> min_cost_matching(std::span<const int64_t> cost, int64_t n) {
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> u(n + 1, 0), v(n + 1, 0), col_row(n + 1, 0), way(n + 1, 0);
  for (int64_t i = 1; i <= n; ++i) {
    col_row[0] = i;
    int64_t j0 = 0;
    std::vector<int64_t> minv(n + 1, kBig);
    std::vector<char> used(n + 1, 0);
    do {
      used[j0] = 1;
      const int64_t i0 = col_row[j0];
      int64_t delta = kBig, j1 = 0;
      for (int64_t j = 1; j <= n; ++j) {
        if (used[j]) continue;
        const int64_t cur = cost[(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
        if (cur < minv[j]) {
          minv[j] = cur;
          way[j] = j0;
        }
        if (minv[j] < delta) {
          delta = minv[j];
          j1 = j;
        }
      }
      for (int64_t j = 0; j <= n; ++j) {
        if (used[j]) {
          u[col_row[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
    } while (col_row[j0] != 0);
    do {
      const int64_t j1 = way[j0];
      col_row[j0] = col_row[j1];
      j0 = j1;
    } while (j0 != 0);
  }
  std::vector<int64_t> match(n, -1);
  for (int64_t j = 1; j <= n; ++j) match[col_row[j] - 1] = j - 1;
  return match;
}

// Up to this many ranks a relabelling is matched exactly (Hungarian, O(n^3)); past it, greedily
// (below): the exact matching's cubic time comes to dominate the policy, and the greedy
// matching keeps as many slots on the bench's loads (docs/placement.md).
constexpr int64_t kExactMatching = 32;

// A maximum-overlap matching for n > kExactMatching: the pairs with the largest overlap first
// (ties by row, then column), each taken when its row and column are both free; the rows left
// over take the free columns in ascending order. Pairs of full overlap (a new rank holding
// exactly an old rank's experts) come first, and taking one never costs the exact optimum
// anything (|A n B'| + |A' n A| <= |A| + |A' n B'| when A = B). The overlap is sparse (a rank
// shares experts with a handful of old ranks), so the pairs are few. pairs: (-overlap,
// row * n + column) for the pairs of positive overlap. Returns match[row] = column.
std::vector<int64_t> greedy_max_matching(std::vector<std::pair<int64_t, int64_t>> pairs,
                                         int64_t n) {
  std::sort(pairs.begin(), pairs.end());
  std::vector<int64_t> match(static_cast<size_t>(n), -1);
  std::vector<char> taken(static_cast<size_t>(n), 0);
  for (const auto& [unused, i] : pairs) {
    const int64_t row = i / n, col = i % n;
    if (match[row] >= 0 || taken[col]) continue;
    match[row] = col;
    taken[col] = 1;
  }
  int64_t col = 0;
  for (int64_t row = 0; row < n; ++row) {
    if (match[row] >= 0) continue;
    while (taken[col]) ++col;
    match[row] = col;
    taken[col] = 1;
  }
  return match;
}

// Step 2 helper: writes the experts of new rank `from` (slots of `fresh`) into old rank `to`
// of `out`, each expert the old rank held staying in its old slot, the others filling the free
// slots in ascending expert order.
void relabel_rank(std::span<const int32_t> fresh, std::span<const int32_t> prev, int64_t from,
                  int64_t to, int64_t spr, std::span<int32_t> out) {
  std::vector<int32_t> incoming(fresh.begin() + from * spr, fresh.begin() + (from + 1) * spr);
  std::sort(incoming.begin(), incoming.end());
  std::vector<char> placed(static_cast<size_t>(spr), 0);
  for (int64_t k = 0; k < spr; ++k) {
    const int32_t e = prev[to * spr + k];
    const auto it = std::find(incoming.begin(), incoming.end(), e);
    if (it != incoming.end() && !placed[it - incoming.begin()]) {
      placed[it - incoming.begin()] = 1;
      out[to * spr + k] = e;
    } else {
      out[to * spr + k] = -1;
    }
  }
  int64_t next = 0;
  for (int64_t k = 0; k < spr; ++k) {
    if (out[to * spr + k] >= 0) continue;
    while (placed[next]) ++next;
    placed[next] = 1;
    out[to * spr + k] = incoming[next];
  }
}

}  // namespace

std::vector<int32_t> relabel(std::span<const int32_t> fresh, std::span<const int32_t> prev,
                             const Layout& layout, bool hierarchical) {
  const int64_t spr = layout.slots_per_rank();
  const int64_t nodes = hierarchical ? layout.nodes : 1;
  const int64_t rpn = layout.ranks / nodes;
  // overlap[a][b]: how many slots of new rank a hold an expert that old rank b holds, from
  // the old ranks of each expert (a few each), as (a, b, overlap) for the positive ones.
  std::vector<int64_t> old_start, old_rank;
  slots_by_expert(prev, layout.experts, old_start, old_rank);
  for (int64_t& p : old_rank) p /= spr;  // the slots' ranks
  struct Overlap {
    int64_t a, b, common;
  };
  std::vector<Overlap> overlaps;
  std::vector<int64_t> common(static_cast<size_t>(layout.ranks), 0);
  std::vector<int64_t> touched;
  for (int64_t a = 0; a < layout.ranks; ++a) {
    for (int64_t i = a * spr; i < (a + 1) * spr; ++i) {
      for (int64_t k = old_start[fresh[i]]; k < old_start[fresh[i] + 1]; ++k) {
        if (common[old_rank[k]]++ == 0) touched.push_back(old_rank[k]);
      }
    }
    std::sort(touched.begin(), touched.end());
    for (const int64_t b : touched) {
      overlaps.push_back({a, b, common[b]});
      common[b] = 0;
    }
    touched.clear();
  }
  std::vector<int64_t> node_match(static_cast<size_t>(nodes), 0);
  if (nodes > 1) {
    std::vector<int64_t> cost(static_cast<size_t>(nodes * nodes), 0);
    for (const Overlap& o : overlaps) cost[(o.a / rpn) * nodes + o.b / rpn] -= o.common;
    node_match = min_cost_matching(cost, nodes);
  }
  std::vector<int32_t> out(prev.size(), -1);
  // overlaps are ordered by new rank, so each node's are one run.
  size_t first = 0;
  for (int64_t n = 0; n < nodes; ++n) {
    const int64_t m = node_match[n];
    size_t last = first;
    while (last < overlaps.size() && overlaps[last].a < (n + 1) * rpn) ++last;
    std::vector<int64_t> match;
    if (rpn <= kExactMatching) {
      std::vector<int64_t> cost(static_cast<size_t>(rpn * rpn), 0);
      for (size_t i = first; i < last; ++i) {
        const Overlap& o = overlaps[i];
        if (o.b / rpn == m) cost[(o.a - n * rpn) * rpn + o.b - m * rpn] = -o.common;
      }
      match = min_cost_matching(cost, rpn);
    } else {
      std::vector<std::pair<int64_t, int64_t>> pairs;
      for (size_t i = first; i < last; ++i) {
        const Overlap& o = overlaps[i];
        if (o.b / rpn == m) pairs.emplace_back(-o.common, (o.a - n * rpn) * rpn + o.b - m * rpn);
      }
      match = greedy_max_matching(std::move(pairs), rpn);
    }
    for (int64_t a = 0; a < rpn; ++a) {
      relabel_rank(fresh, prev, n * rpn + a, m * rpn + match[a], spr, out);
    }
    first = last;
  }
  return out;
}

}  // namespace eplb::placement
