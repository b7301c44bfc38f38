// Two slots per rank: the placement (replica counts searched with their sorted pairing; the
// lower bound is two_slots_bound.cc's). two_slots.h says why; the steps:
//   place: 1. counts minimising the largest replica (each extra replica to the largest w/r);
//          2. the sorted pairing of the replicas, and its largest pair;
//          3. move one replica from a donor (an expert with 2+) to one of the two experts of
//             the largest pair, the move that lowers the largest pair most, while one does;
//          3c. where replicas are scarce, two such moves in a row where no single one helps
//             (the second from the largest pair the first leaves), then step 3 again;
//          3b. thorough only: counts built level by level (level_sweep.h) for a bisection on
//             the largest pair, step 3 from there, and the better of that and step 3 alone;
//          4. ranks are the pairs; a pair holding one expert twice trades its light replica
//             with another pair.

#include "placement/two_slots.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "placement/level_sweep.h"
#include "placement/replicas.h"
#include "placement/slots_by_expert.h"
#include "placement/sort_keys.h"

namespace eplb::placement::two_slots {
namespace {

// Relative margin a move must lower the largest pair by (keeps the search off rounding noise).
constexpr double kMinGain = 1e-12;
// Donors tried per receiver: those whose replicas stay lightest after giving one up.
constexpr size_t kDonors = 8;
// Step 3c: two moves at a time, at most this many times per layer, from the first moves whose
// own largest pair is lowest (at most this many of step 3's).
constexpr int kLeaps = 16;
constexpr size_t kLeapFirsts = 8;
// ... and at most this much (relative) above the largest pair before them: a first move that
// raises it more is not brought back by one more (on the real loads, 2% loses nothing).
constexpr double kLeapRise = 0.02;
// ... only where the extra replicas (2 * ranks - experts) are at most the experts over this.
constexpr int64_t kLeapsUpTo = 2;
constexpr double kInf = std::numeric_limits<double>::infinity();
// The bisection stops when the range is this narrow (relative).
constexpr double kPrecision = 1e-5;
// Pairs top_of_replicas visits from one end before it turns to the other.
constexpr int64_t kPairRun = 16;
// Step 3b: its first T lies this far (relative) below the greedy counts' top; at most this many
// sweeps.
constexpr double kSweepFirst = 1e-3;
constexpr int kSweeps = 14;

// The experts ordered by load per replica, heaviest first (lowest index on a tie), and the
// sorted pairing of their replicas.
struct Pairing {
  std::vector<int32_t> order;  // [experts]
  double top = 0;              // largest pair
  int32_t top_heavy = -1, top_light = -1;  // its two experts
};

// `share` [experts] is w / r under the current counts.
bool heavier(std::span<const double> share, int32_t a, int32_t b) {
  return share[a] > share[b] || (share[a] == share[b] && a < b);
}

// The largest pair of the sorted pairing of `order` (heaviest first) with counts r: the k-th
// heaviest replica with the k-th lightest. Sets top and its experts; stops early once a pair
// reaches `limit` (top is then at least that).
// `share` [experts] is w / r, divided by the caller once per change of r: the pairing reads it
// twice per rank, and the division was most of the count search's time.
void pair_up(std::span<const double> share, std::span<const int32_t> r, int64_t ranks, Pairing& p,
             double limit = std::numeric_limits<double>::infinity()) {
  size_t i = 0, j = p.order.size() - 1;
  int32_t left_i = r[p.order[i]], left_j = r[p.order[j]];
  p.top = -1;
  for (int64_t k = 0; k < ranks; ++k) {
    const int32_t a = p.order[i], b = p.order[j];
    const double sum = share[a] + share[b];
    if (sum > p.top) {
      p.top = sum;
      p.top_heavy = a;
      p.top_light = b;
      if (sum >= limit) return;
    }
    if (--left_i == 0 && i + 1 < p.order.size()) left_i = r[p.order[++i]];
    if (--left_j == 0 && j > 0) left_j = r[p.order[--j]];
  }
}

// The largest pair of a pairing given as its replicas' shares in order, heaviest first
// (`replicas` [2 ranks]: pair k is replicas k and 2 ranks - 1 - k), or a pair at least `limit`
// (then it stops). Pairs are visited a run at a time from both ends of k in turn: a trial that
// does not lower the largest pair usually has a pair at the limit near its old place, which at
// 144 ranks of lognormal loads is among the first pairs and at 256 ranks among the last. Four
// maxima side by side keep the adds off one chain; the maximum of the same values in any order
// is the same, so the result does not depend on the order of the visit.
double top_of_replicas(std::span<const double> replicas, int64_t ranks, double limit) {
  const double* s = replicas.data();
  const int64_t last = 2 * ranks - 1;
  double top = -1;
  auto visit = [&](int64_t begin, int64_t end) {
    double m[4] = {top, top, top, top};
    int64_t k = begin;
    for (; k + 4 <= end; k += 4) {
      for (int i = 0; i < 4; ++i) m[i] = std::max(m[i], s[k + i] + s[last - k - i]);
    }
    for (; k < end; ++k) m[0] = std::max(m[0], s[k] + s[last - k]);
    top = std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
  };
  int64_t lo = 0, hi = ranks;  // pairs [lo, hi) are still to visit
  while (lo < hi) {
    const int64_t front = std::min(hi, lo + kPairRun);
    visit(lo, front);
    lo = front;
    if (top >= limit) return top;
    const int64_t back = std::max(lo, hi - kPairRun);
    visit(back, hi);
    hi = back;
    if (top >= limit) return top;
  }
  return top;
}

// p's largest pair and its experts (the first on a tie, as pair_up finds it), read off its
// replicas' shares in order (`replicas` [2 ranks]), where `before` [experts + 1] holds the
// replicas ahead of each position of p.order: walking the pairs through the order was a
// seventh of balanced's time at 256 ranks.
void largest_pair(std::span<const double> replicas, std::span<const int64_t> before,
                  int64_t ranks, Pairing& p) {
  const int64_t last = 2 * ranks - 1;
  int64_t top_k = 0;
  p.top = -1;
  for (int64_t k = 0; k < ranks; ++k) {
    const double sum = replicas[k] + replicas[last - k];
    if (sum > p.top) {
      p.top = sum;
      top_k = k;
    }
  }
  auto expert_of = [&](int64_t replica) {
    const auto it = std::upper_bound(before.begin(), before.end(), replica);
    return p.order[static_cast<size_t>(it - before.begin()) - 1];
  };
  p.top_heavy = expert_of(top_k);
  p.top_light = expert_of(last - top_k);
}

// std::lower_bound's steps over positions [0, n) of a sequence read through `at` (the same
// probes, so the same answer on a sequence that is not quite sorted): the first position whose
// element `before` does not put ahead of its own.
template <class At, class Before>
size_t lower_bound_of(size_t n, const At& at, const Before& before) {
  size_t first = 0, len = n;
  while (len > 0) {
    const size_t half = len >> 1;
    if (before(at(first + half))) {
      first += half + 1;
      len -= half + 1;
    } else {
      len = half;
    }
  }
  return first;
}

// `order` with experts a (at position a_at) and b (at b_at) moved to their places under the
// shares w / r of the current counts (the rest still sorted); returns their new positions. The
// shares are divided once per change of a count, not at every comparison; the positions come
// from the caller, who has them, instead of a scan.
std::pair<size_t, size_t> reorder(std::span<const double> share, std::vector<int32_t>& order,
                                  int32_t a, size_t a_at, int32_t b, size_t b_at) {
  // Both leave before either comes back: the rest must be sorted for the binary search.
  order.erase(order.begin() + static_cast<int64_t>(std::max(a_at, b_at)));
  order.erase(order.begin() + static_cast<int64_t>(std::min(a_at, b_at)));
  auto place = [&](int32_t x) {
    const auto at = std::lower_bound(order.begin(), order.end(), x, [&](int32_t u, int32_t v) {
      return heavier(share, u, v);
    });
    const size_t i = static_cast<size_t>(at - order.begin());
    order.insert(at, x);
    return i;
  };
  const size_t a_new = place(a);
  const size_t b_new = place(b);
  return {a_new + (b_new <= a_new ? 1 : 0), b_new};
}

// Steps 1-2 from counts r: the experts in order, and their pairing's largest pair.
Pairing sorted_pairing(std::span<const double> w, std::span<const int32_t> r, int64_t ranks) {
  Pairing p;
  std::vector<double> share(w.size());
  std::vector<SortKey> keys(w.size()), scratch;
  for (size_t e = 0; e < w.size(); ++e) {
    share[e] = w[e] / r[e];
    keys[e] = descending_key(share[e], static_cast<int64_t>(e));
  }
  sort_keys(keys, scratch);  // a comparison sort mispredicted half its compares here
  p.order.resize(w.size());
  for (size_t i = 0; i < keys.size(); ++i) p.order[i] = static_cast<int32_t>(key_index(keys[i]));
  pair_up(share, r, ranks, p);
  return p;
}

// Steps 3 and 3c. A trial moves one replica from a donor to one of the two experts of the
// largest pair; its pairing is read off the round's replicas in order: the two experts leave
// their places and come back at the places reorder() would give them (found by the same binary
// searches, on the round's order read around the two), and the runs between are copied as they
// are. Copying the order and moving the two in it was a third of the count search's time at 256
// ranks, and walking the pairs through the order a third more.
//
// Owns nothing: r and p are the caller's, kept current move by move.
class CountSearch {
 public:
  CountSearch(std::span<const double> w, int64_t ranks, std::vector<int32_t>& r, Pairing& p)
      : w_(w), ranks_(ranks), r_(r), p_(p), share_(w.size()), after_giving_(w.size()),
        at_(w.size()), before_(w.size() + 1), round_replicas_(static_cast<size_t>(2 * ranks)),
        trial_replicas_(static_cast<size_t>(2 * ranks)) {
    for (int32_t e = 0; e < static_cast<int32_t>(w.size()); ++e) update(e);
  }

