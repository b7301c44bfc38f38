#pragma once
// Replica choice: which physical slot receives a token routed to logical expert e.
//
//   static    a replica on the token's own rank, else one on its node, else replicas spread so
//             each serves an even share of the ranks that have none nearby. Fixed per
//             (rank, expert): no per-token work, but no balancing inside a step.
//   random    uniform over the replicas, from a per-rank random stream.
//   hash      uniform over the replicas by a hash of the token index, offset per rank so ranks
//             do not pick in lockstep. Stateless and reproducible: the CUDA routing kernel uses
//             the same function, bit for bit.
//   weighted  in proportion to each replica's planned share of its expert's load.
//   split     rank g's k-th token of expert e (in token order within one route() call) goes to
//             replica (k + g + e) mod replicas: each rank's tokens of an expert split evenly
//             over its replicas, with nothing but the tables (split_replica, adaptive.h).
//   adaptive  the step's best split: from the step's global count of every expert (which every
//             rank must have, e.g. from the all-to-all's layout exchange or one all-reduce of E
//             counts), adaptive_shares() computes each replica's share so that the busiest rank
//             carries the least load possible, identically on every rank; route_adaptive()
//             then gives each rank's tokens the ordinals after the lower ranks' tokens of the
//             same expert (`prefix`) and sends ordinal q to the replica whose share covers q.
//   adaptive_cost  the same, with the shares that minimise the busiest rank's *modeled time*
//             under a cost model (adaptive_cost.h: an activated slot pays a fixed part, so a
//             replica may be left idle rather than woken for a few tokens);
//             adaptive_cost_shares() computes them, route_adaptive() routes by them.
//
// The tables of one layer are built once per placement change (off the forward thread) and
// read by the router; they are plain arrays an engine can upload to a device as they are.
//
// Unusable slots (elastic serving: the slots of a rank that is gone): the tables list only the
// slots that may receive tokens (build_dispatch_tables' `usable`), so no policy ever routes to
// another. An expert with no usable slot has replica_count 0, a log2phy row of -1 and
// static_slot -1: a token whose expert has no usable replica is routed to -1 under every policy
// (adaptive included). The engine drops that expert's contribution, as if the gate had not
// chosen it; unavailable_experts() lists such experts. Tables built without `usable` never hold
// a count of 0.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "eplb/core/hash.h"
#include "eplb/core/types.h"
#include "eplb/routing/adaptive.h"
#include "eplb/routing/adaptive_cost.h"

namespace eplb::routing {

enum class DispatchPolicy { kStatic, kRandom, kHash, kWeighted, kSplit, kAdaptive, kAdaptiveCost };

// "static" | "random" | "hash" | "weighted" | "split" | "adaptive" | "adaptive_cost"; else
// InvalidArgument listing them.
DispatchPolicy parse_dispatch_policy(std::string_view name);
std::string_view dispatch_policy_name(DispatchPolicy policy);
// adaptive and adaptive_cost: routed by the step's shares (route_adaptive), not by route().
inline bool routes_by_shares(DispatchPolicy policy) {
  return policy == DispatchPolicy::kAdaptive || policy == DispatchPolicy::kAdaptiveCost;
}

// Dispatch tables of one layer.
struct DispatchTables {
  int64_t experts = 0;
  int64_t ranks = 0;
  int64_t max_replicas = 0;
  int64_t slots_per_rank = 0;
  std::vector<int32_t> log2phy;        // [experts][max_replicas], usable slots, padded with -1
  std::vector<int32_t> replica_count;  // [experts], in [0, max_replicas]; 0: no usable slot
  // [ranks][experts]: the slot rank g sends e to (static); -1 for an expert with no usable slot
  std::vector<int32_t> static_slot;
  // weighted: cumulative share thresholds in 1/2^32 units, [experts][max_replicas]; the last
  // replica's threshold is 2^32 - 1 inclusive.
  std::vector<uint32_t> cumulative_share;

