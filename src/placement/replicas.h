#pragma once
// Replica counts that minimise the largest load per replica (balanced's Step 2, the two-slot
// placement's start, the lower bound's per-replica term).

#include <cstdint>
#include <span>
#include <vector>

namespace eplb::placement {

// Each of the slots - experts extra replicas goes to the expert with the largest w_e / r_e
// (lowest index on a tie), at most `cap` replicas per expert; optimal for min over counts of
// max_e w_e / r_e. slots >= experts. [experts]
std::vector<int32_t> greedy_replica_counts(std::span<const double> w, int64_t slots, int64_t cap);

}  // namespace eplb::placement
