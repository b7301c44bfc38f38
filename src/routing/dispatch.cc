#include "eplb/routing/dispatch.h"

#include <algorithm>
#include <cmath>

#include "eplb/core/error.h"
#include "eplb/routing/adaptive.h"

namespace eplb::routing {

DispatchPolicy parse_dispatch_policy(std::string_view name) {
  if (name == "static") return DispatchPolicy::kStatic;
  if (name == "random") return DispatchPolicy::kRandom;
  if (name == "hash") return DispatchPolicy::kHash;
  if (name == "weighted") return DispatchPolicy::kWeighted;
  if (name == "split") return DispatchPolicy::kSplit;
  if (name == "adaptive") return DispatchPolicy::kAdaptive;
  if (name == "adaptive_cost") return DispatchPolicy::kAdaptiveCost;
  fail("unknown dispatch policy '", name,
       "' (expected static, random, hash, weighted, split, adaptive or adaptive_cost)");
}

std::string_view dispatch_policy_name(DispatchPolicy policy) {
  switch (policy) {
    case DispatchPolicy::kStatic:
      return "static";
    case DispatchPolicy::kRandom:
      return "random";
    case DispatchPolicy::kHash:
      return "hash";
    case DispatchPolicy::kWeighted:
      return "weighted";
    case DispatchPolicy::kSplit:
      return "split";
    case DispatchPolicy::kAdaptive:
      return "adaptive";
    case DispatchPolicy::kAdaptiveCost:
      return "adaptive_cost";
  }
  return "?";
}

namespace {

// Step 2 of the tables: the static choice of every (rank, expert). A rank with a replica
// uses it; ranks without one use a replica of their node, spread round-robin over that node's
// replicas; ranks whose node has none are spread round-robin over all replicas. An expert
// without a replica keeps -1 on every rank.
void fill_static(DispatchTables& t, const Layout& layout) {
  const int64_t G = layout.ranks;
  t.static_slot.assign(static_cast<size_t>(G * t.experts), -1);
  std::vector<int32_t> on_node;
  for (int64_t e = 0; e < t.experts; ++e) {
    const std::span<const int32_t> reps = t.replicas(e);
    if (reps.empty()) continue;
    int64_t far_ranks = 0;
    for (int64_t n = 0; n < layout.nodes; ++n) {
      on_node.clear();
      for (int32_t slot : reps) {
        if (layout.node_of_slot(slot) == n) on_node.push_back(slot);
      }
      int64_t near_ranks = 0;
      for (int64_t g = n * layout.ranks_per_node(); g < (n + 1) * layout.ranks_per_node(); ++g) {
        int32_t chosen = -1;
        for (int32_t slot : on_node) {
          if (layout.rank_of_slot(slot) == g) {
            chosen = slot;
            break;
          }
        }
        if (chosen < 0 && !on_node.empty()) {
          chosen =
              on_node[static_cast<size_t>(near_ranks++ % static_cast<int64_t>(on_node.size()))];
        }
        if (chosen < 0) {
          chosen = reps[static_cast<size_t>(far_ranks++ % static_cast<int64_t>(reps.size()))];
        }
        t.static_slot[g * t.experts + e] = chosen;
      }
    }
  }
}

// Step 3: cumulative shares for weighted dispatch, in 1/2^32 units.
void fill_weighted(DispatchTables& t, std::span<const double> share) {
  t.cumulative_share.assign(static_cast<size_t>(t.experts * t.max_replicas), 0xFFFFFFFFu);
  for (int64_t e = 0; e < t.experts; ++e) {
    const std::span<const int32_t> reps = t.replicas(e);
    double total = 0;
    for (int32_t slot : reps) total += share.empty() ? 1.0 : share[slot];
    double cumulative = 0;
    for (size_t i = 0; i < reps.size(); ++i) {
      double s = share.empty() ? 1.0 : share[reps[i]];
      if (total <= 0) s = 1.0, total = static_cast<double>(reps.size());
      cumulative += s;
      const double scaled = std::floor(cumulative / total * 4294967296.0) - 1.0;
      uint32_t threshold = static_cast<uint32_t>(std::clamp(scaled, 0.0, 4294967295.0));
      if (i + 1 == reps.size()) threshold = 0xFFFFFFFFu;
      t.cumulative_share[e * t.max_replicas + static_cast<int64_t>(i)] = threshold;
    }
  }
}

inline int32_t pick_uniform(const DispatchTables& t, int32_t expert, uint32_t u) {
  const uint64_t count = static_cast<uint64_t>(t.replica_count[expert]);
  return t.log2phy[expert * t.max_replicas + static_cast<int64_t>((u * count) >> 32)];
}

inline uint64_t next_random(uint64_t& state) {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1Dull;
}

}  // namespace

DispatchTables build_dispatch_tables(const Placement& placement, int64_t layer,
                                     const Layout& layout, std::span<const double> replica_share,
                                     std::span<const uint8_t> usable) {
  layout.validate();
  EPLB_CHECK(layer >= 0 && layer < placement.layers, "layer ", layer, " is outside [0, ",
             placement.layers, ")");
  EPLB_CHECK(placement.experts == layout.experts && placement.physical == layout.physical,
             "the placement (", placement.experts, " experts, ", placement.physical,
             " slots) does not fit the layout ", layout.describe());
  EPLB_CHECK(replica_share.empty() || static_cast<int64_t>(replica_share.size()) == layout.physical,
             "replica_share has ", replica_share.size(), " entries, expected one per slot (",
             layout.physical, ")");
  for (double s : replica_share) {
    if (!(s >= 0) || !std::isfinite(s)) fail("replica share ", s, " must be finite and >= 0");
  }
  EPLB_CHECK(usable.empty() || static_cast<int64_t>(usable.size()) == layout.physical,
             "usable has ", usable.size(), " entries, expected one per slot (", layout.physical,
             ")");

  // Step 1: log2phy and counts of this layer, replicas in the placement's order; with `usable`,
  // the usable replicas only, closed up to the front of the row.
  DispatchTables t;
  t.experts = placement.experts;
  t.ranks = layout.ranks;
  t.max_replicas = placement.max_replicas;
  t.slots_per_rank = layout.slots_per_rank();
  const auto counts = placement.layer_replica_count(layer);
  t.replica_count.assign(counts.begin(), counts.end());
  const size_t width = static_cast<size_t>(t.experts * t.max_replicas);
  t.log2phy.assign(placement.log2phy.begin() + static_cast<std::ptrdiff_t>(layer * width),
                   placement.log2phy.begin() + static_cast<std::ptrdiff_t>((layer + 1) * width));
  if (!usable.empty()) {
    for (int64_t e = 0; e < t.experts; ++e) {
      int32_t* row = t.log2phy.data() + e * t.max_replicas;
      int32_t kept = 0;
      for (int32_t i = 0; i < t.replica_count[e]; ++i) {
        if (usable[static_cast<size_t>(row[i])] != 0) row[kept++] = row[i];
      }
      std::fill(row + kept, row + t.max_replicas, -1);
      t.replica_count[e] = kept;
    }
  }

  fill_static(t, layout);
  fill_weighted(t, replica_share);
  return t;
}

std::vector<int32_t> unavailable_experts(const DispatchTables& tables) {
  std::vector<int32_t> out;
  for (int64_t e = 0; e < tables.experts; ++e) {
    if (tables.replica_count[e] == 0) out.push_back(static_cast<int32_t>(e));
  }
  return out;
}

int32_t choose_slot(const DispatchTables& t, DispatchPolicy policy, int32_t expert,
                    uint64_t token_index, int64_t rank, uint64_t& random_state) {
  // No usable replica: the token goes nowhere (the engine drops this expert's contribution).
  // Adaptive still throws below: that is a wrong call, whatever the expert.
  if (t.replica_count[expert] == 0 && !routes_by_shares(policy)) return -1;
  switch (policy) {
    case DispatchPolicy::kStatic:
      return t.static_slot[rank * t.experts + expert];
    case DispatchPolicy::kRandom:
      return pick_uniform(t, expert, static_cast<uint32_t>(next_random(random_state) >> 32));
    case DispatchPolicy::kHash:
      return pick_uniform(t, expert, dispatch_hash(token_index, static_cast<uint32_t>(rank)));
    case DispatchPolicy::kWeighted: {
      const uint32_t u = dispatch_hash(token_index, static_cast<uint32_t>(rank));
      const uint32_t* thresholds = t.cumulative_share.data() + expert * t.max_replicas;
      int64_t i = 0;
      while (u > thresholds[i]) ++i;
      return t.log2phy[expert * t.max_replicas + i];
    }
    case DispatchPolicy::kSplit:
      return t
          .log2phy[expert * t.max_replicas + split_replica(static_cast<int64_t>(token_index), rank,
                                                           expert, t.replica_count[expert])];
    case DispatchPolicy::kAdaptive:
    case DispatchPolicy::kAdaptiveCost:
      fail(dispatch_policy_name(policy),
           " dispatch needs the step's shares: call adaptive_shares() (adaptive_cost_shares() "
           "for adaptive_cost) and route_adaptive() instead of choose_slot()/route()");
  }
  return -1;
}

void route(const DispatchTables& tables, DispatchPolicy policy, std::span<const int32_t> experts,
           int64_t top_k, std::span<int32_t> slots, uint64_t first_token, int64_t rank,
           uint64_t& random_state) {
  EPLB_CHECK(top_k >= 1 && experts.size() % static_cast<size_t>(top_k) == 0,
             "route: ", experts.size(), " expert ids are not a whole number of tokens of top_k ",
             top_k);
  EPLB_CHECK(experts.size() == slots.size(), "route: ", experts.size(), " experts but ",
             slots.size(), " slots to fill");
  EPLB_CHECK(rank >= 0 && rank < tables.ranks, "route: rank ", rank, " outside [0, ", tables.ranks,
             ")");
  if (routes_by_shares(policy)) {
    fail("route: ", dispatch_policy_name(policy),
         " dispatch needs the step's shares: call adaptive_shares() (adaptive_cost_shares() for "
         "adaptive_cost) and route_adaptive()");
  }
  if (random_state == 0) random_state = 0x853C49E6748FEA9Bull;
  const size_t n = experts.size();
  const size_t k = static_cast<size_t>(top_k);
  std::vector<int64_t> ordinal;  // split: tokens of each expert seen so far in this batch
  if (policy == DispatchPolicy::kSplit) ordinal.assign(static_cast<size_t>(tables.experts), 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= tables.experts) {
      fail("route: expert id ", e, " at position ", i, " is outside [0, ", tables.experts, ")");
    }
    const uint64_t index = policy == DispatchPolicy::kSplit
                               ? static_cast<uint64_t>(ordinal[static_cast<size_t>(e)]++)
                               : first_token + i / k;
    slots[i] = choose_slot(tables, policy, e, index, rank, random_state);
  }
}

