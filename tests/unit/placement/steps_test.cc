// The policies' internal steps that the public API reaches only partly, tested directly:
// greedy_replica_counts with a cap that binds (balanced's counts at two or more slots per rank,
// where no placement shows them).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "placement/replicas.h"

namespace eplb::placement {
namespace {

// Loads of six kinds: lognormal, small integers (many ties), zeros among them, all equal, one
// expert far heavier than the rest, and all zero.
std::vector<double> loads_of_kind(int kind, int64_t n, std::mt19937_64& rng) {
  std::vector<double> w(static_cast<size_t>(n));
  std::lognormal_distribution<double> lognormal(0.0, 1.0);
  std::uniform_int_distribution<int> small(0, 4);
  for (int64_t e = 0; e < n; ++e) {
    switch (kind) {
      case 0: w[e] = lognormal(rng); break;
      case 1: w[e] = small(rng) + 1; break;
      case 2: w[e] = small(rng) < 2 ? 0.0 : lognormal(rng); break;
      case 3: w[e] = 7.0; break;
      case 4: w[e] = e == n / 2 ? 1000.0 : lognormal(rng); break;
      default: w[e] = 0.0; break;
    }
  }
  return w;
}

// The greedy by definition: one extra replica at a time to the largest w_e / r_e among the
// experts below the cap, the lowest index on a tie.
std::vector<int32_t> one_at_a_time(const std::vector<double>& w, int64_t slots, int64_t cap) {
  std::vector<int32_t> r(w.size(), 1);
  for (int64_t k = static_cast<int64_t>(w.size()); k < slots; ++k) {
    int64_t best = -1;
    for (size_t e = 0; e < w.size(); ++e) {
      if (r[e] >= cap) continue;
      if (best < 0 || w[e] / r[e] > w[best] / r[best]) best = static_cast<int64_t>(e);
    }
    ++r[best];
  }
  return r;
}

TEST(ReplicaCounts, GreedyWithABindingCapIsTheOneAtATimeGreedy) {
  std::mt19937_64 rng(17);
  int64_t capped = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const int kind = trial % 6;
    const int64_t n = 1 + static_cast<int64_t>(rng() % 40);
    const int64_t cap = 1 + static_cast<int64_t>(rng() % 8);
    const int64_t slots = n + static_cast<int64_t>(rng() % static_cast<uint64_t>(n * (cap - 1) + 1));
    const std::vector<double> w = loads_of_kind(kind, n, rng);
    const std::vector<int32_t> want = one_at_a_time(w, slots, cap);
    capped += std::count(want.begin(), want.end(), static_cast<int32_t>(cap)) > 0 && cap > 1;
    ASSERT_EQ(greedy_replica_counts(w, slots, cap), want)
        << "kind " << kind << ", " << n << " experts, " << slots << " slots, cap " << cap;
  }
  // The cap bound on many of them (else the heap's restart would go untested).
  EXPECT_GT(capped, 1000);
}

}  // namespace
}  // namespace eplb::placement
