// Placement: sticky. Per layer:
//   Step 1: the target. balanced's placement of the same load has balancedness b; any
//           placement whose largest rank load is at most cap = mean rank load / (b - tolerance)
//           is good enough (the mean does not depend on the placement).
//   Step 2: the fallback: balanced's placement relabelled onto the previous one: its ranks
//           matched to the previous ranks so that most experts stay on their rank (Hungarian
//           assignment up to 32 ranks, greedy by overlap past that; nodes first when
//           hierarchical), and each expert that stays keeps its old slot (relabel.h).
//   Step 3: incremental: start from the previous placement, clear the slots that break the
//           rules (a second replica on a rank; in hierarchical mode an expert on another node
//           than its group's), fill them, then lower the most loaded rank with the cheapest
//           action (in moved slots) until it is at most the cap:
//             swap        two slots of different ranks trade experts
//             replicate   a slot elsewhere takes a second replica of an expert of the top rank
//             replace     a slot of the top rank gives up a redundant replica for another
//                         expert
//           In hierarchical mode, groups keep the node that holds most of their slots (or
//           balanced's nodes, relabelled, when that assignment cannot reach the cap).
//   Step 4: keep the candidate that reaches the target with the fewest moved slots. Step 3 runs
//           first with a small budget (1/8 of the slots). When that fails and the layout is
//           not hierarchical, Step 2b and Step 3 with 1/4 of the slots come next, and the best
//           of them within 1/4 is kept as it is. Only then are Step 2 and the rest of Step 3
//           (budget: the best candidate's moves) run.
//   Step 2b, with two slots per rank: the previous pairs moved to balanced's counts
//           (two_slots::repair), a second fallback that usually keeps far more.
//   Step 0, with 3+ slots per rank: Step 3 first against the lower bound's target (at least
//           balanced's); when that is reached in the small budget, balanced is not computed.
// The tolerance is per layer: every layer's balancedness is at least balanced's minus it, so
// the mean over layers and the step-weighted figure are too.

#include "eplb/placement/sticky.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/placement/balanced.h"
#include "eplb/placement/metrics.h"
#include "placement/relabel.h"
#include "placement/two_slots.h"

namespace eplb::placement {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Relative margin an action must lower the top rank by: keeps the search off rounding noise.
constexpr double kMinGain = 1e-12;
// An incremental result moving at most 1/kFewMoved of the slots is kept without computing the
// relabelled fallback: a fresh packing relabelled keeps far fewer slots than that.
constexpr int64_t kFewMoved = 8;
// Once balanced's target is known, a candidate moving at most 1/kFewMovedFresh of the slots is
// kept without the relabelled fallback: relabelling moves most slots (80% at 64 ranks on
// lognormal loads), and computing it was a third of the policy's time past 32 ranks.
constexpr int64_t kFewMovedFresh = 4;
// swap_with_all lists the unmoved holders of one expert on the stack when there are fewer.
constexpr int64_t kMaxListed = 16;

int64_t count_moved(std::span<const int32_t> before, std::span<const int32_t> after) {
  int64_t moved = 0;
  for (size_t p = 0; p < before.size(); ++p) moved += before[p] != after[p];
  return moved;
}

// Step 3: the incremental search on one layer. Each expert may live only on the ranks of its
// node (`node_of_expert`, empty: anywhere).
class Incremental {
 public:
  // Step 3a happens here: the previous placement, repaired and filled.
  Incremental(std::span<const double> w, std::span<const int32_t> prev, const Layout& layout,
              std::span<const int32_t> node_of_expert)
      : w_(w), prev_(prev), node_of_expert_(node_of_expert),
        experts_(static_cast<int32_t>(layout.experts)), ranks_(layout.ranks),
        spr_(layout.slots_per_rank()), rpn_(layout.ranks_per_node()), cur_(prev.size(), -1),
        count_(static_cast<size_t>(experts_), 0),
        holds_(static_cast<size_t>(ranks_ * experts_), 0), load_(static_cast<size_t>(ranks_)),
        prev_start_(static_cast<size_t>(experts_ + 1), 0), prev_slots_(prev.size()),
        share_(static_cast<size_t>(experts_)), share_up_(share_.size()),
        share_down_(share_.size()), slot_rank_(prev.size()),
        holder_(new int32_t[static_cast<size_t>(experts_ * ranks_)]) {
    for (size_t p = 0; p < prev.size(); ++p) {
      slot_rank_[p] = static_cast<int32_t>(static_cast<int64_t>(p) / spr_);
    }
    for (const int32_t e : prev) ++prev_start_[e + 1];
    std::partial_sum(prev_start_.begin(), prev_start_.end(), prev_start_.begin());
    std::vector<int64_t> next(prev_start_.begin(), prev_start_.end() - 1);
    for (size_t p = 0; p < prev.size(); ++p) {
      prev_slots_[next[prev[p]]++] = static_cast<int64_t>(p);
    }
    clear_and_fill();
    for (int32_t e = 0; e < experts_; ++e) update_shares(e);
    recompute_loads();
    for (size_t p = 0; p < cur_.size(); ++p) {
      if (cur_[p] != prev_[p]) moved_slots_.push_back(static_cast<int64_t>(p));
    }
    moved_ = static_cast<int64_t>(moved_slots_.size());
    track_moved_ = true;
  }