  std::span<const int32_t> replicas(int64_t expert) const {
    return {log2phy.data() + expert * max_replicas, static_cast<size_t>(replica_count[expert])};
  }
};

// Builds the tables of `layer`. `replica_share` ([physical], optional) is each slot's planned
// share of its expert's load; empty means replicas share equally. `usable` ([physical],
// optional; nonzero: the slot may receive tokens; empty: every slot) keeps only the usable
// slots as replicas, in the placement's replica order; shares and static choices are spread
// over those alone. max_replicas stays the placement's, so the tables keep their shape whatever
// is usable; with every slot usable they are the tables built without `usable`, bit for bit.
// InvalidArgument for arrays of the wrong size.
DispatchTables build_dispatch_tables(const Placement& placement, int64_t layer,
                                     const Layout& layout,
                                     std::span<const double> replica_share = {},
                                     std::span<const uint8_t> usable = {});

// The experts with no usable replica in `tables` (replica_count 0), ascending: their tokens are
// routed to -1.
std::vector<int32_t> unavailable_experts(const DispatchTables& tables);

// The hash of `hash` dispatch: a 32-bit mix of the token index and the rank. Defined here once;
// the device kernel restates it and is tested against it.
inline uint32_t dispatch_hash(uint64_t token_index, uint32_t rank) {
  return static_cast<uint32_t>(
      mix64(token_index + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(rank) + 1)));
}

// Chooses the slot for one (token, expert) on `rank`. `random_state` is the caller's per-rank
// stream for `random` (any non-zero seed; advanced in place), unused by the others. For `split`,
// `token_index` is the token's ordinal k among this rank's tokens of `expert`. `adaptive` needs
// the step's shares: InvalidArgument pointing to route_adaptive. -1 for an expert without a
// usable replica.
int32_t choose_slot(const DispatchTables& tables, DispatchPolicy policy, int32_t expert,
                    uint64_t token_index, int64_t rank, uint64_t& random_state);

// Maps a batch: experts [tokens][top_k] -> slots [tokens][top_k]. Row t is the token with
// index first_token + t (what hash and weighted dispatch hash); `split` counts ordinals from 0
// in this batch, so route one rank's tokens of a step in one call. `adaptive` throws
// InvalidArgument: use route_adaptive. An expert without a usable replica gets slot -1.
void route(const DispatchTables& tables, DispatchPolicy policy, std::span<const int32_t> experts,
           int64_t top_k, std::span<int32_t> slots, uint64_t first_token, int64_t rank,
           uint64_t& random_state);

// The step's shares of one layer under `adaptive` (and the best split the simulator scores).
struct AdaptiveShares {
  std::vector<int64_t> share;  // [experts][max_replicas], aligned with log2phy; 0 in padding
  // The busiest rank's load under them (for adaptive the least possible); tokens of experts
  // without a usable replica go nowhere and count on no rank.
  int64_t max_rank_load = 0;
  // adaptive_cost: the busiest rank's modeled time under them, in ticks (adaptive_cost.h).
  int64_t modeled_ticks = 0;
  std::vector<int64_t> work;   // the solver's workspace, kept between calls
};

// The tables as the split solver (adaptive.h) reads them: pointers into `tables`.
AdaptiveLayer adaptive_layer(const DispatchTables& tables);

// Computes `out` from the step's global count of every expert of the layer ([experts], the
// sum over all ranks; the same on every rank gives the same shares on every rank, bit for
// bit). Reuses out's buffers: no allocation after the first call of a shape. InvalidArgument
// for a count array of the wrong size or a negative count.
void adaptive_shares(const DispatchTables& tables, std::span<const int64_t> global_counts,
                     AdaptiveShares& out);

// adaptive_shares under a cost model (`ticks`, from cost_ticks()): the shares whose busiest
// rank's modeled time is least that the solver finds, never above adaptive_shares' (adaptive_cost.h).
// Same outputs and reuse of buffers as adaptive_shares; InvalidArgument also when the step's
// tokens are so many that a modeled time would pass 2^62 ticks.
void adaptive_cost_shares(const DispatchTables& tables, std::span<const int64_t> global_counts,
                          const CostTicks& ticks, AdaptiveShares& out);

// Adds the batch's count of every expert to `counts` ([experts]); InvalidArgument for an id
// outside [0, experts).
void count_experts(std::span<const int32_t> experts, int64_t num_experts,
                   std::span<int64_t> counts);

// `prefix` ([experts]) for rank `rank` from every rank's counts ([ranks][experts]): the tokens
// of each expert that lower ranks send.
void exclusive_prefix(std::span<const int64_t> rank_counts, int64_t num_experts, int64_t rank,
                      std::span<int64_t> prefix);

// Maps one rank's batch under `adaptive`: the batch's j-th token of expert e (in token order)
// has ordinal prefix[e] + j and goes to the replica whose share covers it
// (adaptive_replica); a token of an expert without a usable replica gets slot -1.
// InvalidArgument for mismatched sizes or an expert id out of range.
void route_adaptive(const DispatchTables& tables, const AdaptiveShares& shares,
                    std::span<const int64_t> prefix, std::span<const int32_t> experts,
                    int64_t top_k, std::span<int32_t> slots);

}  // namespace eplb::routing
