#include "eplb/migration/scheduler.h"

#include <algorithm>
#include <numeric>

#include "eplb/core/error.h"

namespace eplb::migration {

std::vector<int32_t> Schedule::reads_of_round(int64_t round) const {
  std::vector<int32_t> out;
  for (size_t i = 0; i < round_of_read.size(); ++i) {
    if (round_of_read[i] == round) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The distinct (reader, server) pairs of a layer, and the pair of every read.
struct Pairs {
  std::vector<int32_t> reader;   // [pairs]
  std::vector<int32_t> server;   // [pairs]
  std::vector<int32_t> of_read;  // [reads]
};

// Pairs are numbered in order of first appearance among the reads, which the planner lists by
// destination slot, hence by reader.
Pairs collect_pairs(std::span<const RemoteRead> reads, int64_t ranks) {
  Pairs pairs;
  pairs.of_read.reserve(reads.size());
  for (const RemoteRead& r : reads) {
    if (r.src_rank < 0 || r.src_rank >= ranks || r.dst_rank < 0 || r.dst_rank >= ranks) {
      fail("read from rank ", r.src_rank, " to rank ", r.dst_rank, " is outside ranks [0, ", ranks,
           ")");
    }
    if (r.src_rank == r.dst_rank) fail("rank ", r.src_rank, " reads from itself");
  }
  // A dense (reader, server) table while it stays small; sorted keys beyond that.
  if (ranks <= 512) {
    std::vector<int32_t> id(static_cast<size_t>(ranks * ranks), -1);
    for (const RemoteRead& r : reads) {
      int32_t& pair = id[static_cast<size_t>(r.dst_rank) * ranks + r.src_rank];
      if (pair < 0) {
        pair = static_cast<int32_t>(pairs.reader.size());
        pairs.reader.push_back(r.dst_rank);
        pairs.server.push_back(r.src_rank);
      }
      pairs.of_read.push_back(pair);
    }
    return pairs;
  }
  std::vector<int64_t> keys;
  keys.reserve(reads.size());
  for (const RemoteRead& r : reads)
    keys.push_back(static_cast<int64_t>(r.dst_rank) * ranks + r.src_rank);
  std::vector<int64_t> unique = keys;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  std::vector<int32_t> id(unique.size(), -1);
  for (const int64_t key : keys) {
    int32_t& pair = id[std::lower_bound(unique.begin(), unique.end(), key) - unique.begin()];
    if (pair < 0) {
      pair = static_cast<int32_t>(pairs.reader.size());
      pairs.reader.push_back(static_cast<int32_t>(key / ranks));
      pairs.server.push_back(static_cast<int32_t>(key % ranks));
    }
    pairs.of_read.push_back(pair);
  }
  return pairs;
}

// Proper edge colouring of the bipartite graph readers x servers with `colours` = max degree
// colours (König). Vertices: reader g is g, server g is ranks + g. For each edge (u, v): use a
// colour free at both ends if there is one; else take a colour a free at u and b free at v,
// and swap a and b along the alternating path that starts at v with an a-edge. That path cannot
// reach u (it would close an odd cycle), so afterwards a is free at both ends.
std::vector<int32_t> colour_bipartite(const Pairs& pairs, int64_t ranks, int64_t colours) {
  const size_t edges = pairs.reader.size();
  std::vector<int32_t> colour(edges, -1);
  std::vector<int32_t> at(static_cast<size_t>(2 * ranks * colours), -1);  // [vertex][colour]
  auto slot = [&](int64_t vertex, int64_t c) -> int32_t& { return at[vertex * colours + c]; };
  auto first_free = [&](int64_t vertex) {
    int64_t c = 0;
    while (slot(vertex, c) >= 0) ++c;
    return c;
  };
  std::vector<int32_t> path;
  for (size_t e = 0; e < edges; ++e) {
    const int64_t u = pairs.reader[e];
    const int64_t v = ranks + pairs.server[e];
    // A colour free at both ends needs no recolouring; most edges find one.
    int64_t a = 0;
    while (a < colours && (slot(u, a) >= 0 || slot(v, a) >= 0)) ++a;
    if (a == colours) {
      a = first_free(u);
      const int64_t b = first_free(v);
      // Collect the a/b path from v, then swap its colours.
      path.clear();
      int64_t vertex = v, c = a;
      for (int32_t next = slot(vertex, c); next >= 0; next = slot(vertex, c)) {
        path.push_back(next);
        vertex = vertex == pairs.reader[next] ? ranks + pairs.server[next] : pairs.reader[next];
        c = c == a ? b : a;
      }
      for (const int32_t p : path) {
        slot(pairs.reader[p], colour[p]) = -1;
        slot(ranks + pairs.server[p], colour[p]) = -1;
      }
      for (const int32_t p : path) {
        colour[p] = static_cast<int32_t>(colour[p] == a ? b : a);
        slot(pairs.reader[p], colour[p]) = p;
        slot(ranks + pairs.server[p], colour[p]) = p;
      }
    }
    EPLB_CHECK(slot(u, a) < 0 && slot(v, a) < 0, "edge colouring lost its invariant");
    colour[e] = static_cast<int32_t>(a);
    slot(u, a) = static_cast<int32_t>(e);
    slot(v, a) = static_cast<int32_t>(e);
  }
  return colour;
}

// Half duplex: each pair uses one of k channels of both its ranks in its round. Greedy: pairs
// whose ranks are busiest first, each into the first round where both have room.
std::vector<int32_t> schedule_half_duplex(const Pairs& pairs, std::span<const int64_t> degree,
                                          int64_t ranks, int64_t k, int64_t& rounds) {
  const size_t edges = pairs.reader.size();
  std::vector<int32_t> order(edges);
  std::iota(order.begin(), order.end(), 0);
  auto weight = [&](int32_t e) {
    return std::max(degree[pairs.reader[e]], degree[pairs.server[e]]) * 2 * ranks +
           std::min(degree[pairs.reader[e]], degree[pairs.server[e]]);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return weight(x) > weight(y); });
  std::vector<int32_t> round(edges, -1);
  std::vector<int64_t> used;  // [rounds][ranks]
  rounds = 0;
  for (const int32_t e : order) {
    int64_t r = 0;
    for (; r < rounds; ++r) {
      if (used[r * ranks + pairs.reader[e]] < k && used[r * ranks + pairs.server[e]] < k) break;
    }
    if (r == rounds) {
      ++rounds;
      used.resize(static_cast<size_t>(rounds * ranks), 0);
    }
    ++used[r * ranks + pairs.reader[e]];
    ++used[r * ranks + pairs.server[e]];
    round[e] = static_cast<int32_t>(r);
  }
  return round;
}

}  // namespace

Schedule schedule_reads(std::span<const RemoteRead> reads, int64_t ranks,
                        const ScheduleOptions& options) {
  const int64_t k = options.peers_per_round;
  if (k < 1) fail("peers per round ", k, " must be at least 1");
  if (ranks < 1) fail("ranks ", ranks, " must be at least 1");

  // Step 1: distinct (reader, server) pairs and the degrees of every rank.
  const Pairs pairs = collect_pairs(reads, ranks);
  std::vector<int64_t> reads_from(static_cast<size_t>(ranks), 0);
  std::vector<int64_t> serves_to(static_cast<size_t>(ranks), 0);
  for (size_t e = 0; e < pairs.reader.size(); ++e) {
    ++reads_from[pairs.reader[e]];
    ++serves_to[pairs.server[e]];
  }

  Schedule schedule;
  std::vector<int32_t> round_of_pair;
  if (!options.half_duplex) {
    // Step 2 (duplex): colour with D colours, then merge colours k at a time.
    schedule.max_peers = std::max(*std::max_element(reads_from.begin(), reads_from.end()),
                                  *std::max_element(serves_to.begin(), serves_to.end()));
    round_of_pair = colour_bipartite(pairs, ranks, schedule.max_peers);
    for (int32_t& c : round_of_pair) c = static_cast<int32_t>(c / k);
    schedule.rounds = ceil_div(schedule.max_peers, k);
    schedule.lower_bound = schedule.rounds;
  } else {
    // Step 2 (half duplex): greedy rounds, and the lower bound beside them.
    std::vector<int64_t> degree(static_cast<size_t>(ranks));
    for (int64_t g = 0; g < ranks; ++g) degree[g] = reads_from[g] + serves_to[g];
    schedule.max_peers = *std::max_element(degree.begin(), degree.end());
    round_of_pair = schedule_half_duplex(pairs, degree, ranks, k, schedule.rounds);
    const int64_t per_round = ranks * k / 2;  // a round holds at most this many pairs
    schedule.lower_bound = ceil_div(schedule.max_peers, k);
    if (per_round > 0) {
      schedule.lower_bound = std::max(
          schedule.lower_bound, ceil_div(static_cast<int64_t>(pairs.reader.size()), per_round));
    }
  }

  // Step 3: every read travels in its pair's round.
  schedule.round_of_read.reserve(reads.size());
  for (const int32_t p : pairs.of_read) schedule.round_of_read.push_back(round_of_pair[p]);
  return schedule;
}

}  // namespace eplb::migration
