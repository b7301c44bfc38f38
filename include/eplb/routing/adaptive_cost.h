#pragma once
// The step's split that minimises the largest *modeled* rank time (dispatch `adaptive_cost`):
// like `adaptive` (adaptive.h), from the step's global count of every expert, but under the
// cost model of placement/cost.h, where an activated slot pays a fixed part on top of its
// tokens. Where that fixed part dominates, leaving a replica idle (its expert's tokens on its
// other replicas) beats waking it for a few tokens, and `adaptive`'s token-optimal split is not
// the time-optimal one.
//
// With fixed costs the problem is no longer a flow. The solver runs a local search from two
// starts: `adaptive`'s split (exact in tokens), and the split that activates the fewest slots
// on the busiest rank (each expert's tokens all on one replica, the replicas chosen by the same
// flow on one "token" per expert: exact where the fixed part is all that counts). The search
// works on the rank with the largest modeled time: each of its experts with a replica elsewhere
// may move all of its tokens there (the slot goes idle) or the part that best evens the two
// ranks; the move that leaves the two ranks lowest is taken while it lowers the top rank
// strictly and leaves the other below the old top or no higher than it was. A rank's part of
// one expert goes to one slot (the first replica of the expert on that rank). The best of the
// token-optimal split and the two searches' results is kept, the token-optimal one unless
// another is strictly lower, so `adaptive_cost` is never worse than `adaptive` under its own
// model. adaptive_cost_bound() is a lower bound on what any split can
// reach; the simulator reports the gap to it.
//
// Deterministic: the model is turned into integer ticks (2^-16 us) once, and everything after
// is integer arithmetic in a fixed order, so every rank computes the same shares from the same
// counts, bit for bit. No allocation: the caller passes the workspace.

#include <cstdint>

#include "eplb/placement/cost.h"
#include "eplb/routing/adaptive.h"

namespace eplb::routing {

// A cost model in integer ticks of 2^-16 microseconds (placement::CostModel's parameters,
// rounded to the nearest tick; the knee rounded to whole tokens, 0: none).
struct CostTicks {
  int64_t rank = 0;
  int64_t slot = 0;
  int64_t token = 0;
  int64_t knee = 0;
  int64_t token_above = 0;

  int64_t slot_time(int64_t tokens) const {
    if (tokens <= 0) return 0;
    if (knee <= 0) return slot + token * tokens;
    const int64_t below = tokens < knee ? tokens : knee;
    return slot + token * below + token_above * (tokens - below);
  }
};

inline constexpr double kTicksPerUs = 65536.0;

// Validates `model` (CostModel::validate) and converts it.
CostTicks cost_ticks(const placement::CostModel& model);

// int64 words of workspace adaptive_cost_split needs.
int64_t adaptive_cost_workspace_words(int64_t experts, int64_t max_replicas, int64_t ranks,
                                      int64_t physical);

// Writes `share` as adaptive_split does (same layout and meaning) and returns the largest
// modeled rank time of it in ticks (rank + the slot times of the rank's activated slots), or -1
// for inconsistent tables (share then all 0). `counts` times the model's largest per-token and
// per-slot ticks must stay below 2^62 (the caller checks: dispatch.h's adaptive_cost_shares).
int64_t adaptive_cost_split(const AdaptiveLayer& t, const int64_t* counts, const CostTicks& m,
                            int64_t* share, int64_t* work);

// The largest modeled rank time of `share` (adaptive_split's layout) in ticks.
int64_t modeled_max_rank_ticks(const AdaptiveLayer& t, const int64_t* share, const CostTicks& m,
                               int64_t* rank_time /* [ranks] */);

}  // namespace eplb::routing
