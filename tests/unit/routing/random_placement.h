#pragma once
// A test placement for the routing suites: one layer, every expert once, the rest replicas of
// random experts (possibly several on one rank).

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "eplb/core/types.h"

namespace eplb::routing {

// `experts` on ranks x per_rank slots; sets `layout` to that shape (one node, one group).
inline Placement random_placement(std::mt19937& rng, int64_t experts, int64_t ranks,
                                             int64_t per_rank, Layout& layout) {
  const int64_t physical = ranks * per_rank;
  layout = Layout{
      .experts = experts, .physical = physical, .ranks = ranks, .nodes = 1, .groups = 1};
  Placement p(1, experts, physical);
  std::vector<int32_t> ids(static_cast<size_t>(physical));
  for (int64_t i = 0; i < physical; ++i) {
    ids[i] = static_cast<int32_t>(i < experts ? i : rng() % experts);
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  std::copy(ids.begin(), ids.end(), p.phy2log.begin());
  p.derive_from_phy2log();
  return p;
}

}  // namespace eplb::routing
