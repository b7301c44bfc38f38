#pragma once
// The step's best split (dispatch `adaptive`, and the simulator's dispatch bound): given one
// layer's global token count of every logical expert for this step, how many of each expert's
// tokens each of its replicas receives, so that the busiest rank's load is the least any split
// over the placement in force allows (exact, in whole tokens).
//
// The problem is a flow. An expert whose replicas all sit on one rank has no choice: its count
// is that rank's fixed load. The others (the "flexible" experts) may send any part of their
// count to any rank holding one of their replicas. The least feasible largest load T is found
// by Newton steps on T: augment flow to the ranks with capacity T - fixed load (shortest paths,
// breadth first); when no path is left but tokens are, the ranks reachable from the unplaced
// tokens are all full, every token of the experts that reach them must land on them, so
// T' = ceil((those experts' counts + those ranks' fixed loads) / number of those ranks) is a
// lower bound on the optimum and above T; raise the capacities to T' and go on from the flow
// found. The last T is the optimum, and the flow at it is the split. An expert without a
// usable replica (replica_count 0, dispatch.h) takes no part: its tokens go nowhere.
//
// Deterministic: integer arithmetic only, a fixed visiting order, no allocation (the caller
// passes the workspace). The CUDA routing library runs this very function on the device
// (compiled from this header there), so every rank and every device computes the same shares
// from the same counts, bit for bit.

#include <cstdint>

#if defined(__CUDACC__)
#define EPLB_HOST_DEVICE __host__ __device__
#else
#define EPLB_HOST_DEVICE
#endif

namespace eplb::routing {

// One layer's placement as the solver reads it: the dispatch tables' arrays.
struct AdaptiveLayer {
  const int32_t* log2phy = nullptr;        // [experts][max_replicas], padded with -1
  const int32_t* replica_count = nullptr;  // [experts], each in [0, max_replicas]
  int32_t experts = 0;
  int32_t max_replicas = 0;
  int32_t ranks = 0;
  int32_t slots_per_rank = 0;  // slot p is on rank p / slots_per_rank
};

// int64 words of workspace the solver needs for `physical` = ranks x slots_per_rank slots (an
// edge is a distinct (expert, rank) pair: at most one per slot).
EPLB_HOST_DEVICE inline int64_t adaptive_workspace_words(int64_t experts, int64_t ranks,
                                                         int64_t physical) {
  return 3 * ranks + 1 +         // fixed, inflow, rank_begin[ranks + 1]
         3 * experts + 1 +       // flex_expert, remaining, edge_begin[flex + 1]
         4 * physical +          // edge_rank, edge_flow, edge_owner, rank_edges
         3 * (experts + ranks);  // parent, queue, mark of the search
}

namespace detail {

EPLB_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace detail

// Writes `share` ([experts][max_replicas], aligned with log2phy; 0 in the padding): replica i of
// expert e receives share[e][i] of counts[e] tokens, summing to counts[e] (a negative count
// counts as 0). Replicas of one expert on the same rank share its part there evenly, the first
// ones one token more. An expert with no replica (count 0) gets no share: its tokens are not
// routed and count on no rank. Returns the busiest rank's load under `share` (the optimum), or
// -1 when the tables are inconsistent (a replica count outside [0, max_replicas], a slot outside
// the ranks, or more replicas than slots), with `share` then all 0. `work` holds
// adaptive_workspace_words(experts, ranks, ranks * slots_per_rank) int64 words.
EPLB_HOST_DEVICE inline int64_t adaptive_split(const AdaptiveLayer& t, const int64_t* counts,
                                               int64_t* share, int64_t* work) {
  const int64_t E = t.experts, G = t.ranks, R = t.max_replicas;
  for (int64_t i = 0; i < E * R; ++i) share[i] = 0;
  if (E < 1 || G < 1 || R < 1 || t.slots_per_rank < 1) return -1;
  const int64_t edges_cap = G * t.slots_per_rank;
  int64_t* fixed = work;                      // [G] load of experts without choice
  int64_t* inflow = fixed + G;                // [G] flow of flexible experts into the rank
  int64_t* rank_begin = inflow + G;           // [G + 1] rank_edges of rank g
  int64_t* flex_expert = rank_begin + G + 1;  // [E] the flexible experts, in expert order
  int64_t* remaining = flex_expert + E;       // [E] tokens of flexible expert f not yet placed
  int64_t* edge_begin = remaining + E;        // [E + 1] edges of flexible expert f
  int64_t* edge_rank = edge_begin + E + 1;
  int64_t* edge_flow = edge_rank + edges_cap;
  int64_t* edge_owner = edge_flow + edges_cap;
  int64_t* rank_edges = edge_owner + edges_cap;
  int64_t* parent = rank_edges + edges_cap;  // [F + G] edge a node was reached by; -1: a root
  int64_t* queue = parent + E + G;
  int64_t* mark = queue + E + G;  // [F + G] search generation that reached the node

  // Step 1: fixed loads, and the flexible experts with an edge to each distinct rank.
  for (int64_t g = 0; g < G; ++g) fixed[g] = inflow[g] = 0;
  int64_t flex = 0, edges = 0, total = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r = t.replica_count[e];
    if (r < 0 || r > R || edges + r > edges_cap) return -1;
    for (int64_t i = 0; i < r; ++i) {
      const int64_t slot = t.log2phy[e * R + i];
      if (slot < 0 || slot / t.slots_per_rank >= G) return -1;
    }
    const int64_t w = counts[e] > 0 ? counts[e] : 0;
    if (w == 0 || r == 0) continue;  // r == 0: no usable replica, the tokens go nowhere
    total += w;
    const int64_t first = edges;
    for (int64_t i = 0; i < r; ++i) {
      const int64_t g = t.log2phy[e * R + i] / t.slots_per_rank;
      bool seen = false;
      for (int64_t j = first; j < edges; ++j) seen = seen || edge_rank[j] == g;
      if (!seen) edge_rank[edges++] = g;
    }
    if (edges - first == 1) {
      fixed[edge_rank[first]] += w;
      edges = first;
      continue;
    }
    flex_expert[flex] = e;
    remaining[flex] = w;
    edge_begin[flex] = first;
    for (int64_t j = first; j < edges; ++j) {
      edge_flow[j] = 0;
      edge_owner[j] = flex;
    }
    ++flex;
  }
  edge_begin[flex] = edges;
  // Edges grouped by rank (a counting sort, stable in edge order).
  for (int64_t g = 0; g <= G; ++g) rank_begin[g] = 0;
  for (int64_t j = 0; j < edges; ++j) ++rank_begin[edge_rank[j] + 1];
  for (int64_t g = 0; g < G; ++g) rank_begin[g + 1] += rank_begin[g];
  for (int64_t g = 0; g < G; ++g) inflow[g] = rank_begin[g];  // fill cursor, reset below
  for (int64_t j = 0; j < edges; ++j) rank_edges[inflow[edge_rank[j]]++] = j;
  for (int64_t g = 0; g < G; ++g) inflow[g] = 0;

