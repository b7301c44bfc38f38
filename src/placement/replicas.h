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

// The counts of that greedy's choice, keys compared in Value (each expert's k-th extra replica
// at w_e / k computed in Value, k = 1 .. most; the largest first, ties by lower expert), found
// by thresholds: every key above a level t_hi is taken and none at most t_lo, and the few keys
// between are selected; `count` [experts] gets 1 + each expert's. False, with `count`
// untouched, where the levels cannot be confirmed (the limit binding, loads of zero, rounding):
// the caller runs the greedy itself. A heap handing out the replicas one at a time mispredicted
// most of its compares: at 512 slots for 256 experts it took three times as long.
template <typename Value>
bool counts_by_thresholds(std::span<const Value> w, int64_t extra, int64_t most,
                          std::vector<int32_t>& count);

}  // namespace eplb::placement
