// Two slots per rank: the lower bound on the largest rank load (two_slots.h says what it
// claims). Bisection on T, in two stages:
//   1. one level at a time: T is out of reach when, at some level y (the heights of the
//      heaviest replicas), even the cheapest choice of counts in the Lagrangian of "replicas y
//      above T/2 <= replicas y below it" needs more than 2 * ranks slots. Cheap, and on
//      lognormal loads within 0.3% of balanced.
//   2. every level at once, from stage 1's bound up: one multiplier per level, raised by
//      subgradient steps until the Lagrangian needs more than 2 * ranks slots (T out of
//      reach) or the counts it picks are themselves pairable (T within reach of the
//      relaxation: no multipliers can show otherwise). On DeepSeek-V3's real loads, where
//      several levels bind together, stage 1 sat 0.02 above balanced and an exact integer
//      program (scripts/two-slots-exact.py) 0.0025; stage 2 reaches what the linear
//      relaxation of that program reaches.
// Both stages claim only what they prove: a T is out of reach only on a Lagrangian value above
// the slots, and any multipliers give a valid one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "placement/replicas.h"
#include "placement/two_slots.h"

namespace eplb::placement::two_slots {
namespace {

// Stage 1: levels tested per T (the heights of the heaviest replicas: where pairing binds).
constexpr size_t kLevels = 12;
constexpr int kBisections = 30;
constexpr int kLambdaSteps = 24;
// Stage 1 stops when the range is this narrow (relative).
constexpr double kPrecision = 1e-5;
// Stage 2: its precision (relative), bisections, and subgradient steps per T.
constexpr double kAllLevelsPrecision = 1e-4;
constexpr int kAllLevelsBisections = 16;
constexpr int kAscentSteps = 2000;
// Every this many steps, the ascent gives up when the value's rise over the last stretch, kept up
// to the last step, would not reach the slots (the rise only slows).
constexpr int kStretch = 50;
// A Lagrangian value must pass the slots by this much (relative) to count: rounding.
constexpr double kMargin = 1e-9;

// Stage 1's test of one T: true when no counts can reach it. It holds for any placement, two
// replicas of an expert on one rank included (deepseek's may), so no count is capped.
bool out_of_reach(std::span<const double> w, int64_t ranks, double T) {
  const int64_t slots = 2 * ranks;
  const double half = T / 2;
  std::vector<double> least(w.size());  // fewest replicas with none above T, as doubles
  double needed = 0;
  std::vector<double> heights;
  for (size_t e = 0; e < w.size(); ++e) {
    least[e] = std::max(1.0, std::ceil(w[e] / T));
    needed += least[e];
    const double h = w[e] / least[e] - half;
    if (h > 0) heights.push_back(h);
  }
  if (needed > static_cast<double>(slots)) return true;
  std::sort(heights.begin(), heights.end(), std::greater<>());
  heights.erase(std::unique(heights.begin(), heights.end()), heights.end());
  if (heights.size() > kLevels) heights.resize(kLevels);
  // At level y every expert takes one of: the fewest replicas, heavy by y or more (m, counted
  // against the level); the fewest that are not (r_mid, neutral); the fewest at least y below
  // T/2 (r_l, counted for it). Relaxed with lambda in [0, 1]: min(m (1 + l), r_mid, r_l (1 - l)),
  // summed over experts: concave in lambda, maximised by ternary search.
  std::vector<double> m(w.size()), mid(w.size()), low(w.size());
  for (const double y : heights) {
    for (size_t e = 0; e < w.size(); ++e) {
      const double above = w[e] / (half + y);  // heavy by y or more iff r <= above
      m[e] = least[e] <= above ? least[e] : -1;
      const double r_mid = std::max(least[e], std::floor(above) + 1);
      mid[e] = w[e] / r_mid > half - y ? r_mid : -1;
      low[e] = half - y > 0 ? std::max(least[e], std::ceil(w[e] / (half - y))) : -1;
      // An expert with no load is as light as can be with one replica.
      if (w[e] == 0) low[e] = 1;
    }
    auto dual = [&](double l) {
      double total = 0;
      for (size_t e = 0; e < w.size(); ++e) {
        double c = std::numeric_limits<double>::infinity();
        if (m[e] > 0) c = m[e] * (1 + l);
        if (mid[e] > 0) c = std::min(c, mid[e]);
        if (low[e] > 0) c = std::min(c, low[e] * (1 - l));
        total += c;
      }
      return total;
    };
    // The dual is concave, so it lies under its tangents at 0 and 1: when even where those
    // meet it stays within the slots, this level shows nothing and the search is skipped.
    double f0 = 0, s0 = 0, f1 = 0, s1 = 0;
    for (size_t e = 0; e < w.size(); ++e) {
      // (value, slope) of each piece at 0 and at 1; the right slope at 0 is the least among the
      // lowest pieces, the left slope at 1 the largest.
      std::pair<double, double> at0{std::numeric_limits<double>::infinity(), 0};
      std::pair<double, double> at1{std::numeric_limits<double>::infinity(), 0};
      auto piece = [&](double value0, double slope) {
        const double value1 = value0 + slope;
        if (value0 < at0.first || (value0 == at0.first && slope < at0.second)) at0 = {value0, slope};
        if (value1 < at1.first || (value1 == at1.first && slope > at1.second)) at1 = {value1, slope};
      };
      if (m[e] > 0) piece(m[e], m[e]);
      if (mid[e] > 0) piece(mid[e], 0);
      if (low[e] > 0) piece(low[e], -low[e]);
      f0 += at0.first;
      s0 += at0.second;
      f1 += at1.first;
      s1 += at1.second;
    }
    double ceiling = std::max(f0, f1);
    if (s0 > 0 && s1 < 0) {
      const double l = (f1 - s1 - f0) / (s0 - s1);
      ceiling = f0 + s0 * std::clamp(l, 0.0, 1.0);
    }
    if (ceiling <= static_cast<double>(slots) * (1 + kMargin)) continue;
    double a = 0, b = 1, best = std::max(f0, f1);
    for (int step = 0; step < kLambdaSteps && best <= static_cast<double>(slots); ++step) {
      const double l1 = a + (b - a) / 3, l2 = b - (b - a) / 3;
      const double d1 = dual(l1), d2 = dual(l2);
      best = std::max({best, d1, d2});
      if (d1 < d2) {
        a = l1;
      } else {
        b = l2;
      }
    }
    // A margin against rounding: the bound claims only what holds with it.
    if (best > static_cast<double>(slots) * (1 + kMargin)) return true;
  }
  return false;
}

// `p` made nondecreasing and >= 0 at the least squared change (pool adjacent violators).
void monotone(std::span<double> p) {
  std::vector<std::pair<double, int64_t>> pools;  // (mean, size)
  pools.reserve(p.size());
  for (const double v : p) {
    double mean = v;
    int64_t size = 1;
    while (!pools.empty() && pools.back().first >= mean) {
      mean = (mean * size + pools.back().first * pools.back().second) /
             static_cast<double>(size + pools.back().second);
      size += pools.back().second;
      pools.pop_back();
    }
    pools.emplace_back(mean, size);
  }
  size_t j = 0;
  for (const auto& [mean, size] : pools) {
    for (int64_t i = 0; i < size; ++i) p[j++] = std::max(0.0, mean);
  }
}

// Stage 2's test of one T, every level at once. The relaxation: every expert e takes a count
// r >= least_e = max(1, ceil(w_e / T)); its replicas weigh v = w_e / r; for every level t above
// T/2 the replicas of at least t may not outnumber those of at most T - t (each needs its own
// partner that light: Hall, for these nested sets also enough), and the counts sum to at most
// 2 * ranks (more replicas of the lightest only add partners). Replicas lighter than
// spare = T - (the heaviest replica any count allows) count as light at every level, so counts
// past the first with w_e / r <= spare are one shared pool of spare replicas: the candidates
// stay few and the relaxation is unchanged. The levels that matter are the heavy candidates'
// weights (between two, the constraint at the upper is the tighter).
//
// With a multiplier mu_t >= 0 per level and M(u) the sum of those at levels <= u, a count costs
// r (1 + M(v)) when v > T/2 and r (1 - M(T - v)) otherwise, a spare 1 - M(all): each expert's
// cheapest count summed is a lower bound on the slots of any choice that meets every level.
// The multipliers move along the levels' violations (a subgradient) with Polyak's step.
// `mu_prefix_` (M) and `mu_at_` (the levels it was for) carry them from one T to the next: the
// levels are replica weights, which do not depend on T, so M carries over as a function of the
// weight.
class AllLevels {
 public:
  AllLevels(std::span<const double> w, int64_t ranks) : w_(w), slots_(2 * ranks) {}