AdaptiveLayer adaptive_layer(const DispatchTables& t) {
  return {.log2phy = t.log2phy.data(),
          .replica_count = t.replica_count.data(),
          .experts = static_cast<int32_t>(t.experts),
          .max_replicas = static_cast<int32_t>(t.max_replicas),
          .ranks = static_cast<int32_t>(t.ranks),
          .slots_per_rank = static_cast<int32_t>(t.slots_per_rank)};
}

void adaptive_shares(const DispatchTables& tables, std::span<const int64_t> global_counts,
                     AdaptiveShares& out) {
  EPLB_CHECK(static_cast<int64_t>(global_counts.size()) == tables.experts,
             "adaptive_shares: ", global_counts.size(),
             " counts, expected one per logical expert (", tables.experts, ")");
  for (size_t e = 0; e < global_counts.size(); ++e) {
    if (global_counts[e] < 0) {
      fail("adaptive_shares: expert ", e, " has count ", global_counts[e],
           " (counts are tokens, >= 0)");
    }
  }
  out.share.resize(static_cast<size_t>(tables.experts * tables.max_replicas));
  out.work.resize(static_cast<size_t>(adaptive_workspace_words(
      tables.experts, tables.ranks, tables.ranks * tables.slots_per_rank)));
  out.max_rank_load = adaptive_split(adaptive_layer(tables), global_counts.data(), out.share.data(),
                                     out.work.data());
  EPLB_CHECK(out.max_rank_load >= 0, "adaptive_shares: the dispatch tables of ", tables.experts,
             " experts on ", tables.ranks, " ranks of ", tables.slots_per_rank,
             " slots are inconsistent (a replica count outside [0, ", tables.max_replicas,
             "] or a slot outside [0, ", tables.ranks * tables.slots_per_rank,
             ")): build them with build_dispatch_tables");
}

