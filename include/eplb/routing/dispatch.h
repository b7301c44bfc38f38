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
//
// The tables of one layer are built once per placement change (off the forward thread) and
// read by the router; they are plain arrays an engine can upload to a device as they are.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "eplb/core/hash.h"
#include "eplb/core/types.h"

namespace eplb::routing {

enum class DispatchPolicy { kStatic, kRandom, kHash, kWeighted };

// "static" | "random" | "hash" | "weighted"; else InvalidArgument listing them.
DispatchPolicy parse_dispatch_policy(std::string_view name);
std::string_view dispatch_policy_name(DispatchPolicy policy);

// Dispatch tables of one layer.
struct DispatchTables {
  int64_t experts = 0;
  int64_t ranks = 0;
  int64_t max_replicas = 0;
  std::vector<int32_t> log2phy;        // [experts][max_replicas], padded with -1
  std::vector<int32_t> replica_count;  // [experts]
  std::vector<int32_t> static_slot;    // [ranks][experts]: the slot rank g sends e to (static)
  // weighted: cumulative share thresholds in 1/2^32 units, [experts][max_replicas]; the last
  // replica's threshold is 2^32 - 1 inclusive.
  std::vector<uint32_t> cumulative_share;

  std::span<const int32_t> replicas(int64_t expert) const {
    return {log2phy.data() + expert * max_replicas, static_cast<size_t>(replica_count[expert])};
  }
};

// Builds the tables of `layer`. `replica_share` ([physical], optional) is each slot's planned
// share of its expert's load; empty means replicas share equally.
DispatchTables build_dispatch_tables(const Placement& placement, int64_t layer,
                                     const Layout& layout,
                                     std::span<const double> replica_share = {});

// The hash of `hash` dispatch: a 32-bit mix of the token index and the rank. Defined here once;
// the device kernel restates it and is tested against it.
inline uint32_t dispatch_hash(uint64_t token_index, uint32_t rank) {
  return static_cast<uint32_t>(
      mix64(token_index + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(rank) + 1)));
}

// Chooses the slot for one (token, expert) on `rank`. `random_state` is the caller's per-rank
// stream for `random` (any non-zero seed; advanced in place), unused by the others.
int32_t choose_slot(const DispatchTables& tables, DispatchPolicy policy, int32_t expert,
                    uint64_t token_index, int64_t rank, uint64_t& random_state);

// Maps a batch: experts [tokens][top_k] -> slots [tokens][top_k]. Row t is the token with
// index first_token + t (what hash and weighted dispatch hash).
void route(const DispatchTables& tables, DispatchPolicy policy, std::span<const int32_t> experts,
           int64_t top_k, std::span<int32_t> slots, uint64_t first_token, int64_t rank,
           uint64_t& random_state);

}  // namespace eplb::routing