  // Step 3: the best single move while one lowers the largest pair (p's largest pair is
  // current when called).
  void descend() {
    const int64_t experts = static_cast<int64_t>(w_.size());
    for (int64_t round = 0; round < 4 * experts; ++round) {
      // The first round's largest pair is the caller's.
      begin_round(round > 0);
      double best = p_.top - kMinGain * p_.top;
      int32_t best_to = -1, best_from = -1;
      select_donors(donors_);
      each_move(donors_, [&](int32_t to, int32_t from) {
        const double top = trial(to, from, best);
        if (top < best) {
          best = top;
          best_to = to;
          best_from = from;
        }
      });
      if (best_to < 0) return;
      apply(best_to, best_from);
    }
    pair_up(share_, r_, ranks_, p_);  // the round limit was reached: the last move's pairing
  }

  // Step 3c: where no single move lowers the largest pair, the best two moves in a row (the
  // second from the largest pair the first leaves), each as step 3 would try it; applied when
  // they lower it, and true then: a replica taken from one heavy expert and given to another,
  // say, then the pair that leaves settled.
  bool leap() {
    begin_round(true);
    const double start = p_.top;
    double best = start - kMinGain * start;
    int32_t to1 = -1, from1 = -1, to2 = -1, from2 = -1;
    // The first moves, those whose own largest pair is lowest first (ties: as step 3 orders).
    std::vector<int32_t> first_donors;
    select_donors(first_donors);
    firsts_.clear();
    each_move(first_donors, [&](int32_t to, int32_t from) {
      firsts_.push_back({trial(to, from, kInf), to, from});
    });
    std::stable_sort(firsts_.begin(), firsts_.end(),
                     [](const First& a, const First& b) { return a.top < b.top; });
    if (firsts_.size() > kLeapFirsts) firsts_.resize(kLeapFirsts);
    while (!firsts_.empty() && firsts_.back().top > start * (1 + kLeapRise)) firsts_.pop_back();
    // The round's state (p with its order, and begin_round's), restored after each first move
    // instead of rebuilt.
    saved_at_ = at_;
    saved_before_ = before_;
    saved_replicas_ = round_replicas_;
    const Pairing saved_pair = p_;
    for (const First& f : firsts_) {
      apply(f.to, f.from);
      begin_round(true);
      if (p_.top < best) {  // not at step 3's end, but cheap to take
        best = p_.top;
        to1 = f.to, from1 = f.from, to2 = -1, from2 = -1;
      }
      select_donors(donors_);
      each_move(donors_, [&](int32_t to_next, int32_t from_next) {
        const double top = trial(to_next, from_next, best);
        if (top < best) {
          best = top;
          to1 = f.to, from1 = f.from, to2 = to_next, from2 = from_next;
        }
      });
      // Back to the round's state.
      --r_[f.to];
      ++r_[f.from];
      update(f.to);
      update(f.from);
      p_ = saved_pair;
      at_ = saved_at_;
      before_ = saved_before_;
      round_replicas_ = saved_replicas_;
    }
    if (to1 < 0) return false;
    apply(to1, from1);
    begin_round(true);
    if (to2 >= 0) {
      apply(to2, from2);
      begin_round(true);
    }
    return true;
  }