void adaptive_cost_shares(const DispatchTables& tables, std::span<const int64_t> global_counts,
                          const CostTicks& ticks, AdaptiveShares& out) {
  EPLB_CHECK(static_cast<int64_t>(global_counts.size()) == tables.experts,
             "adaptive_cost_shares: ", global_counts.size(),
             " counts, expected one per logical expert (", tables.experts, ")");
  int64_t total = 0;
  for (size_t e = 0; e < global_counts.size(); ++e) {
    if (global_counts[e] < 0) {
      fail("adaptive_cost_shares: expert ", e, " has count ", global_counts[e],
           " (counts are tokens, >= 0)");
    }
    total += global_counts[e];
  }
  // Every modeled time is at most rank + physical * slot + total * (largest per-token ticks).
  const int64_t per_token = std::max(ticks.token, ticks.token_above);
  const int64_t physical = tables.ranks * tables.slots_per_rank;
  constexpr int64_t kLimit = int64_t{1} << 62;
  if (ticks.rank < 0 || ticks.slot < 0 || ticks.token < 0 || ticks.token_above < 0 ||
      (per_token > 0 && total > kLimit / 4 / per_token) ||
      (ticks.slot > 0 && physical > kLimit / 4 / ticks.slot) || ticks.rank > kLimit / 4) {
    fail("adaptive_cost_shares: ", total, " tokens under a model of ", per_token,
         " ticks per token and ", ticks.slot,
         " per slot would pass 2^62 ticks of modeled time (build the ticks with cost_ticks())");
  }
  out.share.resize(static_cast<size_t>(tables.experts * tables.max_replicas));
  out.work.resize(static_cast<size_t>(adaptive_cost_workspace_words(
      tables.experts, tables.max_replicas, tables.ranks, physical)));
  out.modeled_ticks = adaptive_cost_split(adaptive_layer(tables), global_counts.data(),
                                          ticks, out.share.data(), out.work.data());
  EPLB_CHECK(out.modeled_ticks >= 0, "adaptive_cost_shares: the dispatch tables of ",
             tables.experts, " experts on ", tables.ranks, " ranks of ", tables.slots_per_rank,
             " slots are inconsistent: build them with build_dispatch_tables");
  // The busiest rank's tokens under these shares (the rank times are in the workspace's tail,
  // but tokens are what max_rank_load reports).
  std::fill(out.work.begin(), out.work.begin() + tables.ranks, 0);
  int64_t most = 0;
  for (int64_t e = 0; e < tables.experts; ++e) {
    for (int64_t i = 0; i < tables.replica_count[e]; ++i) {
      const int64_t g = tables.log2phy[e * tables.max_replicas + i] / tables.slots_per_rank;
      out.work[g] += out.share[e * tables.max_replicas + i];
      most = std::max(most, out.work[g]);
    }
  }
  out.max_rank_load = most;
}

