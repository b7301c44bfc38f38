#pragma once
// Shared by the placement tests: the replica-count greedy by its definition, and loads of the
// kinds that stress its ties, for the tests that hold the policies' counts to it.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

namespace eplb::placement::testing {

// One extra replica at a time, slots - experts of them, each to the largest w_e / r_e among the
// experts below `cap` replicas, the lowest index on a tie; the keys computed in Value (float:
// deepseek's, whose loads are float32, negative ones taken as 0).
template <typename Value = double>
std::vector<int32_t> greedy_one_at_a_time(std::span<const double> w, int64_t slots,
                                          int64_t cap = std::numeric_limits<int64_t>::max()) {
  std::vector<Value> weight(w.size());
  for (size_t e = 0; e < w.size(); ++e) weight[e] = w[e] > 0 ? static_cast<Value>(w[e]) : Value{0};
  std::vector<int32_t> count(w.size(), 1);
  for (int64_t j = static_cast<int64_t>(w.size()); j < slots; ++j) {
    int64_t best = -1;
    for (size_t e = 0; e < w.size(); ++e) {
      if (count[e] >= cap) continue;
      if (best < 0 || weight[e] / static_cast<Value>(count[e]) >
                          weight[best] / static_cast<Value>(count[best])) {
        best = static_cast<int64_t>(e);
      }
    }
    ++count[best];
  }
  return count;
}

// One expert's load of kind `kind` (0-6); `lognormal` is the caller's, so a test can vary its
// spread. Kind 6 is drawn for expert `e` of `experts`: the middle one far heavier than the rest.
inline double load_of_kind(int kind, std::lognormal_distribution<double>& lognormal,
                           std::mt19937_64& rng, int64_t e = 0, int64_t experts = 1) {
  switch (kind) {
    case 0: return std::round(lognormal(rng) * 1000.0);
    case 1: return static_cast<double>(rng() % 4);        // ties and zeros
    case 2: return 6.0 * static_cast<double>(rng() % 3);  // keys that divide evenly
    case 3: return lognormal(rng) * 1e-3;
    case 4: return 5.0;                                   // every expert equal
    case 5: return 1e6 + static_cast<double>(rng() % 3);  // one apart, far from 0
    default: return e == experts / 2 ? 1000.0 : lognormal(rng);
  }
}

}  // namespace eplb::placement::testing