  // Step 3b: lowers the top rank until it is at most `cap` (true) or no action helps, more than
  // `budget` slots have moved, or the round limit is spent (false). May be called again with a
  // larger budget; it goes on from where it stopped.
  bool run(double cap, int64_t budget) {
    const int64_t max_rounds = 4 * static_cast<int64_t>(cur_.size());
    while (moved_ <= budget && rounds_ < max_rounds) {
      const int64_t g = top_rank();
      if (load_[g] <= cap) return true;
      if (!lower_top(g, cap)) return false;
      ++rounds_;
    }
    return false;
  }

  std::span<const int32_t> slots() const { return cur_; }
  int64_t moved() const { return moved_; }

 private:
  int64_t rank_of(int64_t slot) const { return slot_rank_[slot]; }
  bool allowed(int32_t e, int64_t rank) const {
    return node_of_expert_.empty() || node_of_expert_[e] == rank / rpn_;
  }
  bool holds(int64_t rank, int32_t e) const { return holds_[rank * experts_ + e] != 0; }
  // Cost in moved slots of putting expert e into slot p in place of its current expert.
  int64_t cost(int64_t p, int32_t e) const {
    return static_cast<int64_t>(e != prev_[p]) - static_cast<int64_t>(cur_[p] != prev_[p]);
  }