void count_experts(std::span<const int32_t> experts, int64_t num_experts,
                   std::span<int64_t> counts) {
  EPLB_CHECK(static_cast<int64_t>(counts.size()) == num_experts, "count_experts: ", counts.size(),
             " counters for ", num_experts, " experts");
  for (size_t i = 0; i < experts.size(); ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= num_experts) {
      fail("count_experts: expert id ", e, " at position ", i, " is outside [0, ", num_experts,
           ")");
    }
    ++counts[static_cast<size_t>(e)];
  }
}

void exclusive_prefix(std::span<const int64_t> rank_counts, int64_t num_experts, int64_t rank,
                      std::span<int64_t> prefix) {
  EPLB_CHECK(num_experts >= 1 && rank_counts.size() % static_cast<size_t>(num_experts) == 0,
             "exclusive_prefix: ", rank_counts.size(), " counts are not [ranks][", num_experts,
             "]");
  const auto ranks = static_cast<int64_t>(rank_counts.size()) / num_experts;
  EPLB_CHECK(rank >= 0 && rank < ranks, "exclusive_prefix: rank ", rank, " outside [0, ", ranks,
             ")");
  EPLB_CHECK(static_cast<int64_t>(prefix.size()) == num_experts,
             "exclusive_prefix: ", prefix.size(), " outputs for ", num_experts, " experts");
  std::fill(prefix.begin(), prefix.end(), 0);
  for (int64_t g = 0; g < rank; ++g) {
    for (int64_t e = 0; e < num_experts; ++e) prefix[e] += rank_counts[g * num_experts + e];
  }
}

void route_adaptive(const DispatchTables& tables, const AdaptiveShares& shares,
                    std::span<const int64_t> prefix, std::span<const int32_t> experts,
                    int64_t top_k, std::span<int32_t> slots) {
  EPLB_CHECK(top_k >= 1 && experts.size() % static_cast<size_t>(top_k) == 0,
             "route_adaptive: ", experts.size(),
             " expert ids are not a whole number of tokens of top_k ", top_k);
  EPLB_CHECK(experts.size() == slots.size(), "route_adaptive: ", experts.size(), " experts but ",
             slots.size(), " slots to fill");
  EPLB_CHECK(static_cast<int64_t>(prefix.size()) == tables.experts, "route_adaptive: prefix has ",
             prefix.size(), " entries, expected one per logical expert (", tables.experts, ")");
  EPLB_CHECK(shares.share.size() == static_cast<size_t>(tables.experts * tables.max_replicas),
             "route_adaptive: the shares (", shares.share.size(),
             " entries) are not of these tables; compute them with adaptive_shares()");
  std::vector<int64_t> ordinal(prefix.begin(), prefix.end());
  const int64_t R = tables.max_replicas;
  for (size_t i = 0; i < experts.size(); ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= tables.experts) {
      fail("route_adaptive: expert id ", e, " at position ", i, " is outside [0, ", tables.experts,
           ")");
    }
    const int32_t replica =
        adaptive_replica(shares.share.data() + e * R, tables.replica_count[e], ordinal[e]++);
    slots[i] = replica < 0 ? -1 : tables.log2phy[e * R + replica];
  }
}

}  // namespace eplb::routing