 private:
  // Calls f(to, from) for every move step 3 tries from p's largest pair: a replica to one of
  // its two experts (below one per rank) from each of `donors` but that expert.
  template <class F>
  void each_move(std::span<const int32_t> donors, const F& f) {
    for (const int32_t to : {p_.top_heavy, p_.top_light}) {
      if (r_[to] >= ranks_) continue;
      for (const int32_t from : donors) {
        if (from != to) f(to, from);
      }
      if (p_.top_light == p_.top_heavy) break;
    }
  }

  void update(int32_t e) {
    share_[e] = w_[e] / r_[e];
    if (r_[e] >= 2) after_giving_[e] = w_[e] / (r_[e] - 1);
  }

  // Of p.order under the current counts: each expert's position, the replicas before each
  // position, the replicas' shares in order; with `pair`, p's largest pair from them.
  void begin_round(bool pair) {
    const size_t n = p_.order.size();
    for (size_t i = 0; i < n; ++i) {
      at_[p_.order[i]] = i;
      before_[i + 1] = before_[i] + r_[p_.order[i]];
      std::fill_n(round_replicas_.begin() + before_[i], r_[p_.order[i]], share_[p_.order[i]]);
    }
    if (pair) largest_pair(round_replicas_, std::span(before_).first(n + 1), ranks_, p_);
  }

