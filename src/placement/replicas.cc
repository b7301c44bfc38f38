// greedy_replica_counts (replicas.h). The greedy hands out the k-th extra replica of expert e
// (k = 1 .. cap - 1) at the key w_e / k, so its counts are the `extra` largest keys of all
// experts (ties: lower expert, then lower k): the heap run finds them one at a time, and at 512
// slots for 256 experts that was a twentieth of sticky's time. They are found by thresholds
// instead (counts_by_thresholds): every key above t_hi is taken, every key at most t_lo is not,
// and the few between are selected; where the thresholds cannot be confirmed, the heap runs.
//
// The heap run: only the experts that can get an extra replica enter it. Without the cap, each
// extra replica goes to the largest load per replica at the time; that never rises, and the last
// one is at least the final largest, which is at least the mean load per slot (total / slots).
// An expert's load per replica is at most its load, so no expert lighter than that mean gets
// one. With the cap the run is the same until an expert first reaches it; after that the
// argument fails (a capped expert keeps a large load per replica while lighter ones take the
// slots), so a run whose candidates reach the cap starts again with every expert.

#include "placement/replicas.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "eplb/core/error.h"

namespace eplb::placement {
namespace {

// The greedy over `candidates` (ascending). False, with `count` unfinished, when a candidate
// reached `cap` while `stop_at_cap`.
bool greedy(std::span<const double> w, std::span<const int32_t> candidates, int64_t extra,
            int64_t cap, bool stop_at_cap, std::vector<int32_t>& count) {
  std::fill(count.begin(), count.end(), 1);
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
    } else if (stop_at_cap) {
      return false;
    }
  }
  return true;
}

// How many of e's keys w / k (k = 1 .. most) are above t (> 0): the keys fall with k, so the
// largest such k, found from the quotient and confirmed on the divisions themselves.
template <typename Value>
int64_t keys_above(Value w, double t, int64_t most) {
  if (!(w > t)) return 0;
  int64_t k = static_cast<int64_t>(std::min(w / t, static_cast<double>(most)));
  k = std::clamp<int64_t>(k, 1, most);
  while (k < most && w / static_cast<Value>(k + 1) > t) ++k;
  while (k > 0 && !(w / static_cast<Value>(k) > t)) --k;
  return k;
}

// The level t (> 0) where the experts of `candidates` above it would take m extra replicas at
// w_e / t - 1 each (water filling), from a level `t` at most that: t = the sum of their loads /
// (m + their number), repeated until the experts above it stay the same; `candidates` keeps
// only those (no lighter expert is above a later level: it only rises). Their keys above t
// number between m and m + their number (ceil(x) - 1 lies in [x - 1, x)), up to rounding, which
// the caller confirms. 0 when none is found.
template <typename Value>
double water_level(std::span<const Value> w, int64_t m, double t,
                   std::vector<int32_t>& candidates) {
  for (int iteration = 0; iteration < 64; ++iteration) {
    double sum = 0;
    size_t n = 0;
    for (const int32_t e : candidates) {
      candidates[n] = e;
      const bool in = w[e] > t;
      sum += in ? w[e] : 0.0;
      n += in ? 1 : 0;
    }
    candidates.resize(n);
    if (n == 0) return 0;
    const double next = sum / static_cast<double>(m + static_cast<int64_t>(n));
    if (next == t) return t;
    t = next;
  }
  return 0;
}

}  // namespace

template <typename Value>
bool counts_by_thresholds(std::span<const Value> w, int64_t extra, int64_t most,
                          std::vector<int32_t>& count) {
  if (most <= 0 || extra <= 0 || count.size() != w.size()) return false;
  std::vector<int32_t> lo(w.size());
  std::iota(lo.begin(), lo.end(), 0);
  const double t_lo = water_level(w, extra, 0.0, lo);
  if (!(t_lo > 0)) return false;
  // Keys above t_lo: at least `extra` of them, or the thresholds do not hold.
  std::vector<int32_t> last(lo.size());
  int64_t at_lo = 0;
  for (size_t i = 0; i < lo.size(); ++i) {
    last[i] = static_cast<int32_t>(keys_above(w[lo[i]], t_lo, most));
    at_lo += last[i];
  }
  if (at_lo < extra) return false;
  // Above t_hi at most `extra` keys: the level for extra - (experts above t_lo).
  std::vector<int32_t> taken(lo.size(), 0);
  int64_t at_hi = 0;
  const int64_t m_hi = extra - static_cast<int64_t>(lo.size());
  if (m_hi > 0) {
    std::vector<int32_t> hi = lo;
    const double t_hi = water_level(w, m_hi, t_lo, hi);
    if (!(t_hi >= t_lo)) return false;
    for (size_t i = 0; i < lo.size(); ++i) {
      taken[i] = static_cast<int32_t>(keys_above(w[lo[i]], t_hi, most));
      at_hi += taken[i];
    }
    if (at_hi > extra) return false;
  }
  // The keys in (t_lo, t_hi]: the extra - at_hi largest of them are taken too.
  struct Key {
    Value value;
    int32_t at, k;  // at: the expert's place in lo
  };
  std::vector<Key> band;
  band.reserve(static_cast<size_t>(at_lo - at_hi));
  for (size_t i = 0; i < lo.size(); ++i) {
    for (int32_t k = taken[i] + 1; k <= last[i]; ++k) {
      band.push_back({w[lo[i]] / static_cast<Value>(k), static_cast<int32_t>(i), k});
    }
  }
  // lo is ascending, so its places order the experts.
  const auto first = [](const Key& a, const Key& b) {
    return a.value > b.value ||
           (a.value == b.value && (a.at < b.at || (a.at == b.at && a.k < b.k)));
  };
  const int64_t wanted = extra - at_hi;
  if (wanted < static_cast<int64_t>(band.size())) {
    std::nth_element(band.begin(), band.begin() + wanted, band.end(), first);
  }
  for (int64_t i = 0; i < wanted; ++i) ++taken[band[i].at];
  std::fill(count.begin(), count.end(), 1);
  for (size_t i = 0; i < lo.size(); ++i) count[lo[i]] = 1 + taken[i];
  return true;
}

template bool counts_by_thresholds<double>(std::span<const double>, int64_t, int64_t,
                                           std::vector<int32_t>&);
template bool counts_by_thresholds<float>(std::span<const float>, int64_t, int64_t,
                                          std::vector<int32_t>&);

std::vector<int32_t> greedy_replica_counts(std::span<const double> w, int64_t slots, int64_t cap) {
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<int32_t> count(w.size(), 1);
  const int64_t extra = slots - n;
  if (extra <= 0) return count;
  if (counts_by_thresholds(w, extra, cap - 1, count)) return count;
  double total = 0;
  for (const double v : w) total += v;
  // The margin covers rounding in the sum. Listed without branches: a selection of the
  // heaviest experts mispredicted half its compares.
  const double floor = total / static_cast<double>(slots) * (1 - 1e-9);
  std::vector<int32_t> candidates(w.size());
  size_t listed = 0;
  for (int32_t e = 0; e < n; ++e) {
    candidates[listed] = e;
    listed += w[e] >= floor ? 1 : 0;
  }
  if (greedy(w, std::span<const int32_t>(candidates).first(listed), extra, cap, true, count)) {
    return count;
  }
  std::iota(candidates.begin(), candidates.end(), 0);
  greedy(w, candidates, extra, cap, false, count);
  return count;
}

}  // namespace eplb::placement
