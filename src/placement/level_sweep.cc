// The level sweep's steps (level_sweep.h says what and why):
//   1. each expert's fewest replicas with none above T; the experts sorted by load per replica
//      and by the load per replica one more would give;
//   2. from the tallest replica above T / 2 down: its replicas join the count above, the
//      replicas now deep enough the count below; while above outnumbers below, a fix;
//   3. spare slots to the heaviest replicas below T / 2.

#include "placement/level_sweep.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace eplb::placement::two_slots {

bool LevelSweep::run(std::span<const double> w, int64_t ranks, double T, std::vector<int32_t>& r) {
  const int64_t experts = static_cast<int64_t>(w.size());
  const int64_t slots = 2 * ranks;
  const double half = T / 2;
  // Step 1.
  r.assign(w.size(), 0);
  state_.assign(w.size(), kFree);
  int64_t used = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int32_t c = static_cast<int32_t>(std::max(1.0, std::ceil(w[e] / T)));
    while (c > 1 && w[e] / (c - 1) <= T) --c;  // ceil's rounding, one way
    while (w[e] / c > T) ++c;                  // and the other
    if (c > ranks) return false;
    r[e] = c;
    used += c;
  }
  if (used > slots) return false;
  first_.assign(r.begin(), r.end());
  ready_at_.assign(w.size(), -1);
  keys_.resize(w.size());
  for (int64_t e = 0; e < experts; ++e) keys_[e] = descending_key(w[e] / r[e], e);
  sort_keys(keys_, scratch_);
  order_.resize(w.size());
  for (size_t i = 0; i < keys_.size(); ++i) order_[i] = static_cast<int32_t>(key_index(keys_[i]));
  front_ = 0;
  back_ = order_.size();
  keys_.clear();
  for (int64_t e = 0; e < experts; ++e) {
    if (r[e] < ranks) keys_.push_back(ascending_key(w[e] / (r[e] + 1), e));
  }
  sort_keys(keys_, scratch_);
  next_order_.resize(keys_.size());
  for (size_t i = 0; i < keys_.size(); ++i) {
    next_order_[i] = static_cast<int32_t>(key_index(keys_[i]));
  }
  next_ = 0;
  above_heap_.clear();
  below_heap_.clear();
  next_heap_.clear();
  if (ready_.size() < static_cast<size_t>(slots + 2)) ready_.resize(static_cast<size_t>(slots + 2));
  for (int64_t g = 0; g <= ready_top_ && g < static_cast<int64_t>(ready_.size()); ++g) {
    ready_[g].clear();
  }
  ready_top_ = 0;

  // Step 2.
  int64_t above = 0, below = 0;  // replicas at least h above / below T / 2, at the level h
  double h = 0;
  for (int32_t e; (e = next_above(w, r, half, h)) >= 0;) {
    state_[e] = kAbove;
    above += r[e];
    make_ready(r, e);  // its one-slot fix now also takes it off this side
    below += take_below(w, r, half, h);
    while (above > below) {
      const int64_t deficit = above - below;
      int32_t best = -1, best_to = 0;
      double best_ratio = -1;
      int64_t best_cost = 0;
      auto consider = [&](int32_t f, int32_t to, int64_t gain) {
        const int64_t cost = to - r[f];
        const double ratio = static_cast<double>(std::min(gain, deficit)) / cost;
        if (ratio > best_ratio || (ratio == best_ratio && cost < best_cost)) {
          best = f;
          best_to = to;
          best_ratio = ratio;
          best_cost = cost;
        }
      };
      // The expert of this level, one more replica.
      if (state_[e] == kAbove && r[e] < ranks) {
        const int32_t to = r[e] + 1;
        consider(e, to, r[e] + (half - w[e] / to >= h ? to : 0));
      }
      // Where that, or the best one-slot fix of another expert, covers the deficit, no dearer
      // fix does better; otherwise every expert not yet deep enough is scanned.
      const double depth_load = half - h;  // a replica at most this is deep enough
      if (best_ratio < static_cast<double>(deficit) && depth_load > 0) {
        int64_t gain = 0;
        const int32_t f = best_one_slot(w, r, depth_load, gain);
        if (f >= 0) consider(f, r[f] + 1, gain);
      }
      if (best_ratio < static_cast<double>(deficit) && depth_load > 0) {
        for (int32_t f = 0; f < experts; ++f) {
          if (state_[f] == kBelow) continue;
          const double need = std::ceil(w[f] / depth_load);
          if (need > static_cast<double>(ranks)) continue;
          int32_t to = std::max(r[f] + 1, static_cast<int32_t>(need));
          while (w[f] / to > depth_load) ++to;  // ceil's rounding
          if (to > ranks) continue;
          consider(f, to, to + (state_[f] == kAbove ? r[f] : 0));
        }
      }
      if (best < 0 || best_ratio <= 0) return false;
      used += best_cost;
      if (used > slots) return false;
      if (state_[best] == kAbove) above -= r[best];
      r[best] = best_to;
      state_[best] = kFree;
      const double share = w[best] / r[best];
      if (share <= half && half - share >= h) {
        state_[best] = kBelow;
        below += r[best];
      } else {
        requeue(w, r, ranks, half, best);  // above T / 2 (lower than h) or not deep enough
      }
    }
  }

  // Step 3.
  int64_t spare = slots - used;
  if (spare > 0) {
    below_heap_.clear();
    for (int32_t e = 0; e < experts; ++e) {
      if (w[e] / r[e] <= half && r[e] < ranks) below_heap_.push_back({w[e] / r[e], e, r[e]});
    }
    std::make_heap(below_heap_.begin(), below_heap_.end());
    for (; spare > 0 && !below_heap_.empty(); --spare) {
      std::pop_heap(below_heap_.begin(), below_heap_.end());
      const int32_t e = below_heap_.back().expert;
      below_heap_.pop_back();
      ++r[e];
      if (r[e] < ranks) {
        below_heap_.push_back({w[e] / r[e], e, r[e]});
        std::push_heap(below_heap_.begin(), below_heap_.end());
      }
    }
    if (spare > 0) return false;
  }
  return true;
}