  // Step 2: the first T, a bound no split can beat.
  int64_t T = detail::ceil_div(total, G);
  for (int64_t g = 0; g < G; ++g) T = fixed[g] > T ? fixed[g] : T;

  // Step 3: augment; when stuck, a Newton step on T. Nodes: flexible experts 0..flex-1, then
  // ranks flex..flex+G-1.
  const int64_t nodes = flex + G;
  for (int64_t n = 0; n < nodes; ++n) mark[n] = -1;
  int64_t unplaced = 0;
  for (int64_t f = 0; f < flex; ++f) unplaced += remaining[f];
  int64_t generation = 0;
  while (unplaced > 0) {
    // Breadth-first from every expert with tokens left.
    ++generation;
    int64_t head = 0, tail = 0, found = -1;
    for (int64_t f = 0; f < flex; ++f) {
      if (remaining[f] > 0) {
        mark[f] = generation;
        parent[f] = -1;
        queue[tail++] = f;
      }
    }
    while (head < tail && found < 0) {
      const int64_t n = queue[head++];
      if (n < flex) {
        for (int64_t j = edge_begin[n]; j < edge_begin[n + 1] && found < 0; ++j) {
          const int64_t g = flex + edge_rank[j];
          if (mark[g] == generation) continue;
          mark[g] = generation;
          parent[g] = j;
          if (T - fixed[g - flex] - inflow[g - flex] > 0) {
            found = g;
          } else {
            queue[tail++] = g;
          }
        }
      } else {
        const int64_t g = n - flex;
        for (int64_t k = rank_begin[g]; k < rank_begin[g + 1]; ++k) {
          const int64_t j = rank_edges[k];
          const int64_t f = edge_owner[j];
          if (edge_flow[j] <= 0 || mark[f] == generation) continue;
          mark[f] = generation;
          parent[f] = j;
          queue[tail++] = f;
        }
      }
    }
    if (found >= 0) {
      // The bottleneck: the last rank's room, the flows pushed back on the way, the root's
      // tokens. Then push it along the path.
      int64_t amount = T - fixed[found - flex] - inflow[found - flex];
      int64_t n = found;
      while (true) {
        const int64_t f = edge_owner[parent[n]];
        if (parent[f] < 0) {
          amount = remaining[f] < amount ? remaining[f] : amount;
          break;
        }
        amount = edge_flow[parent[f]] < amount ? edge_flow[parent[f]] : amount;
        n = flex + edge_rank[parent[f]];
      }
      inflow[found - flex] += amount;
      n = found;
      while (true) {
        const int64_t f = edge_owner[parent[n]];
        edge_flow[parent[n]] += amount;
        if (parent[f] < 0) {
          remaining[f] -= amount;
          break;
        }
        edge_flow[parent[f]] -= amount;
        n = flex + edge_rank[parent[f]];
      }
      unplaced -= amount;
      continue;
    }
    // Stuck: the reached ranks are full at T and must take all of the reached experts' tokens.
    int64_t load = 0, reached_ranks = 0;
    for (int64_t f = 0; f < flex; ++f) {
      if (mark[f] == generation) load += counts[flex_expert[f]];
    }
    for (int64_t g = 0; g < G; ++g) {
      if (mark[flex + g] == generation) {
        load += fixed[g];
        ++reached_ranks;
      }
    }
    if (reached_ranks == 0) return -1;  // unreachable: every flexible expert has two ranks
    const int64_t next = detail::ceil_div(load, reached_ranks);
    T = next > T + 1 ? next : T + 1;
  }

