// sticky's Step 3: the incremental search (sticky_search.h).

#include "placement/sticky_search.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <span>
#include <utility>
#include <tuple>
#include <vector>

#include "eplb/core/error.h"
#include "placement/slots_by_expert.h"
#include "placement/sort_keys.h"

namespace eplb::placement::sticky_search {
namespace {

// Relative margin an action must lower the top rank by: keeps the search off rounding noise.
constexpr double kMinGain = 1e-12;
// swap_with_all lists the unmoved holders of one expert on the stack when there are fewer.
constexpr int64_t kMaxListed = 16;
// escape() tries at most this many replicates.
constexpr size_t kEscapeTries = 16;
// ...and is used once per search, and only while the top rank is within 2% of the cap: at 144
// ranks (288 slots for 256 experts) the search gets stuck every few rounds further out, where
// escaping does not reach the cap any more often and costs much of the policy's time; a
// second escape per search moves more slots for more time.
constexpr int64_t kMaxEscapes = 1;
constexpr double kEscapeReach = 0.02;

}  // namespace

// Every member but the constructor, run() and apply_swap() (which settle(), in
// sticky_settle.cc, calls too) is marked inline: only this file calls them, and without the
// hint the compiler keeps the per-candidate checks out of line.

Incremental::Incremental(std::span<const double> w, std::span<const int32_t> prev,
                         const Layout& layout, std::span<const int32_t> node_of_expert)
    : w_(w),
      prev_(prev),
      node_of_expert_(node_of_expert),
      experts_(static_cast<int32_t>(layout.experts)),
      ranks_(layout.ranks),
      spr_(layout.slots_per_rank()),
      rpn_(layout.ranks_per_node()),
      cur_(prev.size(), -1),
      count_(static_cast<size_t>(experts_), 0),
      holds_(static_cast<size_t>(ranks_ * experts_), 0),
      load_(static_cast<size_t>(ranks_)),
      share_(static_cast<size_t>(experts_)),
      share_up_(share_.size()),
      share_down_(share_.size()),
      slot_rank_(prev.size()),
      holder_(new int32_t[static_cast<size_t>(experts_ * ranks_)]) {
  // Rank by rank: a division per slot was a tenth of the constructor's time at 448 slots.
  for (int64_t r = 0; r < ranks_; ++r) {
    std::fill_n(slot_rank_.begin() + r * spr_, spr_, static_cast<int32_t>(r));
  }
  slots_by_expert(prev, experts_, prev_start_, prev_slots_);
  peaks_marked_.assign(static_cast<size_t>(experts_), 0);
  rank_touched_.assign(static_cast<size_t>(ranks_), 0);
  clear_and_fill();
  for (int32_t e = 0; e < experts_; ++e) update_shares(e);
  recompute_loads();
  for (size_t p = 0; p < cur_.size(); ++p) {
    if (cur_[p] != prev_[p]) moved_slots_.push_back(static_cast<int64_t>(p));
  }
  moved_ = static_cast<int64_t>(moved_slots_.size());
  track_moved_ = true;
}

bool Incremental::run(double cap, int64_t budget) {
  const int64_t max_rounds = 4 * static_cast<int64_t>(cur_.size());
  // Stuck at this cap before: nothing changed since.
  if (cap == stuck_cap_) return false;
  while (moved_ <= budget && rounds_ < max_rounds) {
    const int64_t g = top_rank();
    if (load_[g] <= cap) {
      trim(cap);
      return true;
    }
    if (!lower_top(g, cap) &&
        (escapes_ >= kMaxEscapes || load_[g] > cap * (1 + kEscapeReach) || !escape(g, cap))) {
      stuck_cap_ = cap;
      return false;
    }
    ++rounds_;
  }
  return false;
}

inline void Incremental::set(int64_t p, int32_t e) {
  const int64_t r = rank_of(p);
  const int32_t old = cur_[p];
  if (old >= 0) {
    holds_[r * experts_ + old] = 0;
    int32_t* list = holder_.get() + static_cast<int64_t>(old) * ranks_;
    *std::find(list, list + count_[old], static_cast<int32_t>(p)) = list[count_[old] - 1];
    if (--count_[old] == 1) {
      redundant_.erase(std::lower_bound(redundant_.begin(), redundant_.end(), old));
    }
  }
  cur_[p] = e;
  if (e >= 0) {
    holds_[r * experts_ + e] = 1;
    holder_[static_cast<int64_t>(e) * ranks_ + count_[e]] = static_cast<int32_t>(p);
    if (++count_[e] == 2) {
      redundant_.insert(std::lower_bound(redundant_.begin(), redundant_.end(), e), e);
    }
  }
  if (track_moved_ && (old != prev_[p]) != (e != prev_[p])) {
    const auto it = std::lower_bound(moved_slots_.begin(), moved_slots_.end(), p);
    if (e != prev_[p]) {
      moved_slots_.insert(it, p);
    } else {
      moved_slots_.erase(it);
    }
  }
}

inline void Incremental::update_shares(int32_t e) {
  const double c = count_[e];
  share_[e] = c > 0 ? w_[e] / c : kInf;
  share_up_[e] = w_[e] / (c + 1);
  share_down_[e] = c >= 2 ? w_[e] / (c - 1) : kInf;
  // The lightest additions stay as they are unless e was among them or now joins them: they
  // were scanned again from every expert after each change; each expert's give-up peaks are
  // listed once instead (mark_peaks_dirty).
  if (!lightest_stale_ &&
      (lighter_addition(e, lightest_.back()) ||
       std::find(lightest_.begin(), lightest_.end(), e) != lightest_.end())) {
    lightest_stale_ = true;
  }
}

inline void Incremental::clear_and_fill() {
  const int64_t slots = static_cast<int64_t>(cur_.size());
  // What set() does into empty slots, with the redundant experts listed once at the end (kept
  // sorted slot by slot, they would cost more than the rest of this function).
  for (int64_t p = 0; p < slots; ++p) {
    const int32_t e = prev_[p];
    const int64_t r = rank_of(p);
    if (!allowed(e, r) || holds(r, e)) continue;
    cur_[p] = e;
    holds_[r * experts_ + e] = 1;
    holder_[static_cast<int64_t>(e) * ranks_ + count_[e]++] = static_cast<int32_t>(p);
  }
  for (int32_t e = 0; e < experts_; ++e) {
    if (count_[e] >= 2) redundant_.push_back(e);
  }
  std::vector<int32_t> missing;
  for (int32_t e = 0; e < experts_; ++e) {
    if (count_[e] == 0) missing.push_back(e);
  }
  std::stable_sort(missing.begin(), missing.end(),
                   [&](int32_t a, int32_t b) { return w_[a] > w_[b]; });
  for (const int32_t e : missing) place_missing(e);
  for (int64_t p = 0; p < slots; ++p) {
    if (cur_[p] >= 0) continue;
    int32_t best = -1;
    for (int32_t e = 0; e < experts_; ++e) {
      if (!allowed(e, rank_of(p)) || holds(rank_of(p), e)) continue;
      if (best < 0 || w_[e] * count_[best] > w_[best] * count_[e]) best = e;
    }
    EPLB_CHECK(best >= 0, "no expert can fill slot ", p);
    set(p, best);
  }
}

inline void Incremental::place_missing(int32_t e) {
  const int64_t slots = static_cast<int64_t>(cur_.size());
  int64_t best = -1;
  double best_load = kInf;
  for (int64_t p = 0; p < slots; ++p) {
    if (cur_[p] >= 0 || !allowed(e, rank_of(p)) || holds(rank_of(p), e)) continue;
    double rank_load = 0;
    for (int64_t k = rank_of(p) * spr_; k < (rank_of(p) + 1) * spr_; ++k) {
      if (cur_[k] >= 0) rank_load += w_[cur_[k]] / count_[cur_[k]];
    }
    if (rank_load < best_load) {
      best = p;
      best_load = rank_load;
    }
  }
  if (best < 0) {
    double best_after = kInf;
    for (int64_t p = 0; p < slots; ++p) {
      const int32_t x = cur_[p];
      if (x < 0 || count_[x] < 2 || !allowed(e, rank_of(p)) || holds(rank_of(p), e)) continue;
      const double after = w_[x] / (count_[x] - 1);
      if (after < best_after) {
        best = p;
        best_after = after;
      }
    }
  }
  EPLB_CHECK(best >= 0, "no slot can take expert ", e);
  set(best, e);
}

inline void Incremental::recompute_loads() {
  peaks_stale_ = true;
  std::fill(load_.begin(), load_.end(), 0.0);
  slot_share_.resize(cur_.size());
  for (size_t p = 0; p < cur_.size(); ++p) {
    slot_share_[p] = share_[cur_[p]];
    load_[rank_of(p)] += slot_share_[p];
  }
  rank_min_share_.resize(static_cast<size_t>(ranks_));
  rank_max_share_.resize(static_cast<size_t>(ranks_));
  for (int64_t r = 0; r < ranks_; ++r) refresh_rank_shares(r);
  build_rank_tree();
}

inline void Incremental::join_rank_node(int64_t i) {
  const RankNode& a = rank_tree_[2 * i];
  const RankNode& b = rank_tree_[2 * i + 1];
  const bool left = a.top > b.top || (a.top == b.top && a.rank < b.rank);
  rank_tree_[i] = {left ? a.top : b.top, std::min(a.least, b.least), left ? a.rank : b.rank};
}

inline void Incremental::build_rank_tree() {
  const int64_t n = ranks_;
  rank_tree_.resize(static_cast<size_t>(2 * n));
  for (int64_t r = 0; r < n; ++r) rank_tree_[n + r] = {load_[r], load_[r], r};
  for (int64_t i = n - 1; i >= 1; --i) join_rank_node(i);
}

inline void Incremental::update_rank_tree(int64_t r) {
  const int64_t n = ranks_;
  rank_tree_[n + r] = {load_[r], load_[r], r};
  for (int64_t i = (n + r) / 2; i >= 1; i /= 2) join_rank_node(i);
}

inline void Incremental::refresh_rank(int64_t r) {
  // Summed in slot order from zero, as recompute_loads() does: every rank's load is always
  // the same sum of its slots, however it was reached.
  double load = 0;
  for (int64_t k = r * spr_; k < (r + 1) * spr_; ++k) load += slot_share_[k];
  load_[r] = load;
  update_rank_tree(r);
  refresh_rank_shares(r);
  for (int64_t k = r * spr_; k < (r + 1) * spr_; ++k) mark_peaks_dirty(cur_[k]);
}

inline void Incremental::mark_peaks_dirty(int32_t e) {
  if (peaks_stale_ || peaks_marked_[e]) return;
  peaks_marked_[e] = 1;
  peaks_dirty_.push_back(e);
}

inline void Incremental::refresh_experts(std::initializer_list<int32_t> experts) {
  touched_ranks_.clear();
  for (const int32_t e : experts) {
    const int32_t* list = holder_.get() + static_cast<int64_t>(e) * ranks_;
    for (int32_t i = 0; i < count_[e]; ++i) {
      slot_share_[list[i]] = share_[e];
      const int64_t r = rank_of(list[i]);
      if (!rank_touched_[r]) {
        rank_touched_[r] = 1;
        touched_ranks_.push_back(static_cast<int32_t>(r));
      }
    }
    mark_peaks_dirty(e);  // its rise changed with its count
  }
  // Each once, in any order: every rank's load is summed from its slots, the tree over the
  // loads and the give-up peaks depend only on the loads, whatever order they are refreshed in.
  for (const int32_t r : touched_ranks_) {
    rank_touched_[r] = 0;
    refresh_rank(r);
  }
}

inline void Incremental::refresh_rank_shares(int64_t r) {
  const auto [lo, hi] =
      std::minmax_element(slot_share_.begin() + r * spr_, slot_share_.begin() + (r + 1) * spr_);
  rank_min_share_[r] = *lo;
  rank_max_share_[r] = *hi;
}

inline double Incremental::top_holder_except(int32_t e, int64_t rank) const {
  double top = -kInf;
  const int32_t* list = holder_.get() + static_cast<int64_t>(e) * ranks_;
  for (int32_t i = 0; i < count_[e]; ++i) {
    const int64_t r = rank_of(list[i]);
    if (r != rank) top = std::max(top, load_[r]);
  }
  return top;
}

inline void Incremental::refresh_give_up_peaks(int32_t y) {
  const int32_t* list = holder_.get() + static_cast<int64_t>(y) * ranks_;
  if (count_[y] < 2) {
    for (int32_t i = 0; i < count_[y]; ++i) give_up_peak_[list[i]] = kInf;
    return;
  }
  // The two most loaded holders of y: each holder's "others" is the top one, or the second
  // for the top one itself.
  double first = -kInf, second = -kInf;
  int32_t first_at = -1;
  for (int32_t i = 0; i < count_[y]; ++i) {
    const double l = load_[rank_of(list[i])];
    if (l > first) {
      second = first;
      first = l;
      first_at = i;
    } else if (l > second) {
      second = l;
    }
  }
  const double rise = share_down_[y] - share_[y];
  for (int32_t i = 0; i < count_[y]; ++i) {
    give_up_peak_[list[i]] = (i == first_at ? second : first) + rise;
  }
}

inline void Incremental::index_give_ups(double limit) {
  if (give_ups_indexed_) return;
  give_ups_indexed_ = true;
  give_up_limit_ = limit;
  if (peaks_stale_) {
    peaks_stale_ = false;
    give_up_peak_.assign(cur_.size(), kInf);
    for (const int32_t y : redundant_) refresh_give_up_peaks(y);
  } else {
    for (const int32_t y : peaks_dirty_) refresh_give_up_peaks(y);
  }
  for (const int32_t y : peaks_dirty_) peaks_marked_[y] = 0;
  peaks_dirty_.clear();
  moved_give_ups_.clear();
  for (const int64_t b : moved_slots_) {
    if (give_up_peak_[b] < limit) moved_give_ups_.push_back(b);
  }
  give_ups_listed_ = false;
}

inline void Incremental::list_give_ups() {
  if (give_ups_listed_) return;
  give_ups_listed_ = true;
  // Only redundant slots can pass (the others' peaks are +inf). Where they are at most half the
  // slots (at 288 slots for 256 experts at most 64), their experts' holders are tested; where
  // they are more (at 512 slots for 256 experts always), every slot is, without branches:
  // which pass is not predictable.
  const int64_t slots = static_cast<int64_t>(cur_.size());
  const int64_t redundant_slots = slots - experts_ + static_cast<int64_t>(redundant_.size());
  give_ups_.resize(cur_.size());
  size_t n = 0;
  if (2 * redundant_slots > slots) {
    for (int64_t b = 0; b < slots; ++b) {
      give_ups_[n] = b;
      n += static_cast<size_t>(give_up_peak_[b] < give_up_limit_);
    }
  } else {
    for (const int32_t y : redundant_) {
      const int32_t* list = holder_.get() + static_cast<int64_t>(y) * ranks_;
      for (int32_t k = 0; k < count_[y]; ++k) {
        give_ups_[n] = list[k];
        n += static_cast<size_t>(give_up_peak_[list[k]] < give_up_limit_);
      }
    }
  }
  give_ups_.resize(n);
}

inline void Incremental::index_moved() {
  if (moved_indexed_) return;
  moved_indexed_ = true;
  moved_share_.resize(moved_slots_.size());
  moved_rank_load_.resize(moved_slots_.size());
  for (size_t i = 0; i < moved_slots_.size(); ++i) {
    moved_share_[i] = slot_share_[moved_slots_[i]];
    moved_rank_load_[i] = load_[rank_of(moved_slots_[i])];
  }
}

inline void Incremental::try_swap(int64_t g, double top, double limit, int64_t a, int64_t b,
                                  Action& best) const {
  const double delta = slot_share_[a] - slot_share_[b];
  if (delta <= 0) return;
  const double peak = std::max(top - delta, load_[rank_of(b)] + delta);
  if (peak < limit) consider_swap(g, peak, a, b, best);
}

inline void Incremental::consider_swap(int64_t g, double peak, int64_t a, int64_t b,
                                       Action& best) const {
  const int64_t h = rank_of(b);
  const int32_t x = cur_[a], y = cur_[b];
  const int64_t c = cost(a, y) + cost(b, x);
  if (!best.beaten_by(c, peak)) return;
  if (h == g || y == x || holds(h, x) || holds(g, y) || !allowed(x, h) || !allowed(y, g)) {
    return;
  }
  best.take(c, peak, a, b, -1);
}

inline void Incremental::swap_with_moved(int64_t g, double top, double limit, int64_t a,
                                         Action& best) {
  index_moved();
  const double sx = slot_share_[a];
  // Few moved slots pass the loads, and which do is not predictable: they are listed without
  // branches first (the test does not depend on `best`), then considered in order.
  listed_.resize(moved_slots_.size());
  size_t n = 0;
  for (size_t i = 0; i < moved_slots_.size(); ++i) {
    const double delta = sx - moved_share_[i];
    const double peak = std::max(top - delta, moved_rank_load_[i] + delta);
    listed_[n] = static_cast<int32_t>(i);
    n += static_cast<size_t>((delta > 0) & (peak < limit));
  }
  for (size_t k = 0; k < n; ++k) {
    const size_t i = static_cast<size_t>(listed_[k]);
    const double delta = sx - moved_share_[i];
    consider_swap(g, std::max(top - delta, moved_rank_load_[i] + delta), a, moved_slots_[i], best);
  }
}

inline void Incremental::try_replicate(int64_t g, double top, double limit, int64_t a, int64_t b,
                                       Action& best) const {
  const int32_t x = cur_[a], y = cur_[b];
  if (y == x) return;
  const int64_t h = rank_of(b);
  const double peak = std::max(
      {top - share_[x] + share_up_[x], load_[h] - share_[y] + share_up_[x], give_up_peak_[b]});
  if (!(peak < limit)) return;
  const int64_t c = cost(b, x);
  if (!best.beaten_by(c, peak) || h == g || holds(h, x) || !allowed(x, h)) return;
  best.take(c, peak, -1, b, x);
}

inline void Incremental::replicate_anywhere(int64_t g, double top, double limit, int64_t a,
                                            Action& best) {
  list_give_ups();
  const int32_t x = cur_[a];
  // Every candidate's peak is at least rep_floor: a replicate lowers g by that much at most.
  const double rep_floor = top - share_[x] + share_up_[x];
  // The walk's order: rank load (as sort_keys.h buckets it), then slot.
  auto walk_key = [&](int64_t b) { return ascending_key(load_[rank_of(b)], 0) | b; };
  bool taken = false;  // best is one of these, at taken_key
  SortKey taken_key = 0;
  for (const int64_t b : give_ups_) {
    const int32_t y = cur_[b];
    if (y == x) continue;
    const int64_t h = rank_of(b);
    const double peak =
        std::max({rep_floor, load_[h] - share_[y] + share_up_[x], give_up_peak_[b]});
    if (!(peak < limit) || h == g || holds(h, x) || !allowed(x, h)) continue;
    const int64_t c = cost(b, x);
    if (best.beaten_by(c, peak)) {
      best.take(c, peak, -1, b, x);
      taken = true;
      taken_key = walk_key(b);
    } else if (taken && c == best.cost && std::max(peak, best.floor) == best.peak) {
      const SortKey key = walk_key(b);
      if (key < taken_key) {
        best.take(c, peak, -1, b, x);
        taken_key = key;
      }
    }
  }
}

inline void Incremental::try_replace(int64_t g, double top, double limit, int64_t a, int32_t y,
                                     Action& best) const {
  const int32_t x = cur_[a];
  if (y < 0 || y == x || count_[x] < 2 || holds(g, y) || !allowed(y, g)) return;
  const double peak = std::max(top - share_[x] + share_up_[y],
                               top_holder_except(x, g) + share_down_[x] - share_[x]);
  const int64_t c = cost(a, y);
  if (peak < limit && best.beaten_by(c, peak)) best.take(c, peak, -1, a, y);
}

inline int32_t Incremental::lightest_addition(int64_t g) {
  auto lighter = [&](int32_t a, int32_t b) { return lighter_addition(a, b); };
  if (lightest_stale_) {
    lightest_stale_ = false;
    const size_t keep = static_cast<size_t>(std::min<int64_t>(spr_ + 1, experts_));
    lightest_.clear();
    for (int32_t e = 0; e < experts_; ++e) {
      if (lightest_.size() == keep && !lighter(e, lightest_.back())) continue;
      if (lightest_.size() == keep) lightest_.pop_back();
      lightest_.insert(std::upper_bound(lightest_.begin(), lightest_.end(), e, lighter), e);
    }
  }
  for (const int32_t e : lightest_) {
    if (allowed(e, g) && !holds(g, e)) return e;
  }
  int32_t light = -1;
  for (int32_t e = 0; e < experts_; ++e) {
    if (!allowed(e, g) || holds(g, e)) continue;
    if (light < 0 || share_up_[e] < share_up_[light]) light = e;
  }
  return light;
}

inline void Incremental::swap_with_all(int64_t g, double top, double limit, int64_t a,
                                       int64_t min_cost, Action& best) {
  const int32_t x = cur_[a];
  const double sx = slot_share_[a];
  // Ranks that can take x at all: not g, under the limit, with a slot lighter than x (or no
  // swap lowers g) and a heaviest slot that would not lift h to the limit, without x, and
  // allowed it. Evaluated without branches: they do not depend on `best`, and which ranks
  // pass is not predictable.
  auto fits = [&](int64_t h) {
    const double lh = load_[h];
    return (h != g) & (lh < limit) & (rank_min_share_[h] < sx) &
           (lh + (sx - rank_max_share_[h]) < limit) & !holds(h, x) & allowed(x, h);
  };
  // And ranks where even the least cost and the best split of the two loads cannot win.
  auto skip_rank = [&](int64_t h) {
    return !fits(h) || !best.beaten_by(min_cost, 0.5 * (top + load_[h]));
  };
  if (cur_[a] != prev_[a] && !best.beaten_by(1, -kInf)) {
    const int32_t was = prev_[a];
    const int32_t* held = holder_.get() + static_cast<int64_t>(was) * ranks_;
    std::array<int32_t, kMaxListed> unmoved{};
    int64_t n = 0;
    for (int32_t i = 0; i < count_[was] && n < kMaxListed; ++i) {
      if (cur_[held[i]] == prev_[held[i]]) unmoved[n++] = held[i];
    }
    if (n < kMaxListed) {
      std::sort(unmoved.begin(), unmoved.begin() + n);
      auto visit = [&](int64_t b) {
        if (!skip_rank(rank_of(b))) try_swap(g, top, limit, a, b, best);
      };
      auto m = moved_slots_.begin();
      for (int64_t i = 0; i < n; ++i) {
        for (; m != moved_slots_.end() && *m < unmoved[i]; ++m) visit(*m);
        visit(unmoved[i]);
      }
      for (; m != moved_slots_.end(); ++m) visit(*m);
      return;
    }
  }
  // Every rank: the ranks that fit are listed first, then weighed against `best` in order.
  ranks_listed_.resize(static_cast<size_t>(ranks_));
  size_t n = 0;
  for (int64_t h = 0; h < ranks_; ++h) {
    ranks_listed_[n] = static_cast<int32_t>(h);
    n += static_cast<size_t>(fits(h));
  }
  for (size_t k = 0; k < n; ++k) {
    const int64_t h = ranks_listed_[k];
    if (!best.beaten_by(min_cost, 0.5 * (top + load_[h]))) continue;
    for (int64_t b = h * spr_; b < (h + 1) * spr_; ++b) try_swap(g, top, limit, a, b, best);
  }
}

inline bool Incremental::lower_top(int64_t g, double cap, double ceiling) {
  moved_indexed_ = false;
  give_ups_indexed_ = false;
  const double top = load_[g];
  const double limit = std::min(top - kMinGain * top, ceiling);
  const double swap_floor = 0.5 * (top + min_load());
  Action best;
  best.floor = cap;
  const int64_t first = g * spr_, last = (g + 1) * spr_;
  // Pass 1, what costs nothing or little: swaps with slots that moved or held x before,
  // replicate into them, replace by the expert the slot held before.
  for (int64_t a = first; a < last; ++a) {
    const int32_t x = cur_[a];
    const bool unmoved = x == prev_[a];
    // A swap moves x away, so its peak is at least top - w_x / c_x.
    const double swap_bound = std::max(swap_floor, top - share_[x]);
    if (best.beaten_by(unmoved ? 0 : -1, swap_bound)) {
      for (const int64_t b : prev_slots_of(x)) try_swap(g, top, limit, a, b, best);
    }
    if (best.beaten_by(unmoved ? 1 : -1, swap_bound)) {
      swap_with_moved(g, top, limit, a, best);
    }
    if (!unmoved && best.beaten_by(-1, top)) {
      try_replace(g, top, limit, a, prev_[a], best);
    }
    // A replicate of x lowers rank g by w_x / c_x - w_x / (c_x + 1) at most.
    const double rep_floor = top - share_[x] + share_up_[x];
    if (rep_floor < limit && best.beaten_by(0, rep_floor)) {
      index_give_ups(limit);
      for (const int64_t b : prev_slots_of(x)) try_replicate(g, top, limit, a, b, best);
      for (const int64_t b : moved_give_ups_) try_replicate(g, top, limit, a, b, best);
    }
  }
  // Pass 2, one moved slot: replicate into any redundant slot, replace by the lightest
  // expert, swap a moved slot of g with any slot.
  int32_t light = -1;
  for (int64_t a = first; a < last; ++a) {
    const int32_t x = cur_[a];
    const double rep_floor = top - share_[x] + share_up_[x];
    if (rep_floor < limit && best.beaten_by(1, rep_floor)) {
      index_give_ups(limit);
      replicate_anywhere(g, top, limit, a, best);
    }
    if (count_[x] >= 2 && best.beaten_by(1, swap_floor)) {
      if (light < 0) light = lightest_addition(g);
      try_replace(g, top, limit, a, light, best);
    }
    if (x != prev_[a] && best.beaten_by(0, std::max(swap_floor, top - share_[x]))) {
      swap_with_all(g, top, limit, a, 0, best);
    }
  }
  // Pass 3, the dearest: swaps of two unmoved slots.
  for (int64_t a = first; a < last; ++a) {
    if (cur_[a] == prev_[a] && best.beaten_by(2, std::max(swap_floor, top - share_[cur_[a]]))) {
      swap_with_all(g, top, limit, a, 2, best);
    }
  }
  if (best.b < 0) return false;
  moved_ += best.cost;
  if (best.a >= 0) {
    apply_swap(best.a, best.b);
  } else {
    const int32_t old_b = cur_[best.b];
    set(best.b, best.expert);
    update_shares(old_b);
    update_shares(best.expert);
    // Only the ranks holding the two experts change (slot b is among the new expert's).
    refresh_experts({old_b, best.expert});
  }
  return true;
}

bool Incremental::escape(int64_t g, double cap) {
  ++escapes_;
  const double top = load_[g];
  const double limit = top - kMinGain * top;
  escape_tries_.clear();
  for (int64_t a = g * spr_; a < (g + 1) * spr_; ++a) {
    const int32_t x = cur_[a];
    if (!(top - share_[x] + share_up_[x] < limit)) continue;
    for (int64_t b = 0; b < static_cast<int64_t>(cur_.size()); ++b) {
      const int64_t h = rank_of(b);
      const int32_t y = cur_[b];
      if (h == g || y == x || holds(h, x) || !allowed(x, h)) continue;
      // It lifts h and y's other holders; at most one of them may reach the limit.
      if (count_[y] < 2) continue;
      const double rise = share_down_[y] - share_[y];
      const double h_load = load_[h] - share_[y] + share_up_[x];
      int64_t over = h_load >= limit ? 1 : 0;
      double over_load = h_load;
      const int32_t* held = holder_.get() + static_cast<int64_t>(y) * ranks_;
      for (int32_t k = 0; k < count_[y] && over < 2; ++k) {
        const int64_t r = rank_of(held[k]);
        if (r != h && load_[r] + rise >= limit) {
          ++over;
          over_load = load_[r] + rise;
        }
      }
      if (over == 1) escape_tries_.push_back({cost(b, x), over_load, b, x});
    }
  }
  const size_t n = std::min(kEscapeTries, escape_tries_.size());
  auto key = [](const EscapeTry& t) { return std::tuple(t.cost, t.load, t.b, t.x); };
  std::partial_sort(escape_tries_.begin(), escape_tries_.begin() + static_cast<int64_t>(n),
                    escape_tries_.end(),
                    [&](const EscapeTry& l, const EscapeTry& r) { return key(l) < key(r); });
  for (size_t i = 0; i < n; ++i) {
    const EscapeTry t = escape_tries_[i];
    const int32_t y = cur_[t.b];
    set(t.b, t.x);
    update_shares(t.x);
    update_shares(y);
    refresh_experts({t.x, y});
    moved_ += t.cost;
    // The one rank at or past the limit now, unless rounding put it just under.
    const int64_t h = top_rank();
    if (load_[h] < limit || lower_top(h, cap, limit)) return true;
    moved_ -= t.cost;
    set(t.b, y);
    update_shares(t.x);
    update_shares(y);
    refresh_experts({t.x, y});
  }
  return false;
}

void Incremental::trim(double cap) {
  // Each undo is checked on the loads it gives (the top rank at most the cap) and undone again
  // otherwise: the sums of the shares decide, exactly as everywhere else.
  auto within = [&] { return load_[top_rank()] <= cap; };
  for (bool changed = true; changed;) {
    changed = false;
    trim_slots_.assign(moved_slots_.begin(), moved_slots_.end());
    for (const int64_t p : trim_slots_) {
      const int32_t x = cur_[p], z = prev_[p];
      if (x == z) continue;
      const int64_t r = rank_of(p);
      // z on another slot of r already, or not allowed there: neither an undo nor a trade.
      if (holds(r, z) || !allowed(z, r)) continue;
      if (count_[x] >= 2) {
        // The loads first: r's own, and x's other holders, which get heavier (z's get lighter).
        if (load_[r] - share_[x] + share_up_[z] <= cap &&
            top_holder_except(x, r) + (share_down_[x] - share_[x]) <= cap) {
          set(p, z);
          update_shares(x);
          update_shares(z);
          refresh_experts({x, z});
          if (within()) {
            --moved_;
            changed = true;
            continue;
          }
          set(p, x);
          update_shares(x);
          update_shares(z);
          refresh_experts({x, z});
        }
      }
      // Trade with a holder q of z on another rank: worth it when q moved or held x before.
      // The holders are copied: a swap tried and undone reorders z's holder list.
      const int32_t* held = holder_.get() + static_cast<int64_t>(z) * ranks_;
      trim_holders_.assign(held, held + count_[z]);
      for (const int32_t q : trim_holders_) {
        const int64_t h = rank_of(q);
        if (h == r || (cur_[q] == prev_[q] && prev_[q] != x)) continue;
        const int64_t c = cost(p, z) + cost(q, x);
        if (c >= 0 || holds(h, x) || !allowed(x, h)) continue;
        if (load_[r] - slot_share_[p] + slot_share_[q] > cap ||
            load_[h] - slot_share_[q] + slot_share_[p] > cap) {
          continue;
        }
        apply_swap(p, q);
        if (within()) {
          moved_ += c;
          changed = true;
          break;
        }
        apply_swap(p, q);
      }
    }
  }
}

void Incremental::apply_swap(int64_t a, int64_t b) {
  // A swap changes the loads of its two ranks only.
  const int32_t x = cur_[a], y = cur_[b];
  set(a, -1);
  set(b, x);
  set(a, y);
  slot_share_[a] = share_[y];
  slot_share_[b] = share_[x];
  // The loads of the two ranks changed, and the give-up peaks of the experts on them.
  refresh_rank(rank_of(a));
  refresh_rank(rank_of(b));
}

}  // namespace eplb::placement::sticky_search