  // Puts e (-1: nothing) into slot p, keeping holds_, count_, the holder lists and the moved
  // slots current.
  void set(int64_t p, int32_t e) {
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

  // Load per replica of e now, with one more replica and with one fewer.
  void update_shares(int32_t e) {
    const double c = count_[e];
    share_[e] = c > 0 ? w_[e] / c : kInf;
    share_up_[e] = w_[e] / (c + 1);
    share_down_[e] = c >= 2 ? w_[e] / (c - 1) : kInf;
    lightest_stale_ = true;
  }

  // Keep every previous slot that follows the rules; give every expert without a slot one
  // (freeing redundant replicas when there are too few free slots); fill what is left with
  // extra replicas of the experts with the largest load per replica.
  void clear_and_fill() {
    const int64_t slots = static_cast<int64_t>(cur_.size());
    for (int64_t p = 0; p < slots; ++p) {
      const int32_t e = prev_[p];
      if (allowed(e, rank_of(p)) && !holds(rank_of(p), e)) set(p, e);
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

  // A free slot for expert e: on an allowed rank without e, the rank whose filled slots carry
  // the least load (lowest slot on a tie); if none is free, the slot of the redundant replica
  // whose loss costs least.
  void place_missing(int32_t e) {
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

  // The rank loads, and each slot's load with each rank's least and largest.
  void recompute_loads() {
    std::fill(load_.begin(), load_.end(), 0.0);
    slot_share_.resize(cur_.size());
    for (size_t p = 0; p < cur_.size(); ++p) {
      slot_share_[p] = share_[cur_[p]];
      load_[rank_of(p)] += slot_share_[p];
    }
    rank_min_share_.resize(static_cast<size_t>(ranks_));
    rank_max_share_.resize(static_cast<size_t>(ranks_));
    for (int64_t r = 0; r < ranks_; ++r) refresh_rank_shares(r);
  }

  void refresh_rank_shares(int64_t r) {
    const auto [lo, hi] = std::minmax_element(slot_share_.begin() + r * spr_,
                                              slot_share_.begin() + (r + 1) * spr_);
    rank_min_share_[r] = *lo;
    rank_max_share_[r] = *hi;
  }

  int64_t top_rank() const {
    return std::max_element(load_.begin(), load_.end()) - load_.begin();
  }

  // The lightest rank load, for the bound on swaps.
  double min_load() const { return *std::min_element(load_.begin(), load_.end()); }

  // The largest load among the ranks holding e other than `rank` (-inf: none). e has at most
  // one replica per rank and few replicas, so walking its holders is cheap.
  double top_holder_except(int32_t e, int64_t rank) const {
    double top = -kInf;
    const int32_t* list = holder_.get() + static_cast<int64_t>(e) * ranks_;
    for (int32_t i = 0; i < count_[e]; ++i) {
      const int64_t r = rank_of(list[i]);
      if (r != rank) top = std::max(top, load_[r]);
    }
    return top;
  }

  // On the first use in a round: for each slot b whose expert y has 2+ replicas, the largest
  // load of y's other holders once b gives y up (+inf when y has one replica, or when that
  // reaches `limit`); it does not depend on the expert b takes instead. Also the moved slots
  // where it stays below `limit`, ascending.
  void index_give_ups(double limit) {
    if (give_ups_indexed_) return;
    give_ups_indexed_ = true;
    // Only the slots of the last index are finite.
    give_up_peak_.resize(cur_.size(), kInf);
    for (const int64_t b : give_ups_) give_up_peak_[b] = kInf;
    give_ups_.clear();
    for (const int32_t y : redundant_) {
      // The two most loaded holders of y: each holder's "others" is the top one, or the
      // second for the top one itself.
      const int32_t* list = holder_.get() + static_cast<int64_t>(y) * ranks_;
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
        const double peak = (i == first_at ? second : first) + rise;
        if (peak < limit) {
          give_up_peak_[list[i]] = peak;
          give_ups_.push_back(list[i]);
        }
      }
    }
    moved_give_ups_.clear();
    for (const int64_t b : moved_slots_) {
      if (give_up_peak_[b] < kInf) moved_give_ups_.push_back(b);
    }
    give_ups_sorted_ = false;
  }

  // The slots of index_give_ups by the load of their rank, then ascending (so by rank index
  // on equal loads), sorted on the first use in a round: redundant slots on light ranks come
  // first, so the first fitting one is usually the best.
  std::span<const int64_t> give_ups_by_load() {
    if (!give_ups_sorted_) {
      give_ups_sorted_ = true;
      std::sort(give_ups_.begin(), give_ups_.end(), [&](int64_t a, int64_t b) {
        const double la = load_[rank_of(a)], lb = load_[rank_of(b)];
        return la < lb || (la == lb && a < b);
      });
    }
    return give_ups_;
  }

  // On the first use in a round: the loads of the moved slots and of their ranks, side by side
  // for the scans that swap with every moved slot.
  void index_moved() {
    if (moved_indexed_) return;
    moved_indexed_ = true;
    moved_share_.resize(moved_slots_.size());
    moved_rank_load_.resize(moved_slots_.size());
    for (size_t i = 0; i < moved_slots_.size(); ++i) {
      moved_share_[i] = slot_share_[moved_slots_[i]];
      moved_rank_load_[i] = load_[rank_of(moved_slots_[i])];
    }
  }

  // The best action found so far: least cost in moved slots, then lowest new peak (the
  // largest load among the ranks it changes), then first found.
  struct Action {
    double floor = 0;  // peaks at or below the cap are all as good
    int64_t cost = std::numeric_limits<int64_t>::max();
    double peak = kInf;
    int64_t a = -1, b = -1;  // swap: slots a <-> b; otherwise slot b takes `expert`
    int32_t expert = -1;
    bool beaten_by(int64_t c, double pk) const {
      return c < cost || (c == cost && std::max(pk, floor) < peak);
    }
    void take(int64_t c, double pk, int64_t slot_a, int64_t slot_b, int32_t e) {
      cost = c;
      peak = std::max(pk, floor);
      a = slot_a;
      b = slot_b;
      expert = e;
    }
  };

  // Swap slot a (on the top rank g) with slot b of another rank.
  // Most candidates fail on the loads alone, so those come first.
  void try_swap(int64_t g, double top, double limit, int64_t a, int64_t b, Action& best) const {
    const double delta = slot_share_[a] - slot_share_[b];
    if (delta <= 0) return;
    const double peak = std::max(top - delta, load_[rank_of(b)] + delta);
    if (peak < limit) consider_swap(g, peak, a, b, best);
  }
  void consider_swap(int64_t g, double peak, int64_t a, int64_t b, Action& best) const {
    const int64_t h = rank_of(b);
    const int32_t x = cur_[a], y = cur_[b];
    const int64_t c = cost(a, y) + cost(b, x);
    if (!best.beaten_by(c, peak)) return;
    if (h == g || y == x || holds(h, x) || holds(g, y) || !allowed(x, h) || !allowed(y, g)) {
      return;
    }
    best.take(c, peak, a, b, -1);
  }

  // try_swap of slot a with every moved slot, in ascending order.
  void swap_with_moved(int64_t g, double top, double limit, int64_t a, Action& best) {
    index_moved();
    const double sx = slot_share_[a];
    for (size_t i = 0; i < moved_slots_.size(); ++i) {
      const double delta = sx - moved_share_[i];
      if (delta <= 0) continue;
      const double peak = std::max(top - delta, moved_rank_load_[i] + delta);
      if (peak < limit) consider_swap(g, peak, a, moved_slots_[i], best);
    }
  }

  // Slot b of another rank gives up its expert y (count >= 2) for a replica of x = cur_[a].
  // Every holder of x gets lighter; the other holders of y get heavier.
  // Needs index_give_ups of this round.
  void try_replicate(int64_t g, double top, double limit, int64_t a, int64_t b,
                     Action& best) const {
    const int32_t x = cur_[a], y = cur_[b];
    if (y == x) return;
    const int64_t h = rank_of(b);
    const double peak = std::max({top - share_[x] + share_up_[x],
                                  load_[h] - share_[y] + share_up_[x], give_up_peak_[b]});
    if (!(peak < limit)) return;
    const int64_t c = cost(b, x);
    if (!best.beaten_by(c, peak) || h == g || holds(h, x) || !allowed(x, h)) return;
    best.take(c, peak, -1, b, x);
  }

  // Slot a of the top rank gives up x (count >= 2) for y.
  void try_replace(int64_t g, double top, double limit, int64_t a, int32_t y,
                   Action& best) const {
    const int32_t x = cur_[a];
    if (y < 0 || y == x || count_[x] < 2 || holds(g, y) || !allowed(y, g)) return;
    const double peak = std::max(top - share_[x] + share_up_[y],
                                 top_holder_except(x, g) + share_down_[x] - share_[x]);
    const int64_t c = cost(a, y);
    if (peak < limit && best.beaten_by(c, peak)) best.take(c, peak, -1, a, y);
  }

  // The expert that adds least to rank g: the smallest load per replica after one more.
  // Looked up first among the slots_per_rank + 1 lightest experts (kept until the shares
  // change): a rank cannot hold them all, so only a node rule sends it to the full scan.
  int32_t lightest_addition(int64_t g) {
    auto lighter = [&](int32_t a, int32_t b) {
      return share_up_[a] < share_up_[b] || (share_up_[a] == share_up_[b] && a < b);
    };
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

  // Swap slot a with every slot of the ranks that can take its expert, skipping the ranks where
  // even the least cost `min_cost` and the best split of the two loads cannot beat `best`.
  // Slots are visited in ascending order (ranks are runs of slots). When a is moved and
  // only a swap of cost <= 0 can still win, b must be moved too or hold a's previous expert
  // (a swap of moved a with unmoved b costs 1 otherwise), so only those are visited.
  void swap_with_all(int64_t g, double top, double limit, int64_t a, int64_t min_cost,
                     Action& best) const {
    const int32_t x = cur_[a];
    const double sx = slot_share_[a];
    // Also skipped: ranks where every slot is at least as heavy as x (no swap lowers g), or
    // where even the heaviest would lift h to the limit.
    auto skip_rank = [&](int64_t h) {
      return h == g || load_[h] >= limit || rank_min_share_[h] >= sx ||
             load_[h] + (sx - rank_max_share_[h]) >= limit || holds(h, x) || !allowed(x, h) ||
             !best.beaten_by(min_cost, 0.5 * (top + load_[h]));
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
    for (int64_t h = 0; h < ranks_; ++h) {
      if (skip_rank(h)) continue;
      for (int64_t b = h * spr_; b < (h + 1) * spr_; ++b) try_swap(g, top, limit, a, b, best);
    }
  }

  // One action that lowers rank g below its load without lifting any other rank to it; see
  // Action for which. Candidates are visited by the least cost they can have, and a set is
  // skipped when even its least cost and lowest possible peak cannot beat the best so far:
  //   replicate x = cur_[a]: peak >= top - w_x/c_x + w_x/(c_x+1); cost -1 into a slot that held
  //     x before, 0 into a moved slot, 1 into any other redundant slot;
  //   swap: peak >= (top + lightest load) / 2; cost >= -1 + (a unmoved), and a swap of an
  //     unmoved a costs 2 unless b is moved or held x before.
  bool lower_top(int64_t g, double cap) {
    moved_indexed_ = false;
    give_ups_indexed_ = false;
    const double top = load_[g];
    const double limit = top - kMinGain * top;
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
        for (const int64_t b : give_ups_by_load()) {
          if (!best.beaten_by(1, rep_floor)) break;
          try_replicate(g, top, limit, a, b, best);
        }
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
    const int32_t old_b = cur_[best.b];
    if (best.a >= 0) {
      // A swap changes the loads of its two ranks only.
      const int32_t x = cur_[best.a];
      const double delta = share_[x] - share_[old_b];
      set(best.a, -1);
      set(best.b, x);
      set(best.a, old_b);
      load_[rank_of(best.a)] -= delta;
      load_[rank_of(best.b)] += delta;
      slot_share_[best.a] = share_[old_b];
      slot_share_[best.b] = share_[x];
      refresh_rank_shares(rank_of(best.a));
      refresh_rank_shares(rank_of(best.b));
    } else {
      set(best.b, best.expert);
      update_shares(old_b);
      update_shares(best.expert);
      recompute_loads();
    }
    return true;
  }

  // The slots that held expert e in the previous placement.
  std::span<const int64_t> prev_slots_of(int32_t e) const {
    return {prev_slots_.data() + prev_start_[e],
            static_cast<size_t>(prev_start_[e + 1] - prev_start_[e])};
  }

  std::span<const double> w_;
  std::span<const int32_t> prev_;
  std::span<const int32_t> node_of_expert_;
  int32_t experts_;
  int64_t ranks_, spr_, rpn_;
  std::vector<int32_t> cur_;    // [physical]
  std::vector<int32_t> count_;  // [experts]
  std::vector<uint8_t> holds_;  // [ranks][experts]
  std::vector<double> load_;    // [ranks]
  std::vector<int64_t> prev_start_;  // [experts + 1]: prev_slots_of(e) is
  std::vector<int64_t> prev_slots_;  // prev_slots_[prev_start_[e] .. prev_start_[e + 1])
  std::vector<double> share_, share_up_, share_down_;  // [experts]
  std::vector<int32_t> slot_rank_;                     // [physical]
  // [experts][ranks]: the slots holding e are holder_[e * ranks_ .. e * ranks_ + count_[e]).
  // Left uninitialised: only those first count_[e] entries are ever read, and clearing all of
  // it (256 KiB at 256 ranks) cost as much as a layer's search.
  std::unique_ptr<int32_t[]> holder_;
  std::vector<double> slot_share_;  // [physical]: share_ of the slot's expert
  std::vector<double> rank_min_share_, rank_max_share_;  // [ranks]: least, largest slot_share_
  std::vector<int32_t> redundant_;  // experts with 2+ replicas, ascending
  std::vector<int32_t> lightest_;   // the experts with the least share_up_, ascending
  bool lightest_stale_ = true;
  // Ascending; kept current by set() once the constructor has filled the slots.
  std::vector<int64_t> moved_slots_;  // slots whose expert differs from the previous one
  bool track_moved_ = false;
  // Per round (index_moved): [moved slots] side by side with moved_slots_.
  bool moved_indexed_ = false;
  std::vector<double> moved_share_, moved_rank_load_;
  // Per round (index_give_ups).
  bool give_ups_indexed_ = false;
  std::vector<double> give_up_peak_;       // [physical]
  std::vector<int64_t> moved_give_ups_;    // moved slots with give_up_peak_ below the limit
  std::vector<int64_t> give_ups_;         // all such slots (give_ups_by_load)
  bool give_ups_sorted_ = false;
  int64_t moved_ = 0;
  int64_t rounds_ = 0;
};

// Hierarchical: the node of each group, groups/N per node, giving each group the node that
// holds most of its slots in `slots` (greedy over (group, node) pairs by overlap, ties by
// index). [groups]
std::vector<int64_t> groups_to_nodes(std::span<const int32_t> slots, const Layout& layout) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<int64_t> overlap(static_cast<size_t>(layout.groups * layout.nodes), 0);
  for (size_t p = 0; p < slots.size(); ++p) {
    ++overlap[(slots[p] / per_group) * layout.nodes + layout.node_of_slot(p)];
  }
  std::vector<int64_t> pairs(overlap.size());
  std::iota(pairs.begin(), pairs.end(), 0);
  std::stable_sort(pairs.begin(), pairs.end(),
                   [&](int64_t a, int64_t b) { return overlap[a] > overlap[b]; });
  std::vector<int64_t> node(static_cast<size_t>(layout.groups), -1);
  std::vector<int64_t> taken(static_cast<size_t>(layout.nodes), 0);
  const int64_t per_node = layout.groups / layout.nodes;
  for (const int64_t pair : pairs) {
    const int64_t k = pair / layout.nodes, n = pair % layout.nodes;
    if (node[k] < 0 && taken[n] < per_node) {
      node[k] = n;
      ++taken[n];
    }
  }
  return node;
}

// [experts]: the node of each expert's group.
std::vector<int32_t> expert_nodes(std::span<const int64_t> group_node, const Layout& layout) {
  const int64_t per_group = layout.experts / layout.groups;
  std::vector<int32_t> out(static_cast<size_t>(layout.experts));
  for (int64_t e = 0; e < layout.experts; ++e) {
    out[e] = static_cast<int32_t>(group_node[e / per_group]);
  }
  return out;
}

// Whether the nodes' loads let the top rank reach `cap` at all.
bool nodes_can_reach(std::span<const double> w, std::span<const int32_t> node_of_expert,
                     const Layout& layout, double cap) {
  std::vector<double> node_load(static_cast<size_t>(layout.nodes), 0.0);
  for (int64_t e = 0; e < layout.experts; ++e) node_load[node_of_expert[e]] += w[e];
  for (const double l : node_load) {
    if (l / static_cast<double>(layout.ranks_per_node()) > cap) return false;
  }
  return true;
}

struct Candidate {
  std::vector<int32_t> slots;
  int64_t moved = 0;
};

// Steps 1-4 for one layer. `fresh` computes balanced's placement of the layer when needed.
std::vector<int32_t> place_layer(std::span<const double> w, std::span<const int32_t> prev,
                                 const std::function<std::vector<int32_t>()>& fresh_of,
                                 const Layout& layout, double tolerance, bool hierarchical) {
  double total = 0;
  for (const double v : w) total += v;
  const double mean = total / static_cast<double>(layout.ranks);
  auto cap_for = [&](double target) { return target > 0 ? mean / target : kInf; };
  const int64_t slots = static_cast<int64_t>(prev.size());
  // Step 0, past two slots per rank (where the bound is cheap and balanced within 0.1% of it):
  // the target from the lower bound instead, which is at least balanced's; reaching it with a
  // small budget needs no fresh placement at all.
  std::optional<Incremental> search;
  if (layout.slots_per_rank() > 2 && !hierarchical && total > 0) {
    const double bound_target = mean / layer_lower_bound(w, layout) - tolerance;
    search.emplace(w, prev, layout, std::span<const int32_t>{});
    if (search->run(cap_for(bound_target), slots / kFewMoved) &&
        layer_balancedness(w, search->slots(), layout) >= bound_target) {
      return {search->slots().begin(), search->slots().end()};
    }
    // Not met: Step 3 goes on from where this search stopped, against balanced's target (at
    // most the bound's: its cap is at least this one). Starting again from the previous
    // placement repeated the same actions, and was a third of the policy's time.
  }
  // Step 1.
  const std::vector<int32_t> fresh = fresh_of();
  const double target = layer_balancedness(w, fresh, layout) - tolerance;
  const double cap = cap_for(target);
  auto good = [&](std::span<const int32_t> placed) {
    return layer_balancedness(w, placed, layout) >= target;
  };

  // Step 3, groups on the nodes that hold most of their slots now; a small budget first.
  const std::vector<int32_t> kept_nodes =
      hierarchical ? expert_nodes(groups_to_nodes(prev, layout), layout) : std::vector<int32_t>{};
  const bool reachable = !hierarchical || nodes_can_reach(w, kept_nodes, layout, cap);
  if (reachable) {
    if (!search) search.emplace(w, prev, layout, kept_nodes);
    if (search->run(cap, slots / kFewMoved) && good(search->slots())) {
      return {search->slots().begin(), search->slots().end()};
    }
  }

  // Two slots per rank: the previous pairs moved to balanced's counts (two_slots.h), which
  // keeps far more than relabelling balanced's pairs.
  Candidate best{{}, slots + 1};  // none yet
  auto consider = [&](Incremental& s, int64_t budget) {
    if (s.run(cap, std::min(budget, best.moved - 1)) && s.moved() < best.moved &&
        good(s.slots())) {
      best = {std::vector<int32_t>(s.slots().begin(), s.slots().end()), s.moved()};
    }
  };
  if (layout.slots_per_rank() == 2 && !hierarchical) {
    std::vector<int32_t> counts(static_cast<size_t>(layout.experts), 0);
    for (const int32_t e : fresh) ++counts[e];
    std::vector<int32_t> repaired(prev.size());
    if (two_slots::repair(w, prev, counts, layout.ranks, cap, repaired) && good(repaired)) {
      const int64_t moved = count_moved(prev, repaired);
      best = {std::move(repaired), moved};
    }
  }
  // Step 3 goes on, first within kFewMovedFresh: what it reaches there is kept.
  if (search && !hierarchical) {
    consider(*search, slots / kFewMovedFresh);
    if (best.moved <= slots / kFewMovedFresh) return best.slots;
  }
  // Step 2. It has balanced's balancedness (its ranks are balanced's, relabelled), so it is
  // taken when nothing cheaper reaches the target.
  std::vector<int32_t> relabelled = relabel(fresh, prev, layout, hierarchical);
  const std::vector<int32_t> fresh_nodes =
      hierarchical ? expert_nodes(groups_to_nodes(relabelled, layout), layout)
                   : std::vector<int32_t>{};
  const int64_t relabelled_moved = count_moved(prev, relabelled);
  if (relabelled_moved < best.moved) best = {std::move(relabelled), relabelled_moved};
  // Step 3 goes on with the budget the fallback leaves.
  if (search) consider(*search, slots);
  // In hierarchical mode, also with the groups on balanced's nodes (relabelled).
  if (hierarchical) {
    if (fresh_nodes != kept_nodes && nodes_can_reach(w, fresh_nodes, layout, cap)) {
      Incremental again(w, prev, layout, fresh_nodes);
      consider(again, slots);
    }
  }
  // Step 4.
  return best.slots;
}

}  // namespace

Placement sticky(const LoadMatrix& load, const Layout& layout, const Placement& previous,
                 double tolerance, bool hierarchical) {
  if (!(tolerance >= 0 && tolerance < 1)) {
    fail("tolerance ", tolerance, " must be in [0, 1) (a loss of balancedness)");
  }
  if (previous.layers != load.layers || previous.experts != layout.experts ||
      previous.physical != layout.physical) {
    fail("the previous placement has ", previous.layers, " layers, ", previous.experts,
         " experts, ", previous.physical, " physical slots; the new one needs ", load.layers,
         ", ", layout.experts, ", ", layout.physical);
  }
  // Only phy2log is read; an expert may have no slot in it (live ranks, policy.h): it gets one.
  EPLB_CHECK_EQ(previous.phy2log.size(), static_cast<size_t>(previous.layers * previous.physical),
                "the previous placement's phy2log is not [layers][physical]");
  for (size_t i = 0; i < previous.phy2log.size(); ++i) {
    if (previous.phy2log[i] < 0 || previous.phy2log[i] >= previous.experts) {
      fail("the previous placement's slot ", i % previous.physical, " of layer ",
           i / previous.physical, " holds expert ", previous.phy2log[i], ", outside [0, ",
           previous.experts, ")");
    }
  }
  check_balanced_inputs(load, layout, hierarchical);
  Placement out(load.layers, layout.experts, layout.physical);
  for (int64_t l = 0; l < load.layers; ++l) {
    // balanced's placement of this one layer, only when Step 0 does not suffice.
    auto fresh_of = [&] {
      LoadMatrix one(1, load.experts);
      std::copy_n(load.row(l).begin(), load.experts, one.row(0).begin());
      const Placement fresh = balanced(one, layout, hierarchical);
      return std::vector<int32_t>(fresh.layer_phy2log(0).begin(), fresh.layer_phy2log(0).end());
    };
    const std::vector<int32_t> slots = place_layer(load.row(l), previous.layer_phy2log(l),
                                                   fresh_of, layout, tolerance, hierarchical);
    std::copy(slots.begin(), slots.end(), out.layer_phy2log(l).begin());
  }
  out.derive_from_phy2log();
  return out;
}

}  // namespace eplb::placement
