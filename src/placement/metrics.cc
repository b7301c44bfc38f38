// Metrics of a placement under a load (docs/design.md). Computed in double; replicas share their
// expert's load equally.

#include "eplb/placement/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "placement/replicas.h"
#include "placement/two_slots.h"

namespace eplb::placement {
namespace {

void check_load(std::span<const double> load, const Layout& layout) {
  if (static_cast<int64_t>(load.size()) != layout.experts) {
    fail("the load of a layer has ", load.size(), " experts but the layout has ",
         layout.experts);
  }
  for (size_t e = 0; e < load.size(); ++e) {
    if (!(load[e] >= 0) || load[e] > std::numeric_limits<double>::max()) {
      fail("load of expert ", e, " is ", load[e], " (loads must be finite and non-negative)");
    }
  }
}

// Replica count of each expert in one layer's phy2log, after checking its shape. [experts]
std::vector<int32_t> count_replicas(std::span<const int32_t> phy2log, const Layout& layout) {
  if (static_cast<int64_t>(phy2log.size()) != layout.physical) {
    fail("phy2log of a layer has ", phy2log.size(), " slots but the layout has ",
         layout.physical);
  }
  std::vector<int32_t> count(static_cast<size_t>(layout.experts), 0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    const int32_t e = phy2log[p];
    if (e < 0 || e >= layout.experts) {
      fail("slot ", p, " holds expert ", e, ", outside [0, ", layout.experts, ")");
    }
    ++count[e];
  }
  for (size_t e = 0; e < count.size(); ++e) {
    if (count[e] == 0) fail("expert ", e, " has no slot (every expert needs a replica)");
  }
  return count;
}

std::vector<double> rank_loads_unchecked(std::span<const double> load,
                                         std::span<const int32_t> phy2log,
                                         std::span<const int32_t> count, const Layout& layout) {
  std::vector<double> out(static_cast<size_t>(layout.ranks), 0.0);
  const int64_t per_rank = layout.slots_per_rank();
  for (int64_t p = 0; p < layout.physical; ++p) {
    const int32_t e = phy2log[p];
    out[p / per_rank] += load[e] / count[e];
  }
  return out;
}

double ratio_or_one(double num, double den) { return den > 0 ? num / den : 1.0; }

}  // namespace

std::vector<double> rank_loads(std::span<const double> load, std::span<const int32_t> phy2log,
                               const Layout& layout) {
  layout.validate();
  check_load(load, layout);
  const std::vector<int32_t> count = count_replicas(phy2log, layout);
  return rank_loads_unchecked(load, phy2log, count, layout);
}

double layer_balancedness(std::span<const double> load, std::span<const int32_t> phy2log,
                          const Layout& layout) {
  const std::vector<double> ranks = rank_loads(load, phy2log, layout);
  double total = 0, most = 0;
  for (const double r : ranks) {
    total += r;
    most = std::max(most, r);
  }
  return ratio_or_one(total / static_cast<double>(ranks.size()), most);
}

double layer_lower_bound(std::span<const double> load, const Layout& layout) {
  layout.validate();
  check_load(load, layout);
  // Step 1: the per-replica bound. Giving each further replica to the expert with the largest
  // per-replica load is optimal for min over counts of max_e w_e / r_e (an exchange argument:
  // any count vector reaching a smaller maximum must give each expert at least as many replicas
  // as the greedy one has when it first reaches that maximum). Uncapped: a bound may put two
  // replicas of an expert on a rank.
  double total = 0;
  for (const double w : load) total += w;
  const double mean = total / static_cast<double>(layout.ranks);
  // Step 2 (below): no rank can carry less than the mean. So where the slots let every expert
  // carry at most the mean per replica (the fewest replicas that do, counted in one pass), the
  // greedy counts do too and the bound is the mean: usual from a few slots per rank on, where
  // the greedy's heap was a tenth of sticky's time.
  if (total > 0) {
    int64_t needed = 0;
    for (size_t e = 0; e < load.size() && needed <= layout.physical; ++e) {
      double c = std::max(1.0, std::ceil(load[e] / mean));
      while (load[e] / c > mean) ++c;
      needed += static_cast<int64_t>(c);
    }
    if (needed <= layout.physical) {
      if (layout.slots_per_rank() == 2) return std::max(mean, two_slots::bound(load, layout.ranks));
      return mean;
    }
  }
  const std::vector<int32_t> count = greedy_replica_counts(load, layout.physical, layout.physical);
  double per_replica = 0;
  for (size_t e = 0; e < load.size(); ++e) {
    per_replica = std::max(per_replica, load[e] / static_cast<double>(count[e]));
  }
  // Step 2.
  const double bound = std::max(mean, per_replica);
  // Step 3: with two slots per rank every replica also needs a partner (two_slots.h).
  if (layout.slots_per_rank() == 2) return std::max(bound, two_slots::bound(load, layout.ranks));
  return bound;
}

int64_t moved_slots(const Placement& before, const Placement& after) {
  if (before.layers != after.layers || before.physical != after.physical ||
      before.phy2log.size() != after.phy2log.size()) {
    fail("cannot compare placements of different shapes: ", before.layers, " layers x ",
         before.physical, " slots vs ", after.layers, " layers x ", after.physical, " slots");
  }
  int64_t moved = 0;
  for (size_t i = 0; i < before.phy2log.size(); ++i) {
    moved += before.phy2log[i] != after.phy2log[i] ? 1 : 0;
  }
  return moved;
}

PlacementMetrics evaluate(const LoadMatrix& load, const Placement& placement, const Layout& layout,
                          const Placement* previous, bool with_bound) {
  layout.validate();
  load.validate();
  if (load.experts != layout.experts) {
    fail("the load has ", load.experts, " experts per layer but the layout has ", layout.experts);
  }
  if (placement.layers != load.layers || placement.experts != layout.experts ||
      placement.physical != layout.physical) {
    fail("the placement has ", placement.layers, " layers, ", placement.experts, " experts, ",
         placement.physical, " physical slots; the load and layout need ", load.layers, ", ",
         layout.experts, ", ", layout.physical);
  }
  if (placement.phy2log.size() != static_cast<size_t>(placement.layers * placement.physical)) {
    fail("the placement's phy2log holds ", placement.phy2log.size(), " entries, expected ",
         placement.layers, " x ", placement.physical);
  }

  PlacementMetrics m;
  const size_t layers = static_cast<size_t>(load.layers);
  m.balancedness.resize(layers);
  m.lower_bound_balancedness.resize(layers);
  m.mean_rank_load.resize(layers);
  m.max_rank_load.resize(layers);
  m.dense.assign(layers, 0);
  double sum_balancedness = 0, sum_bound = 0, sum_mean = 0, sum_max = 0;
  for (int64_t l = 0; l < load.layers; ++l) {
    const std::span<const double> w = load.row(l);
    const std::span<const int32_t> phy2log = placement.layer_phy2log(l);
    const std::vector<int32_t> count = count_replicas(phy2log, layout);
    const std::vector<double> ranks = rank_loads_unchecked(w, phy2log, count, layout);
    double total = 0, most = 0;
    for (const double r : ranks) {
      total += r;
      most = std::max(most, r);
    }
    const double mean = total / static_cast<double>(layout.ranks);
    m.mean_rank_load[l] = mean;
    m.max_rank_load[l] = most;
    m.balancedness[l] = ratio_or_one(mean, most);
    m.lower_bound_balancedness[l] =
        with_bound ? ratio_or_one(mean, layer_lower_bound(w, layout)) : 1.0;
    if (!(total > 0)) {
      m.dense[l] = 1;
      continue;
    }
    ++m.moe_layers;
    sum_balancedness += m.balancedness[l];
    sum_bound += m.lower_bound_balancedness[l];
    sum_mean += mean;
    sum_max += most;
  }
  if (m.moe_layers > 0) {
    m.balancedness_mean = sum_balancedness / static_cast<double>(m.moe_layers);
    m.lower_bound_mean = sum_bound / static_cast<double>(m.moe_layers);
  }
  m.balancedness_step = ratio_or_one(sum_mean, sum_max);

  if (previous != nullptr) {
    if (previous->layers != placement.layers || previous->physical != placement.physical ||
        previous->phy2log.size() != placement.phy2log.size()) {
      fail("the previous placement has ", previous->layers, " layers x ", previous->physical,
           " slots; the new one has ", placement.layers, " x ", placement.physical);
    }
    m.moved_per_layer.assign(layers, 0);
    m.moved = 0;
    for (int64_t l = 0; l < load.layers; ++l) {
      const std::span<const int32_t> a = previous->layer_phy2log(l);
      const std::span<const int32_t> b = placement.layer_phy2log(l);
      int64_t moved = 0;
      for (size_t p = 0; p < a.size(); ++p) moved += a[p] != b[p] ? 1 : 0;
      m.moved_per_layer[l] = moved;
      m.moved += moved;
    }
  }
  return m;
}

std::optional<PlacementMetrics> served_metrics(const LoadMatrix& load, const Placement& placement,
                                               const Layout& layout,
                                               std::span<const int32_t> members,
                                               std::span<const uint8_t> usable) {
  const bool every_seat = members.empty() || static_cast<int64_t>(members.size()) == layout.ranks;
  if (every_seat && usable.empty()) {
    return evaluate(load, placement, layout, nullptr, /*with_bound=*/false);
  }
  const int64_t spr = layout.slots_per_rank();
  std::vector<uint8_t> member(static_cast<size_t>(layout.ranks), every_seat ? 1 : 0);
  if (!every_seat) {
    for (const int32_t g : members) member[static_cast<size_t>(g)] = 1;
  }
  Layout compact = layout;
  compact.ranks = every_seat ? layout.ranks : static_cast<int64_t>(members.size());
  compact.physical = compact.ranks * spr;
  compact.nodes = 1;
  Placement c(placement.layers, placement.experts, compact.physical);
  std::vector<uint8_t> served(static_cast<size_t>(placement.experts));
  for (int64_t l = 0; l < placement.layers; ++l) {
    std::fill(served.begin(), served.end(), 0);
    int64_t q = 0;
    for (int64_t slot = 0; slot < layout.physical; ++slot) {
      if (!member[static_cast<size_t>(slot / spr)]) continue;
      const int32_t e = placement.phy2log[l * layout.physical + slot];
      c.phy2log[l * compact.physical + q++] = e;
      if (usable.empty() || usable[static_cast<size_t>(l * layout.physical + slot)]) {
        served[static_cast<size_t>(e)] = 1;
      }
    }
    if (std::find(served.begin(), served.end(), 0) != served.end()) return std::nullopt;
  }
  c.derive_from_phy2log();
  return evaluate(load, c, compact, nullptr, /*with_bound=*/false);
}

}  // namespace eplb::placement