  // The donors whose replicas stay lightest after giving one up (at most kDonors, ascending).
  void select_donors(std::vector<int32_t>& donors) const {
    donors.clear();
    for (int32_t d = 0; d < static_cast<int32_t>(w_.size()); ++d) {
      if (r_[d] >= 2) donors.push_back(d);
    }
    auto after = [&](int32_t d) { return after_giving_[d]; };
    if (donors.size() > kDonors) {
      std::nth_element(donors.begin(), donors.begin() + kDonors, donors.end(),
                       [&](int32_t a, int32_t b) {
                         return after(a) < after(b) || (after(a) == after(b) && a < b);
                       });
      donors.resize(kDonors);
      std::sort(donors.begin(), donors.end());
    }
  }

  // The largest pair after one replica moves from `from` to `to`, or a pair at least `limit`;
  // the counts are as before on return.
  double trial(int32_t to, int32_t from, double limit) {
    const size_t n = p_.order.size();
    ++r_[to];
    --r_[from];
    update(to);
    update(from);
    // The round's order without the two (their old places low < high)...
    const size_t low = std::min(at_[to], at_[from]), high = std::max(at_[to], at_[from]);
    auto rest = [&](size_t i) {
      size_t j = i;
      if (j >= low) ++j;
      if (j >= high) ++j;
      return p_.order[j];
    };
    // ...with `to` back at to_rest, then `from` at from_at (reorder's steps).
    const size_t to_rest =
        lower_bound_of(n - 2, rest, [&](int32_t u) { return heavier(share_, u, to); });
    const size_t from_at = lower_bound_of(
        n - 1, [&](size_t i) { return i == to_rest ? to : rest(i - (i > to_rest ? 1 : 0)); },
        [&](int32_t u) { return heavier(share_, u, from); });
    const size_t to_at = to_rest + (from_at <= to_rest ? 1 : 0);
    // The trial's replicas: the runs of the round's between the two places, copied.
    double* out = trial_replicas_.data();
    size_t next = 0;  // the round's position the next run starts at
    auto copy_rest = [&](size_t count) {
      while (count > 0) {
        if (next == low || next == high) {
          ++next;
          continue;
        }
        const size_t stop = next < low ? low : next < high ? high : n;
        const size_t m = std::min(count, stop - next);
        out = std::copy(round_replicas_.begin() + before_[next],
                        round_replicas_.begin() + before_[next + m], out);
        next += m;
        count -= m;
      }
    };
    const bool to_first = to_at < from_at;
    const size_t first_at = to_first ? to_at : from_at, second_at = to_first ? from_at : to_at;
    const int32_t first = to_first ? to : from, second = to_first ? from : to;
    copy_rest(first_at);
    out = std::fill_n(out, r_[first], share_[first]);
    copy_rest(second_at - first_at - 1);
    out = std::fill_n(out, r_[second], share_[second]);
    copy_rest(n - second_at - 1);
    const double top = top_of_replicas(trial_replicas_, ranks_, limit);
    --r_[to];
    ++r_[from];
    update(to);
    update(from);
    return top;
  }

