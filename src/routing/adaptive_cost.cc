// adaptive_cost's solver (routing/adaptive_cost.h).

#include "eplb/routing/adaptive_cost.h"

#include <algorithm>
#include <cmath>

namespace eplb::routing {
namespace {

int64_t tick(double us) { return std::llround(us * kTicksPerUs); }

}  // namespace

CostTicks cost_ticks(const placement::CostModel& model) {
  model.validate();
  CostTicks t;
  t.rank = tick(model.rank_us);
  t.slot = tick(model.slot_us);
  t.token = tick(model.token_us);
  if (model.has_knee()) {
    t.knee = std::max<int64_t>(1, std::llround(model.knee_tokens));
    t.token_above = tick(model.token_us_above);
  }
  return t;
}

int64_t adaptive_cost_workspace_words(int64_t experts, int64_t max_replicas, int64_t ranks,
                                      int64_t physical) {
  return adaptive_workspace_words(experts, ranks, physical) +  // adaptive_split's
         experts * max_replicas + experts +                    // the best shares, unit counts
         3 * physical +                                        // edge expert, rank, tokens
         (experts + 1) + (ranks + 1) + physical +              // edges by expert, by rank
         ranks;                                                // modeled rank times
}

int64_t modeled_max_rank_ticks(const AdaptiveLayer& t, const int64_t* share, const CostTicks& m,
                               int64_t* rank_time) {
  for (int64_t g = 0; g < t.ranks; ++g) rank_time[g] = m.rank;
  for (int64_t e = 0; e < t.experts; ++e) {
    for (int64_t i = 0; i < t.replica_count[e]; ++i) {
      const int64_t n = share[e * t.max_replicas + i];
      if (n > 0) rank_time[t.log2phy[e * t.max_replicas + i] / t.slots_per_rank] += m.slot_time(n);
    }
  }
  int64_t most = 0;
  for (int64_t g = 0; g < t.ranks; ++g) most = rank_time[g] > most ? rank_time[g] : most;
  return most;
}

namespace {

// The local search's arrays (adaptive_cost_split's workspace after adaptive_split's).
struct Search {
  int64_t* edge_expert;  // an edge: one expert's part on one rank
  int64_t* edge_rank;
  int64_t* edge_x;        // its tokens
  int64_t* expert_begin;  // [E + 1] edges of expert e
  int64_t* rank_begin;    // [G + 1] rank_edges of rank g
  int64_t* rank_edges;
  int64_t* cost;  // [G] modeled time, ticks
};

// Improves `share` in place (Steps 2-4 of adaptive_cost.h's search) and returns its largest
// modeled rank time in ticks.
int64_t improve(const AdaptiveLayer& t, const int64_t* counts, const CostTicks& m,
                int64_t* share, const Search& s) {
  const int64_t E = t.experts, G = t.ranks, R = t.max_replicas, spr = t.slots_per_rank;
  int64_t* edge_expert = s.edge_expert;
  int64_t* edge_rank = s.edge_rank;
  int64_t* edge_x = s.edge_x;
  int64_t* expert_begin = s.expert_begin;
  int64_t* rank_begin = s.rank_begin;
  int64_t* rank_edges = s.rank_edges;
  int64_t* cost = s.cost;

  // Step 2: one edge per (expert, rank holding a replica of it), carrying the split's tokens
  // there; the rank's modeled time with each edge's tokens on one slot.
  int64_t edges = 0;
  for (int64_t e = 0; e < E; ++e) {
    expert_begin[e] = edges;
    const int64_t r = t.replica_count[e];
    if (counts[e] <= 0 || r == 0) continue;
    for (int64_t i = 0; i < r; ++i) {
      const int64_t g = t.log2phy[e * R + i] / spr;
      int64_t j = expert_begin[e];
      while (j < edges && edge_rank[j] != g) ++j;
      if (j == edges) {
        edge_expert[edges] = e;
        edge_rank[edges] = g;
        edge_x[edges] = 0;
        ++edges;
      }
      edge_x[j] += share[e * R + i];
    }
  }
  expert_begin[E] = edges;
  for (int64_t g = 0; g <= G; ++g) rank_begin[g] = 0;
  for (int64_t j = 0; j < edges; ++j) ++rank_begin[edge_rank[j] + 1];
  for (int64_t g = 0; g < G; ++g) rank_begin[g + 1] += rank_begin[g];
  for (int64_t g = 0; g < G; ++g) cost[g] = rank_begin[g];  // fill cursor
  for (int64_t j = 0; j < edges; ++j) rank_edges[cost[edge_rank[j]]++] = j;
  for (int64_t g = 0; g < G; ++g) cost[g] = m.rank;
  for (int64_t j = 0; j < edges; ++j) cost[edge_rank[j]] += m.slot_time(edge_x[j]);

  // Step 3: local search on the rank with the largest modeled time (the lowest on a tie). Each
  // move lowers it strictly and leaves the other rank below the old top or no higher than it
  // was, so the rank times sorted in descending order fall at every move; the cap only bounds
  // the time on degenerate inputs.
  for (int64_t round = 0; round < 8 * edges + 64; ++round) {
    int64_t top_rank = 0;
    for (int64_t g = 1; g < G; ++g) top_rank = cost[g] > cost[top_rank] ? g : top_rank;
    const int64_t top = cost[top_rank];
    int64_t best = top + 1, best_from = -1, best_to = -1, best_amount = 0;
    for (int64_t q = rank_begin[top_rank]; q < rank_begin[top_rank + 1]; ++q) {
      const int64_t j = rank_edges[q];
      const int64_t xj = edge_x[j];
      if (xj <= 0) continue;
      const int64_t here = top - m.slot_time(xj);  // the top rank without this part
      const int64_t e = edge_expert[j];
      for (int64_t k = expert_begin[e]; k < expert_begin[e + 1]; ++k) {
        if (k == j) continue;
        const int64_t xk = edge_x[k];
        const int64_t other = cost[edge_rank[k]];
        const int64_t there = other - m.slot_time(xk);  // the other rank without its part
        // Moving d tokens: the top rank falls with d, the other rises with it.
        const auto side_from = [&](int64_t d) { return here + m.slot_time(xj - d); };
        const auto side_to = [&](int64_t d) { return there + m.slot_time(xk + d); };
        // A move must lower the top rank and leave the other below the old top, or no higher
        // than it was (every rank may be at the top: then a move that only lowers one of them
        // is progress too).
        const auto consider = [&](int64_t d) {
          const int64_t a = side_from(d), b = side_to(d);
          const int64_t v = a > b ? a : b;
          if (a < top && (b < top || b <= other) && v < best) {
            best = v;
            best_from = j;
            best_to = k;
            best_amount = d;
          }
        };
        consider(xj);  // all of it: the slot goes idle
        if (xj >= 2) {
          // The least d in [1, xj - 1] where the other side is at least the top's, and the one
          // before it: the best even split.
          int64_t lo = 1, hi = xj - 1;
          if (side_to(hi) < side_from(hi)) {
            lo = hi;
          } else {
            while (lo < hi) {
              const int64_t mid = lo + (hi - lo) / 2;
              if (side_to(mid) >= side_from(mid)) {
                hi = mid;
              } else {
                lo = mid + 1;
              }
            }
          }
          consider(lo);
          if (lo > 1) consider(lo - 1);
        }
      }
    }
    if (best_from < 0) break;
    const int64_t to_rank = edge_rank[best_to];
    cost[top_rank] += m.slot_time(edge_x[best_from] - best_amount) - m.slot_time(edge_x[best_from]);
    cost[to_rank] += m.slot_time(edge_x[best_to] + best_amount) - m.slot_time(edge_x[best_to]);
    edge_x[best_from] -= best_amount;
    edge_x[best_to] += best_amount;
  }

  // Step 4: each edge's tokens on the first replica of its expert on its rank.
  for (int64_t i = 0; i < E * R; ++i) share[i] = 0;
  for (int64_t j = 0; j < edges; ++j) {
    if (edge_x[j] <= 0) continue;
    const int64_t e = edge_expert[j];
    int64_t i = 0;
    while (t.log2phy[e * R + i] / spr != edge_rank[j]) ++i;
    share[e * R + i] = edge_x[j];
  }
  return modeled_max_rank_ticks(t, share, m, cost);
}

}  // namespace

int64_t adaptive_cost_split(const AdaptiveLayer& t, const int64_t* counts, const CostTicks& m,
                            int64_t* share, int64_t* work) {
  const int64_t E = t.experts, G = t.ranks, R = t.max_replicas;
  const int64_t P = G * t.slots_per_rank;
  int64_t* w = work + adaptive_workspace_words(E, G, P);
  int64_t* kept = w;  // [E][R] the best shares so far
  w += E * R;
  int64_t* unit = w;  // [E] 1 per expert with tokens and a replica
  w += E;
  Search s{};
  s.edge_expert = w;
  w += P;
  s.edge_rank = w;
  w += P;
  s.edge_x = w;
  w += P;
  s.expert_begin = w;
  w += E + 1;
  s.rank_begin = w;
  w += G + 1;
  s.rank_edges = w;
  w += P;
  s.cost = w;

  // Step 1: the token-optimal split, the answer to beat.
  if (adaptive_split(t, counts, share, work) < 0) return -1;
  int64_t best = modeled_max_rank_ticks(t, share, m, s.cost);
  for (int64_t i = 0; i < E * R; ++i) kept[i] = share[i];
  // Step 2: the search from it.
  int64_t found = improve(t, counts, m, share, s);
  if (found < best) {
    best = found;
    for (int64_t i = 0; i < E * R; ++i) kept[i] = share[i];
  }
  // Step 3: the search from the fewest activated slots: each expert's tokens all on one replica,
  // the replicas chosen so that the busiest rank activates the fewest (adaptive_split on one
  // "token" per expert). Where the fixed part dominates, that is the better start.
  for (int64_t e = 0; e < E; ++e) unit[e] = counts[e] > 0 && t.replica_count[e] > 0 ? 1 : 0;
  if (adaptive_split(t, unit, share, work) >= 0) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < t.replica_count[e]; ++i) {
        share[e * R + i] = share[e * R + i] > 0 ? counts[e] : 0;
      }
    }
    found = improve(t, counts, m, share, s);
    if (found < best) {
      best = found;
      for (int64_t i = 0; i < E * R; ++i) kept[i] = share[i];
    }
  }
  for (int64_t i = 0; i < E * R; ++i) share[i] = kept[i];
  return best;
}

}  // namespace eplb::routing