  bool out_of_reach(double T) {
    const double slots = static_cast<double>(slots_);
    const int64_t experts = static_cast<int64_t>(w_.size());
    const double half = T / 2;
    // The fewest replicas with none above T, and the heaviest replica that leaves.
    double heaviest = 0;
    int64_t needed = 0;
    least_.resize(w_.size());
    for (size_t e = 0; e < w_.size(); ++e) {
      least_[e] = static_cast<int32_t>(std::max(1.0, std::ceil(w_[e] / T)));
      needed += least_[e];
      heaviest = std::max(heaviest, w_[e] / least_[e]);
    }
    if (needed > slots_) return true;
    const double spare = T - heaviest;
    if (spare <= 0) return false;  // a replica of exactly T: too rare to bound past stage 1
    const int64_t most = slots_ - (experts - 1);
    // Candidates, each expert's a contiguous run: its counts from least to the first whose
    // replicas are spare-light.
    first_.assign(w_.size() + 1, 0);
    cand_.clear();
    weight_.clear();
    for (size_t e = 0; e < w_.size(); ++e) {
      first_[e] = static_cast<int64_t>(cand_.size());
      int64_t top = least_[e];
      if (w_[e] > 0) {
        const double light = std::min(static_cast<double>(most), std::ceil(w_[e] / spare));
        top = std::min<int64_t>(most, std::max<int64_t>(least_[e], static_cast<int64_t>(light)));
      }
      for (int64_t r = least_[e]; r <= top; ++r) {
        cand_.push_back({static_cast<double>(r), 0, 0});
        weight_.push_back(w_[e] / static_cast<double>(r));
      }
    }
    first_[w_.size()] = static_cast<int64_t>(cand_.size());
    const size_t n = cand_.size();
    // Levels: the heavy candidates' weights, ascending, numbered from 1. A candidate's level:
    // its own when heavy (M(v) = prefix through it), else the last level <= T - v (0: none,
    // M = 0).
    levels_.clear();
    for (size_t c = 0; c < n; ++c) {
      if (weight_[c] > half) levels_.push_back(weight_[c]);
    }
    if (levels_.empty()) return false;  // nothing to pair against: stage 1 saw all of it
    std::sort(levels_.begin(), levels_.end());
    levels_.erase(std::unique(levels_.begin(), levels_.end()), levels_.end());
    const size_t L = levels_.size();
    for (size_t c = 0; c < n; ++c) {
      const bool heavy = weight_[c] > half;
      const double u = heavy ? weight_[c] : T - weight_[c];
      const auto it = std::upper_bound(levels_.begin(), levels_.end(), u);
      cand_[c].signed_count = heavy ? cand_[c].count : -cand_[c].count;
      cand_[c].level = static_cast<int32_t>(it - levels_.begin());
    }
    // M at each level (prefix_[0] = 0 stands for none): carried over from the last T.
    prefix_.assign(L + 1, 0);
    for (size_t j = 0; j < L; ++j) {
      const auto it = std::upper_bound(mu_at_.begin(), mu_at_.end(), levels_[j]);
      const size_t k = static_cast<size_t>(it - mu_at_.begin());
      prefix_[j + 1] = k == 0 ? 0 : mu_prefix_[k];
    }
    std::vector<double>& d = violation_;
    bool proven = false;
    double best_value = -std::numeric_limits<double>::infinity(), stretch_start = best_value;
    for (int step = 0; step < kAscentSteps; ++step) {
      // Each expert's cheapest count under M; d is the value's slope in each M(level).
      const double all = prefix_[L];
      const double* M = prefix_.data();
      double value = 0, chosen_slots = 0;
      d.assign(L + 1, 0);
      for (int64_t e = 0; e < experts; ++e) {
        double best = std::numeric_limits<double>::infinity();
        const Candidate* pick = &cand_[first_[e]];
        for (const Candidate* c = pick; c != cand_.data() + first_[e + 1]; ++c) {
          // Any count costs at least r (1 - M(all)), which grows with r while M(all) <= 1:
          // past the cheapest so far, the rest cost more.
          if (all <= 1 && c->count * (1 - all) >= best) break;
          const double cost = c->count + c->signed_count * M[c->level];
          if (cost < best) {
            best = cost;
            pick = c;
          }
        }
        value += best;
        chosen_slots += pick->count;
        d[pick->level] += pick->signed_count;
      }
      // Spares: as many as the slots allow when they cost less than nothing, else none.
      const double spares = all > 1 ? slots : 0;
      value += spares * (1 - all);
      d[L] -= spares;
      if (value > slots * (1 + kMargin)) {
        proven = true;
        break;
      }
      best_value = std::max(best_value, value);
      if (step % kStretch == 0) {
        if (step > 0 && best_value + (best_value - stretch_start) *
                                        (kAscentSteps - step) / kStretch <= slots) {
          break;
        }
        stretch_start = best_value;
      }
      // The counts picked meet every level (copies at or above it no more than those light
      // enough for it) within the slots: the relaxation reaches T.
      double above = 0, norm = 0, worst = -std::numeric_limits<double>::infinity();
      for (size_t j = L; j > 0; --j) {
        above += d[j];
        worst = std::max(worst, above);
        norm += d[j] * d[j];
      }
      if (worst <= 0 && chosen_slots + spares <= slots) break;
      if (norm == 0) break;
      // Polyak's step, then back to a nondecreasing M >= 0 (pool adjacent violators).
      const double size = (slots + 0.5 - value) / norm;
      for (size_t j = 1; j <= L; ++j) prefix_[j] += size * d[j];
      monotone(std::span(prefix_).subspan(1));
    }
    mu_at_ = levels_;
    mu_prefix_ = prefix_;
    return proven;
  }