  // Commits a move: the counts, the shares and p.order (at_ must be the round's).
  void apply(int32_t to, int32_t from) {
    ++r_[to];
    --r_[from];
    update(to);
    update(from);
    reorder(share_, p_.order, to, at_[to], from, at_[from]);
  }

  std::span<const double> w_;
  int64_t ranks_;
  std::vector<int32_t>& r_;
  Pairing& p_;
  std::vector<double> share_;  // w / r, kept current with r
  // w / (r - 1), a donor's share after giving a replica up (r >= 2), kept current too: the
  // donors' selection compares it, and is not to divide in every comparison.
  std::vector<double> after_giving_;
  // Per round, of p.order under the round's counts: each expert's position, the replicas
  // before each position, and the replicas' shares in order; per trial, its replicas' shares.
  std::vector<size_t> at_;
  std::vector<int64_t> before_;
  std::vector<double> round_replicas_, trial_replicas_;
  std::vector<int32_t> donors_;
  // Step 3c: the first moves, and the round's state it restores after each.
  struct First {
    double top;
    int32_t to, from;
  };
  std::vector<First> firsts_;
  std::vector<size_t> saved_at_;
  std::vector<int64_t> saved_before_;
  std::vector<double> saved_replicas_;
};

// Steps 3 and 3c from counts r and their pairing p: single moves to a local optimum, then, with
// `leaps`, two at a time (at most kLeaps times), single moves again after each.
void search_counts(std::span<const double> w, int64_t ranks, std::vector<int32_t>& r,
                   Pairing& p, bool leaps) {
  CountSearch search(w, ranks, r, p);
  search.descend();
  if (!leaps) return;
  for (int i = 0; i < kLeaps && search.leap(); ++i) search.descend();
}

// Step 4: the pairs, [ranks][2]; a pair of one expert twice trades its light replica with the
// pair where the trade raises the larger of the two new pairs least.
std::vector<int32_t> make_pairs(std::span<const double> w, std::span<const int32_t> r,
                                int64_t ranks, const Pairing& p, bool& traded) {
  traded = false;
  std::vector<int32_t> heavy(static_cast<size_t>(ranks)), light(static_cast<size_t>(ranks));
  size_t i = 0, j = p.order.size() - 1;
  int32_t left_i = r[p.order[i]], left_j = r[p.order[j]];
  for (int64_t k = 0; k < ranks; ++k) {
    heavy[k] = p.order[i];
    light[k] = p.order[j];
    if (--left_i == 0 && i + 1 < p.order.size()) left_i = r[p.order[++i]];
    if (--left_j == 0 && j > 0) left_j = r[p.order[--j]];
  }
  auto share = [&](int32_t e) { return w[e] / r[e]; };
  for (int64_t k = 0; k < ranks; ++k) {
    if (heavy[k] != light[k]) continue;
    const int32_t x = heavy[k];
    int64_t best = -1;
    double best_peak = 0;
    for (int64_t q = 0; q < ranks; ++q) {
      if (q == k || heavy[q] == x || light[q] == x) continue;
      const double peak =
          std::max(share(x) + share(light[q]), share(heavy[q]) + share(x));
      if (best < 0 || peak < best_peak) {
        best = q;
        best_peak = peak;
      }
    }
    EPLB_CHECK(best >= 0, "no pair can take a replica of expert ", x);
    std::swap(light[k], light[best]);
    traded = true;
  }
  std::vector<int32_t> out(static_cast<size_t>(2 * ranks));
  for (int64_t k = 0; k < ranks; ++k) {
    out[2 * k] = std::min(heavy[k], light[k]);
    out[2 * k + 1] = std::max(heavy[k], light[k]);
  }
  return out;
}

double largest_rank(std::span<const double> w, std::span<const int32_t> r,
                    std::span<const int32_t> slots) {
  double most = 0;
  for (size_t k = 0; k + 1 < slots.size(); k += 2) {
    most = std::max(most, w[slots[k]] / r[slots[k]] + w[slots[k + 1]] / r[slots[k + 1]]);
  }
  return most;
}

// Step 3b: below the largest pair `p.top` of counts r, bisection on T (down to the mean rank
// load) for counts the level sweep (level_sweep.h) builds; r and p become the best found, and
// true says some were. Tried first just under the top: where even that fails, nothing more is
// spent.
bool sweep_counts(std::span<const double> w, int64_t ranks, std::vector<int32_t>& r,
                  Pairing& p) {
  bool found = false;
  double total = 0;
  for (const double v : w) total += v;
  double lo = total / static_cast<double>(ranks);
  LevelSweep sweep;
  std::vector<int32_t> trial;
  double T = p.top * (1 - kSweepFirst);
  for (int i = 0; i < kSweeps && T > lo; ++i) {
    if (sweep.run(w, ranks, T, trial)) {
      Pairing q = sorted_pairing(w, trial, ranks);
      if (q.top < p.top) {
        r = trial;
        p = std::move(q);
        found = true;
      }
    } else {
      lo = T;
      if (i == 0) return found;
    }
    if (p.top - lo <= kPrecision * p.top) return found;
    T = 0.5 * (lo + std::min(T, p.top));
  }
  return found;
}

}  // namespace

double place(std::span<const double> w, int64_t ranks, std::span<int32_t> phy2log,
             bool& traded, std::vector<int32_t>& greedy, double& greedy_top, bool sweep) {
  const int64_t experts = static_cast<int64_t>(w.size());
  EPLB_CHECK(experts >= 2 && experts <= 2 * ranks && phy2log.size() == static_cast<size_t>(2 * ranks),
             "two slots per rank: ", experts, " experts, ", ranks, " ranks, ", phy2log.size(),
             " slots");
  // Step 3c where replicas are scarce (two_slots.h).
  const bool leaps = 2 * ranks - experts <= experts / kLeapsUpTo;
  greedy = greedy_replica_counts(w, 2 * ranks, ranks);
  std::vector<int32_t> r = greedy;
  Pairing p = sorted_pairing(w, r, ranks);
  greedy_top = p.top;
  if (sweep) {
    // Step 3b from the greedy counts, step 3 after it; the better of that and step 3 alone (so
    // never worse than without the sweep).
    std::vector<int32_t> swept = r;
    Pairing q = p;
    if (sweep_counts(w, ranks, swept, q)) {
      search_counts(w, ranks, swept, q, leaps);
    } else {
      swept.clear();
    }
    search_counts(w, ranks, r, p, leaps);
    if (!swept.empty() && q.top < p.top) {
      r = std::move(swept);
      p = std::move(q);
    }
  } else {
    search_counts(w, ranks, r, p, leaps);
  }
  const std::vector<int32_t> slots = make_pairs(w, r, ranks, p, traded);
  std::copy(slots.begin(), slots.end(), phy2log.begin());
  return largest_rank(w, r, slots);
}

double pairing_top(std::span<const double> w, std::span<const int32_t> counts, int64_t ranks) {
  EPLB_CHECK(counts.size() == w.size() && !w.empty() &&
                 std::accumulate(counts.begin(), counts.end(), int64_t{0}) == 2 * ranks,
             "two_slots::pairing_top: ", w.size(), " experts, ", counts.size(), " counts, ",
             ranks, " ranks");
  return sorted_pairing(w, counts, ranks).top;
}

bool repair(std::span<const double> w, std::span<const int32_t> prev,
            std::span<const int32_t> counts, int64_t ranks, double cap, std::span<int32_t> out) {
  const int64_t experts = static_cast<int64_t>(w.size());
  const int64_t slots = 2 * ranks;
  EPLB_CHECK(static_cast<int64_t>(prev.size()) == slots && out.size() == prev.size() &&
                 static_cast<int64_t>(counts.size()) == experts,
             "two_slots::repair: shapes");
  int64_t total = 0;
  for (const int32_t c : counts) {
    EPLB_CHECK(c >= 1 && c <= ranks, "two_slots::repair: a count of ", c, " with ", ranks,
               " ranks");
    total += c;
  }
  EPLB_CHECK(total == slots, "two_slots::repair: counts sum to ", total, ", not ", slots);
  for (const int32_t e : prev) {
    EPLB_CHECK(e >= 0 && e < experts, "two_slots::repair: previous expert ", e);
  }
  // Each expert's load per replica, divided once: the trades below read it for every slot.
  std::vector<double> shares(static_cast<size_t>(experts));
  for (int32_t e = 0; e < experts; ++e) shares[e] = w[e] / counts[e];
  auto share = [&](int32_t e) { return shares[e]; };
  auto mate = [](int64_t p) { return p ^ 1; };
  std::copy(prev.begin(), prev.end(), out.begin());
  // The previous load of each rank under the new shares, to free the slots of the most loaded.
  std::vector<double> old_load(static_cast<size_t>(ranks), 0.0);
  for (int64_t p = 0; p < slots; ++p) old_load[p / 2] += share(prev[p]);
  // A rank holding one expert twice (deepseek's placements may) keeps only the first. The
  // slots each expert still holds, in slot order: held[start[e], start[e + 1]).
  std::vector<char> free_slot(static_cast<size_t>(slots), 0);
  for (int64_t p = 1; p < slots; p += 2) {
    if (prev[p] == prev[p - 1]) {
      free_slot[p] = 1;
      out[p] = -1;
    }
  }
  std::vector<int64_t> start, held;
  slots_by_expert(out, experts, start, held);
  std::vector<std::pair<double, int32_t>> incoming;  // (-share, expert), one per new replica
  for (int32_t e = 0; e < experts; ++e) {
    const auto first = held.begin() + start[e], last = held.begin() + start[e + 1];
    const int64_t extra = (last - first) - counts[e];
    if (extra > 0) {
      std::sort(first, last, [&](int64_t a, int64_t b) {
        return old_load[a / 2] > old_load[b / 2] || (old_load[a / 2] == old_load[b / 2] && a < b);
      });
      for (int64_t k = 0; k < extra; ++k) {
        free_slot[first[k]] = 1;
        out[first[k]] = -1;
      }
    }
    for (int64_t k = extra; k < 0; ++k) incoming.emplace_back(-share(e), e);
  }
  std::sort(incoming.begin(), incoming.end());
  // The new replicas, heaviest first, beside the lightest partner that is not the same expert
  // (the lowest slot among equals): the free slots in a min-heap by (partner's load, slot). A
  // slot whose partner is free too enters at 0 and again at its partner's share once that is
  // filled; an entry whose key is no longer its partner's load is stale and dropped.
  auto load_of = [&](int64_t p) { return out[p] < 0 ? 0.0 : share(out[p]); };
  using Entry = std::pair<double, int64_t>;
  std::vector<Entry> heap;
  for (int64_t p = 0; p < slots; ++p) {
    if (free_slot[p]) heap.emplace_back(load_of(mate(p)), p);
  }
  std::make_heap(heap.begin(), heap.end(), std::greater<>());
  std::vector<Entry> aside;  // free slots beside the same expert, back in after each placement
  for (const auto& [unused, e] : incoming) {
    int64_t best = -1;
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const Entry top = heap.back();
      heap.pop_back();
      const int64_t p = top.second;
      if (out[p] >= 0 || top.first != load_of(mate(p))) continue;  // filled or stale
      if (out[mate(p)] == e) {
        aside.push_back(top);
        continue;
      }
      best = p;
      break;
    }
    if (best < 0) {
      // Every free slot left lies beside e (an expert on nearly every rank): e takes the slot
      // q of a rank without it whose two replicas are lightest at their heavier one, and q's
      // expert moves into the free slot, one slot more moved than the counts need.
      if (aside.empty()) return false;
      int64_t q = -1;
      double q_peak = 0;
      for (int64_t s = 0; s < slots; ++s) {
        if (out[s] < 0 || out[s] == e || out[mate(s)] == e) continue;
        const double peak = std::max(share(out[s]), load_of(mate(s)));
        if (q < 0 || peak < q_peak) {
          q = s;
          q_peak = peak;
        }
      }
      if (q < 0) return false;
      out[aside.front().second] = out[q];
      best = q;
    }
    out[best] = e;
    for (const Entry& x : aside) {
      heap.push_back(x);
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
    aside.clear();
    if (out[mate(best)] < 0) {
      heap.emplace_back(share(e), mate(best));
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  }
  // Ranks above the cap trade their lighter replica for a lighter one elsewhere.
  std::vector<double> load(static_cast<size_t>(ranks));
  for (int64_t g = 0; g < ranks; ++g) load[g] = share(out[2 * g]) + share(out[2 * g + 1]);
  // The slots by the share of their replica, ascending, exactly (the scan below stops on the
  // shares; the integer sort keys order values that agree to 40 bits by index only); a trade
  // swaps the replicas of two slots, so swapping their entries keeps the order (within equal
  // shares it does not matter: the best trade is the least peak, then the lowest slot,
  // whatever the scan order).
  // Sorted by the keys (40 bits of the share), then by insertion on the exact share for the
  // few neighbours whose shares the keys take as equal: the order of (share, slot) exactly;
  // the comparison sort of those pairs mispredicted its compares, a twentieth of sticky's time.
  std::vector<SortKey> keys(static_cast<size_t>(slots)), scratch;
  for (int64_t p = 0; p < slots; ++p) keys[p] = ascending_key(share(out[p]), p);
  sort_keys(keys, scratch);
  std::vector<int64_t> by_share(static_cast<size_t>(slots)), at(static_cast<size_t>(slots));
  std::vector<double> sorted_share(static_cast<size_t>(slots));
  for (int64_t i = 0; i < slots; ++i) {
    int64_t j = i;
    const int64_t p = key_index(keys[i]);
    const double v = share(out[p]);
    for (; j > 0 && (sorted_share[j - 1] > v || (sorted_share[j - 1] == v && by_share[j - 1] > p));
         --j) {
      sorted_share[j] = sorted_share[j - 1];
      by_share[j] = by_share[j - 1];
    }
    sorted_share[j] = v;
    by_share[j] = p;
  }
  for (int64_t i = 0; i < slots; ++i) at[by_share[i]] = i;
  for (int64_t round = 0; round < 2 * ranks; ++round) {
    const int64_t g = std::max_element(load.begin(), load.end()) - load.begin();
    if (load[g] <= cap) return true;
    const int64_t light = share(out[2 * g]) <= share(out[2 * g + 1]) ? 2 * g : 2 * g + 1;
    const int32_t x = out[mate(light)], y = out[light];
    const double sx = share(x), sy = share(y);
    int64_t best = -1;
    double best_peak = load[g];
    // A trade lowers g only for a lighter replica than y, and its peak is at least
    // sx + share(v): lighter replicas first, until that is above the best peak.
    for (int64_t i = 0; i < slots && sorted_share[i] < sy && sx + sorted_share[i] <= best_peak;
         ++i) {
      const int64_t q = by_share[i];
      const int32_t v = out[q];
      const int64_t h = q / 2;
      if (h == g) continue;
      const int32_t z = out[mate(q)];
      if (v == x || z == y || v == y) continue;
      const double peak = std::max(sx + sorted_share[i], share(z) + sy);
      if (peak < best_peak || (peak == best_peak && best >= 0 && q < best)) {
        best = q;
        best_peak = peak;
      }
    }
    if (best < 0) return false;
    std::swap(by_share[at[light]], by_share[at[best]]);
    std::swap(at[light], at[best]);
    std::swap(out[light], out[best]);
    load[g] = share(out[2 * g]) + share(out[2 * g + 1]);
    load[best / 2] = share(out[best & ~int64_t{1}]) + share(out[best | 1]);
  }
  return *std::max_element(load.begin(), load.end()) <= cap;
}

}  // namespace eplb::placement::two_slots
