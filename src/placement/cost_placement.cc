// `balanced` under a cost model (PolicyOptions::cost; the simulator's `balanced_cost`). Per
// layer, from the window's loads summed over `steps` steps:
//   Step 1: each expert's tokens per step, n_e = w_e / steps, and the expected modeled time of a
//           replica carrying x of them, c(x) = slot_time(x) for x >= 1, x * slot_time(1) below
//           (a replica that a step activates with probability about x).
//   Step 2: replica counts. Every expert has one; each redundant slot goes to the expert with the
//           largest c(n_e / r_e), while that lowers the estimate of the busiest rank,
//           max(largest replica time, total replica time / ranks): a replica adds its fixed
//           part to the total. The slots left are spares: replicas of the hottest experts, one
//           each in that order, which the cost-aware dispatch (adaptive_cost) leaves idle
//           unless using them lowers a step's busiest rank.
//   Step 3: the replicas packed by c (spares weigh 0) with balanced's packing, never two
//           replicas of one expert on a rank.
// Deterministic: ties by expert index; balanced's packing is.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "eplb/core/error.h"
#include "placement/balanced.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/policy.h"
#include "placement/packing.h"

namespace eplb::placement {
namespace {

double replica_time(const CostModel& m, double x) {
  if (!(x > 0)) return 0;
  return x >= 1 ? m.slot_time_us(x) : x * m.slot_time_us(1);
}

void place_layer(std::span<const double> w, const Layout& layout, const CostModel& m,
                 double steps, std::span<int32_t> phy2log) {
  const int64_t E = layout.experts, G = layout.ranks, spr = layout.slots_per_rank();
  // Step 1.
  std::vector<double> n(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) n[e] = w[e] / steps;
  // Step 2.
  std::vector<int32_t> count(static_cast<size_t>(E), 1);
  double total = 0, largest = 0;
  for (int64_t e = 0; e < E; ++e) {
    total += replica_time(m, n[e]);
    largest = std::max(largest, replica_time(m, n[e]));
  }
  const auto per_replica = [&](int64_t e) { return replica_time(m, n[e] / count[e]); };
  const auto hottest = [&] {
    int64_t best = -1;  // an expert may have at most one replica per rank
    for (int64_t e = 0; e < E; ++e) {
      if (count[e] < G && (best < 0 || per_replica(e) > per_replica(best))) best = e;
    }
    return best;
  };
  int64_t slots = E;
  while (slots < layout.physical) {
    const int64_t e = hottest();
    if (e < 0) break;
    // The largest replica after it: e's new share, or the next largest replica.
    const double was = per_replica(e);
    ++count[e];
    double next_largest = 0;
    for (int64_t k = 0; k < E; ++k) next_largest = std::max(next_largest, per_replica(k));
    const double next_total =
        total - (count[e] - 1) * was + count[e] * per_replica(e);
    const double now = std::max(largest, total / static_cast<double>(G));
    const double then = std::max(next_largest, next_total / static_cast<double>(G));
    if (!(then < now)) {
      --count[e];
      break;
    }
    total = next_total;
    largest = next_largest;
    ++slots;
  }
  std::vector<int32_t> spares(static_cast<size_t>(E), 0);
  if (slots < layout.physical) {
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return per_replica(a) > per_replica(b); });
    // One each, hottest first, round after round; an expert never gets more replicas than ranks.
    for (int64_t i = 0; slots < layout.physical; i = (i + 1) % E) {
      const int32_t e = order[static_cast<size_t>(i)];
      if (count[e] + spares[e] >= G) continue;
      ++spares[e];
      ++slots;
    }
  }
  // Step 3.
  std::vector<double> weight;
  std::vector<int32_t> cls;
  for (int32_t e = 0; e < E; ++e) {
    for (int32_t k = 0; k < count[e]; ++k) {
      weight.push_back(per_replica(e));
      cls.push_back(e);
    }
    for (int32_t k = 0; k < spares[e]; ++k) {
      weight.push_back(0);
      cls.push_back(e);
    }
  }
  const Packing pack = pack_balanced(weight, cls, E, G, spr);
  std::vector<int32_t> rank_experts(static_cast<size_t>(spr));
  for (int64_t r = 0; r < G; ++r) {
    for (int64_t k = 0; k < spr; ++k) rank_experts[k] = cls[pack.item[r * spr + k]];
    std::sort(rank_experts.begin(), rank_experts.end());
    std::copy(rank_experts.begin(), rank_experts.end(), phy2log.begin() + r * spr);
  }
}

}  // namespace

Placement balanced_cost(const LoadMatrix& load, const Layout& layout, const CostModel& model,
                        int64_t steps) {
  model.validate();
  if (steps < 1) fail("cost placement: the loads sum over ", steps, " steps (at least 1)");
  check_balanced_inputs(load, layout, false);
  Placement out(load.layers, layout.experts, layout.physical);
  for (int64_t l = 0; l < load.layers; ++l) {
    place_layer(load.row(l), layout, model, static_cast<double>(steps), out.layer_phy2log(l));
  }
  out.derive_from_phy2log();
  return out;
}

}  // namespace eplb::placement
