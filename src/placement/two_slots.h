#pragma once
// One layer with exactly two slots per rank (DeepSeek-V3's decode shapes: 144-256 ranks): the
// placement and the lower bound, which at this shape are a pairing problem.
//
// With two slots, a rank's load is the sum of two replicas' loads, so for given replica counts
// the best packing is the sorted pairing (the k-th heaviest replica with the k-th lightest).
// What decides the balance is then the counts: one more replica for the heaviest expert lowers
// the top of the pairing, one more for the lightest gives the heavy replicas lighter partners.
// The old bound, max(mean, the smallest largest replica), ignores the partners and sat 0.01-0.08
// above every policy.

#include <cstdint>
#include <span>
#include <vector>

namespace eplb::placement::two_slots {

// Replica counts and their sorted pairing for `ranks` ranks of two slots (2 * ranks >= experts,
// every expert at least one replica, at most one per rank): starts from the counts that
// minimise the largest replica and moves one replica at a time between experts while that
// lowers the largest pair; then, where replicas are scarce (at most one extra for every two
// experts: 288 slots for 256, DeepSeek-V3's decode at 144 ranks), tries two moves at a time
// where no single one helps (the second from the largest pair the first leaves), single moves
// again after each.
// Writes phy2log [2 * ranks] (local expert indices, each rank's two in ascending order, never
// the same twice) and returns its largest rank load. `traded` says whether a pair holding one
// expert twice had to trade a replica: the result may then be above the best (it happens on
// tiny layers; the caller can compare it with another packing). `greedy` gets the counts it
// started from (greedy_replica_counts(w, 2 * ranks, ranks)) and `greedy_top` their pairing's
// largest pair (pairing_top of them), for that comparison.
//
// The leaps: on DeepSeek-V3's eight real prefill load files at 144 ranks they raise the mean
// balancedness by 0.0004-0.0036, to within 0.0013-0.0046 of the bound (0.0017-0.0082 without);
// on lognormal loads there they find nothing. Where replicas are plentiful (512 slots for 256
// experts) they gained 0.005 for three times the time, and the sweep below gains 0.057, so
// they are left out there.
//
// With `sweep`, counts are also built level by level for a bisection on the largest pair (the
// bound's condition made to hold, greedily), and the better counts are kept: at 512 slots for
// 256 experts the move search stops 6-8% above the mean and the sweep within 1.5% of it; at 288
// slots for 256 experts it finds nothing better. It takes several times the move search's time
// there (two_slots.cc says why).
double place(std::span<const double> w, int64_t ranks, std::span<int32_t> phy2log,
             bool& traded, std::vector<int32_t>& greedy, double& greedy_top, bool sweep = false);

// A lower bound on the largest rank load any placement of `w` on `ranks` ranks of two slots
// can have (two replicas of an expert on one rank included), by bisection on T. Never below
// max(total / ranks, the smallest largest replica); on lognormal loads at 144 ranks within
// 0.0004 of balanced's balancedness, on DeepSeek-V3's real prefill loads within 0.002 of the
// linear relaxation of an exact program (scripts/two-slots-exact.py), and at 512 slots for 256
// experts 0.9993 of the mean (two_slots_bound.cc has the stages).
//
// The condition: a largest rank load T is reachable only if there are counts r_e (sum 2 * ranks)
// whose replicas can be paired. A replica heavier than T / 2 by h needs its own partner lighter
// than T / 2 by at least h, so for every level y > 0 the replicas at least y above T / 2 may not
// outnumber those at least y below it (for nested sets that is also enough: Hall). Relaxed
// (Lagrangian) over the choice of counts, first one level at a time (a multiplier in [0, 1],
// ternary search), then every level at once (a multiplier per level, subgradient ascent): each
// expert's cheapest count summed is a lower bound on the slots any pairable choice needs; above
// 2 * ranks, T is out of reach. It costs about 10 ms a layer at 144 ranks and 30 ms at 256
// (reports only: no policy calls it at two slots per rank).
double bound(std::span<const double> w, int64_t ranks);

// The largest rank load of the sorted pairing of the replicas with counts `counts` [experts]
// (sum 2 * ranks) on `ranks` ranks of two slots: the least largest rank load any placement with
// these counts can have (two replicas of an expert on one rank included).
double pairing_top(std::span<const double> w, std::span<const int32_t> counts, int64_t ranks);

// sticky at two slots per rank: the previous placement `prev` [2 * ranks] moved to the replica
// counts `counts` [experts] (balanced's) with every rank at most `cap`, keeping slots where it
// can. Each expert keeps as many of its old slots as it still has replicas (giving up those on
// the most loaded ranks); the new replicas go, heaviest first, to the freed slots beside the
// lightest partners (where the only free slots left lie beside the same expert, it takes a slot
// of a rank without it, whose expert moves to the free slot); then each rank above the cap
// trades its lighter replica with a lighter one of a rank that can take it. Writes `out` and
// returns true when every rank is at most the cap.
bool repair(std::span<const double> w, std::span<const int32_t> prev,
            std::span<const int32_t> counts, int64_t ranks, double cap, std::span<int32_t> out);

}  // namespace eplb::placement::two_slots