int32_t LevelSweep::next_above(std::span<const double> w, std::span<const int32_t> r,
                               double half, double& height) {
  // The sorted front: skip experts that changed or were taken since. The first that did not
  // is the tallest left there, unless it is below T / 2 (then so are the rest).
  while (front_ < back_ && (r[order_[front_]] != first_[order_[front_]] ||
                            state_[order_[front_]] != kFree)) {
    ++front_;
  }
  int32_t from_front = -1;
  double front_height = 0;
  if (front_ < back_) {
    const int32_t e = order_[front_];
    if (w[e] / r[e] > half) {
      from_front = e;
      front_height = w[e] / r[e] - half;
    }
  }
  while (!above_heap_.empty()) {
    const Entry& x = above_heap_.front();
    if (x.count == r[x.expert] && state_[x.expert] == kFree) break;
    std::pop_heap(above_heap_.begin(), above_heap_.end());
    above_heap_.pop_back();
  }
  const bool heap_first =
      !above_heap_.empty() &&
      (from_front < 0 || above_heap_.front().key > front_height ||
       (above_heap_.front().key == front_height && above_heap_.front().expert < from_front));
  if (heap_first) {
    height = above_heap_.front().key;
    const int32_t e = above_heap_.front().expert;
    std::pop_heap(above_heap_.begin(), above_heap_.end());
    above_heap_.pop_back();
    return e;
  }
  if (from_front < 0) return -1;
  ++front_;
  height = front_height;
  return from_front;
}

int64_t LevelSweep::take_below(std::span<const double> w, std::span<const int32_t> r, double half,
                               double depth) {
  int64_t taken = 0;
  // The sorted back, deepest first; it stops at the front (those are above T / 2 or taken).
  while (back_ > front_) {
    const int32_t e = order_[back_ - 1];
    if (r[e] == first_[e] && state_[e] == kFree) {
      const double share = w[e] / r[e];
      if (share > half || half - share < depth) break;
      state_[e] = kBelow;
      taken += r[e];
    }
    --back_;
  }
  while (!below_heap_.empty() && below_heap_.front().key >= depth) {
    const Entry x = below_heap_.front();
    std::pop_heap(below_heap_.begin(), below_heap_.end());
    below_heap_.pop_back();
    if (x.count != r[x.expert] || state_[x.expert] != kFree) continue;
    state_[x.expert] = kBelow;
    taken += r[x.expert];
  }
  return taken;
}

void LevelSweep::requeue(std::span<const double> w, std::span<const int32_t> r, int64_t ranks,
                         double half, int32_t e) {
  const double share = w[e] / r[e];
  auto& heap = share > half ? above_heap_ : below_heap_;
  heap.push_back({share > half ? share - half : half - share, e, r[e]});
  std::push_heap(heap.begin(), heap.end());
  if (r[e] < ranks) {
    next_heap_.push_back({-(w[e] / (r[e] + 1)), e, r[e]});
    std::push_heap(next_heap_.begin(), next_heap_.end());
  }
}

void LevelSweep::make_ready(std::span<const int32_t> r, int32_t e) {
  // Only where its one more replica is already deep enough (best_one_slot moved it in at this
  // count): its gain grew when it was counted above.
  if (state_[e] == kBelow || ready_at_[e] != r[e]) return;
  const int64_t g = gain_of(r, e);
  ready_[g].push_back(e);
  ready_top_ = std::max(ready_top_, g);
}

int32_t LevelSweep::best_one_slot(std::span<const double> w, std::span<const int32_t> r,
                                  double depth_load, int64_t& gain) {
  // Levels only sink, so a fix deep enough once stays so while the count is the same.
  auto enter = [&](int32_t e) {
    ready_at_[e] = r[e];
    if (state_[e] == kBelow) return;
    const int64_t g = gain_of(r, e);
    ready_[g].push_back(e);
    ready_top_ = std::max(ready_top_, g);
  };
  while (next_ < next_order_.size()) {
    const int32_t e = next_order_[next_];
    if (r[e] != first_[e]) {
      ++next_;
      continue;
    }
    if (w[e] / (r[e] + 1) > depth_load) break;
    ++next_;
    enter(e);
  }
  while (!next_heap_.empty() && -next_heap_.front().key <= depth_load) {
    const Entry x = next_heap_.front();
    std::pop_heap(next_heap_.begin(), next_heap_.end());
    next_heap_.pop_back();
    if (x.count == r[x.expert]) enter(x.expert);
  }
  for (; ready_top_ > 0; --ready_top_) {
    auto& bucket = ready_[ready_top_];
    while (!bucket.empty()) {
      const int32_t e = bucket.back();
      if (ready_at_[e] == r[e] && state_[e] != kBelow && gain_of(r, e) == ready_top_) {
        gain = ready_top_;
        return e;
      }
      bucket.pop_back();
    }
  }
  return -1;
}

}  // namespace eplb::placement::two_slots