 private:
  std::span<const double> w_;
  int64_t slots_;
  std::vector<int32_t> least_;
  std::vector<int64_t> first_;   // [experts + 1]: each expert's candidates
  struct Candidate {
    double count;         // r
    double signed_count;  // r when heavy (counted against its level), -r when light (for it)
    int32_t level;        // where M is read (prefix_), 0 for none
  };
  std::vector<Candidate> cand_;
  std::vector<double> weight_;                       // [candidates]: w_e / r
  std::vector<double> levels_;                       // [levels]
  std::vector<double> prefix_, violation_;           // [levels + 1]: M, and the value's slope
  std::vector<double> mu_at_, mu_prefix_;  // the last T's levels, and M at them ([levels + 1])
};

}  // namespace

double bound(std::span<const double> w, int64_t ranks) {
  const int64_t experts = static_cast<int64_t>(w.size());
  if (experts < 1 || experts > 2 * ranks) return 0;
  std::vector<int32_t> r = greedy_replica_counts(w, 2 * ranks, 2 * ranks);
  double total = 0, largest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    total += w[e];
    largest = std::max(largest, w[e] / r[e]);
  }
  double lo = std::max(total / static_cast<double>(ranks), largest);
  if (experts < 2) return lo;
  const double reachable = pairing_top(w, r, ranks);
  double hi = reachable;
  // Stage 1. lo stays out of reach (or the old bound); the bound is the last T shown out of
  // reach.
  for (int i = 0; i < kBisections && hi > lo * (1 + kPrecision); ++i) {
    const double mid = 0.5 * (lo + hi);
    if (out_of_reach(w, ranks, mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // Stage 2, from there up: steps doubling from kAllLevelsPrecision while each is shown out of
  // reach, then bisection between the last shown and the first not. A T it cannot show costs
  // the ascent's full patience and one it can a few steps (the multipliers carry over), and the
  // bound usually lies near stage 1's: so few of the first kind.
  hi = reachable;
  AllLevels all(w, ranks);
  for (double step = kAllLevelsPrecision; lo * (1 + step) < hi; step *= 2) {
    if (!all.out_of_reach(lo * (1 + step))) {
      hi = lo * (1 + step);
      break;
    }
    lo *= 1 + step;
  }
  for (int i = 0; i < kAllLevelsBisections && hi > lo * (1 + kAllLevelsPrecision); ++i) {
    const double mid = 0.5 * (lo + hi);
    if (all.out_of_reach(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace eplb::placement::two_slots