  // Step 4: the shares, replica by replica (the queue, done with, maps an expert to its index
  // among the flexible ones); then the busiest rank's load.
  int64_t* flex_of = queue;
  for (int64_t e = 0; e < E; ++e) flex_of[e] = -1;
  for (int64_t f = 0; f < flex; ++f) flex_of[flex_expert[f]] = f;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t w = counts[e] > 0 ? counts[e] : 0;
    const int64_t r = t.replica_count[e];
    if (w == 0 || r == 0) continue;
    const int64_t f = flex_of[e];
    for (int64_t i = 0; i < r; ++i) {
      const int64_t g = t.log2phy[e * R + i] / t.slots_per_rank;
      bool earlier = false;  // rank g's part was shared out at an earlier replica
      for (int64_t k = 0; k < i; ++k)
        earlier = earlier || t.log2phy[e * R + k] / t.slots_per_rank == g;
      if (earlier) continue;
      // This expert's part on rank g: its edge's flow, or all of it when it has no choice.
      int64_t part = w;
      if (f >= 0) {
        part = 0;
        for (int64_t j = edge_begin[f]; j < edge_begin[f + 1]; ++j) {
          if (edge_rank[j] == g) part = edge_flow[j];
        }
      }
      int64_t here = 0;  // replicas of e on rank g
      for (int64_t k = i; k < r; ++k) here += t.log2phy[e * R + k] / t.slots_per_rank == g;
      int64_t nth = 0;
      for (int64_t k = i; k < r; ++k) {
        if (t.log2phy[e * R + k] / t.slots_per_rank != g) continue;
        share[e * R + k] = part / here + (nth < part % here ? 1 : 0);
        ++nth;
      }
    }
  }
  int64_t most = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t load = fixed[g] + inflow[g];
    most = load > most ? load : most;
  }
  return most;
}

// The replica a token with global ordinal `q` of its expert goes to under `share` (one
// expert's row): the i with share[0] + ... + share[i-1] <= q < share[0] + ... + share[i]. An
// ordinal past the shares' sum (counts that do not cover the token) falls back to q mod count.
// -1 when count < 1 (no replica): the caller routes the token to slot -1.
EPLB_HOST_DEVICE inline int32_t adaptive_replica(const int64_t* share, int32_t count, int64_t q) {
  if (count < 1) return -1;
  int64_t cumulative = 0;
  for (int32_t i = 0; i < count; ++i) {
    cumulative += share[i];
    if (q < cumulative) return i;
  }
  return static_cast<int32_t>(q % count);
}

// The replica of dispatch `split`: rank g's k-th token of expert e (k counted from 0 in token
// order) goes to replica (k + g + e) mod count. The offset g + e spreads the ranks' remainders
// over the replicas: with one token each, consecutive ranks start on consecutive replicas, and
// no replica index is favoured across experts. -1 when count < 1 (no replica).
EPLB_HOST_DEVICE inline int32_t split_replica(int64_t ordinal, int64_t rank, int32_t expert,
                                              int32_t count) {
  if (count < 1) return -1;
  return static_cast<int32_t>((static_cast<uint64_t>(ordinal) + static_cast<uint64_t>(rank) +
                               static_cast<uint64_t>(expert)) %
                              static_cast<uint64_t>(count));
}

}  // namespace eplb::routing
