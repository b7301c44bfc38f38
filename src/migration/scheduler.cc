#include "eplb/migration/scheduler.h"

#include <algorithm>
#include <deque>
#include <numeric>
#include <unordered_map>
#include <utility>

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

// A small deterministic generator (splitmix64): the same draws on every platform and every
// run, which the standard distributions do not promise.
class Draws {
 public:
  explicit Draws(uint64_t seed) : state_(seed) {}
  uint64_t below(uint64_t n) {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (z ^ (z >> 31)) % n;
  }

 private:
  uint64_t state_;
};

// A proper edge colouring of a multigraph: edge e joins end_a[e] and end_b[e] (never the same
// vertex), every colour is a matching. Owns its tables; single-threaded.
class MultigraphColouring {
 public:
  static constexpr int64_t kInterchangeTries = 64;

  MultigraphColouring(std::span<const int32_t> end_a, std::span<const int32_t> end_b,
                      int64_t vertices, int64_t colours)
      : a_(end_a), b_(end_b), vertices_(vertices), colours_(colours),
        at_(static_cast<size_t>(vertices * colours), -1), colour_(end_a.size(), -1) {}

  int64_t colours() const { return colours_; }
  const std::vector<int32_t>& colour() const { return colour_; }

  // Colours edge e (uncoloured) without a new colour if it can: a colour free at both ends,
  // else an interchange of two colours along an alternating path. False: every such path runs
  // from one end to the other (it would close an odd cycle with e).
  bool place(int32_t e) {
    const int32_t u = a_[e], v = b_[e];
    for (int64_t c = 0; c < colours_; ++c) {
      if (at(u, c) < 0 && at(v, c) < 0) {
        set(e, c);
        return true;
      }
    }
    // x free at u (used at v), y free at v (used at u). The x/y path from v that starts with
    // v's x-edge never comes back to v and reaches u only as its last vertex (u has no x-edge).
    // Where it ends elsewhere, swapping its colours frees x at v, and x is still free at u.
    // Stuck at the fewest colours, an end has few free colours; with many more colours than
    // edges at an end (an odd cycle of many reads forced them), trying every pair would cost
    // colours^2 paths per edge: a few dozen pairs find a path when one is easy to find.
    int64_t tries = kInterchangeTries;
    for (int64_t x = 0; x < colours_ && tries > 0; ++x) {
      if (at(u, x) >= 0) continue;
      for (int64_t y = 0; y < colours_ && tries > 0; ++y) {
        if (at(v, y) >= 0) continue;
        --tries;
        path_.clear();
        int64_t vertex = v, c = x;
        for (int32_t next = at(vertex, c); next >= 0; next = at(vertex, c)) {
          path_.push_back(next);
          vertex = other(next, vertex);
          c = c == x ? y : x;
        }
        if (vertex == u) continue;
        for (const int32_t f : path_) clear(f);
        for (size_t i = 0; i < path_.size(); ++i) set(path_[i], i % 2 == 0 ? y : x);
        set(e, x);
        return true;
      }
    }
    return false;
  }

  // Colours edge e (uncoloured) with a colour free at one of its ends, taking that colour from
  // the edge that holds it at the other end, which is returned uncoloured. The colour is drawn
  // among all such choices.
  int32_t displace(int32_t e, Draws& draws) {
    const int32_t u = a_[e], v = b_[e];
    // Each end has a free colour (it has fewer than `colours_` coloured edges while e is not);
    // none is free at both, or place() would have used it.
    choices_.clear();
    for (int64_t c = 0; c < colours_; ++c) {
      if (at(u, c) < 0) choices_.push_back(at(v, c));
      if (at(v, c) < 0) choices_.push_back(at(u, c));
    }
    const int32_t out = choices_[draws.below(choices_.size())];
    const int64_t c = colour_[out];
    clear(out);
    set(e, c);
    return out;
  }

  // One more colour, free everywhere.
  void add_colour() {
    std::vector<int32_t> wider(static_cast<size_t>(vertices_ * (colours_ + 1)), -1);
    for (int64_t x = 0; x < vertices_; ++x) {
      std::copy_n(at_.begin() + x * colours_, colours_, wider.begin() + x * (colours_ + 1));
    }
    at_ = std::move(wider);
    ++colours_;
  }

 private:
  int32_t& at(int64_t vertex, int64_t c) { return at_[static_cast<size_t>(vertex * colours_ + c)]; }
  int32_t other(int32_t e, int64_t vertex) const { return a_[e] == vertex ? b_[e] : a_[e]; }
  void set(int32_t e, int64_t c) {
    colour_[e] = static_cast<int32_t>(c);
    at(a_[e], c) = e;
    at(b_[e], c) = e;
  }
  void clear(int32_t e) {
    at(a_[e], colour_[e]) = -1;
    at(b_[e], colour_[e]) = -1;
    colour_[e] = -1;
  }

  std::span<const int32_t> a_, b_;
  int64_t vertices_;
  int64_t colours_;
  std::vector<int32_t> at_;      // [vertices][colours] the edge of each colour at a vertex, or -1
  std::vector<int32_t> colour_;  // [edges] -1: not coloured yet
  std::vector<int32_t> path_, choices_;  // scratch
};

// Colours the reads (edges reader - server) with few colours, every colour a matching. Starts
// from the largest degree, the fewest possible; edges at the busiest ranks go first. An edge
// that neither a free colour nor an interchange places displaces another (drawn at random),
// which goes back in the queue; after a bounded number of displacements a colour is added (free
// everywhere, it places the edge at once). The displacements are bounded in all (O(edges)), and
// the colours by 2 * degree - 1, where no edge can be stuck.
std::vector<int32_t> colour_reads(std::span<const int32_t> reader, std::span<const int32_t> server,
                                  int64_t ranks, int64_t& colours) {
  const size_t edges = reader.size();
  std::vector<int64_t> degree(static_cast<size_t>(ranks), 0);
  for (size_t e = 0; e < edges; ++e) {
    ++degree[reader[e]];
    ++degree[server[e]];
  }
  const int64_t delta = edges == 0 ? 0 : *std::max_element(degree.begin(), degree.end());
  std::vector<int32_t> order(edges);
  std::iota(order.begin(), order.end(), 0);
  auto weight = [&](int32_t e) {
    const int64_t hi = std::max(degree[reader[e]], degree[server[e]]);
    const int64_t lo = std::min(degree[reader[e]], degree[server[e]]);
    return hi * (delta + 1) + lo;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return weight(x) > weight(y); });

  MultigraphColouring colouring(reader, server, ranks, delta);
  Draws draws(0x5eed5eed5eed5eedULL);
  // The moves allowed before another colour opens: many for the first colour count (where most
  // layers end), half as many for each next one, so at most twice the first in all.
  int64_t allowance = 8 * static_cast<int64_t>(edges) + 256;
  int64_t moves = allowance;
  std::deque<int32_t> pending(order.begin(), order.end());
  while (!pending.empty()) {
    const int32_t e = pending.front();
    pending.pop_front();
    if (colouring.place(e)) continue;
    if (moves == 0) {
      colouring.add_colour();
      allowance /= 2;
      moves = allowance;
      EPLB_CHECK(colouring.place(e), "a new colour did not place an edge");
      continue;
    }
    --moves;
    pending.push_back(colouring.displace(e, draws));
  }
  colours = colouring.colours();
  return colouring.colour();
}

// One round of a half-duplex schedule being built: the flows of each rank in it (a peer it reads
// from: the peer's rank; a peer it serves: -1 - the peer's rank) and the reads of each pair of
// ranks (either way), whose largest count is the round's length.
struct Round {
  std::unordered_map<int32_t, std::vector<int32_t>> flows;
  std::unordered_map<int64_t, int32_t> reads_of_pair;
  int32_t length = 0;
};

// Merges colours (each a matching of reads) into rounds: a colour joins the first round where
// every rank keeps at most k flows and no pair grows past the round's length, else the first
// where every rank keeps at most k flows, else a new round. A flow is directed, as vLLM counts
// them: at k = 1 a rank reads from one peer or serves one peer in a round, never both. Merging
// never lengthens the schedule: a round's length grows by at most the colour's, which is 1.
std::vector<int32_t> merge_colours(std::span<const int32_t> colour, int64_t colours,
                                   std::span<const int32_t> reader,
                                   std::span<const int32_t> server, int64_t ranks, int64_t k,
                                   int64_t& rounds) {
  std::vector<std::vector<int32_t>> edges_of(static_cast<size_t>(colours));
  for (size_t e = 0; e < colour.size(); ++e) edges_of[colour[e]].push_back(static_cast<int32_t>(e));
  auto key = [&](int32_t e) {
    return static_cast<int64_t>(std::min(reader[e], server[e])) * ranks +
           std::max(reader[e], server[e]);
  };
  // Whether rank g may have `flow` in round r: already has it, or has room for one more.
  auto room = [&](const Round& r, int32_t g, int32_t flow) {
    const auto it = r.flows.find(g);
    if (it == r.flows.end()) return true;
    return std::find(it->second.begin(), it->second.end(), flow) != it->second.end() ||
           static_cast<int64_t>(it->second.size()) < k;
  };
  auto fits = [&](const Round& r, const std::vector<int32_t>& edges, bool keep_length) {
    for (const int32_t e : edges) {
      if (!room(r, reader[e], server[e]) || !room(r, server[e], -1 - reader[e])) return false;
      if (keep_length) {
        const auto it = r.reads_of_pair.find(key(e));
        if ((it == r.reads_of_pair.end() ? 0 : it->second) + 1 > r.length) return false;
      }
    }
    return true;
  };
  std::vector<Round> built;
  std::vector<int32_t> round_of_colour(static_cast<size_t>(colours), -1);
  for (int64_t c = 0; c < colours; ++c) {
    const std::vector<int32_t>& edges = edges_of[c];
    if (edges.empty()) continue;
    size_t r = 0;
    while (r < built.size() && !fits(built[r], edges, true)) ++r;
    if (r == built.size()) {
      r = 0;
      while (r < built.size() && !fits(built[r], edges, false)) ++r;
    }
    if (r == built.size()) built.emplace_back();
    Round& round = built[r];
    for (const int32_t e : edges) {
      for (const auto& [g, flow] : {std::pair{reader[e], server[e]},
                                    std::pair{server[e], -1 - reader[e]}}) {
        std::vector<int32_t>& f = round.flows[g];
        if (std::find(f.begin(), f.end(), flow) == f.end()) f.push_back(flow);
      }
      round.length = std::max(round.length, ++round.reads_of_pair[key(e)]);
    }
    round_of_colour[c] = static_cast<int32_t>(r);
  }
  rounds = static_cast<int64_t>(built.size());
  std::vector<int32_t> round_of_read(colour.size());
  for (size_t e = 0; e < colour.size(); ++e) round_of_read[e] = round_of_colour[colour[e]];
  return round_of_read;
}

// The sum over rounds of the most reads between two ranks in the round: between a reader and
// a server (directed), or between two ranks either way (half duplex).
int64_t link_time(std::span<const RemoteRead> reads, std::span<const int32_t> round_of_read,
                  int64_t ranks, bool directed) {
  std::vector<std::pair<int32_t, int64_t>> keys;  // (round, pair)
  keys.reserve(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const RemoteRead& r = reads[i];
    const int64_t a = directed ? r.dst_rank : std::min(r.src_rank, r.dst_rank);
    const int64_t b = directed ? r.src_rank : std::max(r.src_rank, r.dst_rank);
    keys.emplace_back(round_of_read[i], a * ranks + b);
  }
  std::sort(keys.begin(), keys.end());
  int64_t total = 0, longest = 0, run = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    run = (i > 0 && keys[i] == keys[i - 1]) ? run + 1 : 1;
    longest = std::max(longest, run);
    if (i + 1 == keys.size() || keys[i + 1].first != keys[i].first) {
      total += longest;
      longest = 0;
    }
  }
  return total;
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
  std::vector<int64_t> reads_in(static_cast<size_t>(ranks), 0);
  std::vector<int64_t> reads_out(static_cast<size_t>(ranks), 0);
  for (const RemoteRead& r : reads) {
    ++reads_in[r.dst_rank];
    ++reads_out[r.src_rank];
  }
  if (!options.half_duplex) {
    // Step 2 (duplex): colour the pairs with D colours, merge colours k at a time, and every
    // read travels in its pair's round.
    schedule.max_peers = std::max(*std::max_element(reads_from.begin(), reads_from.end()),
                                  *std::max_element(serves_to.begin(), serves_to.end()));
    std::vector<int32_t> round_of_pair = colour_bipartite(pairs, ranks, schedule.max_peers);
    for (int32_t& c : round_of_pair) c = static_cast<int32_t>(c / k);
    schedule.rounds = ceil_div(schedule.max_peers, k);
    schedule.lower_bound = schedule.rounds;
    schedule.round_of_read.reserve(reads.size());
    for (const int32_t p : pairs.of_read) schedule.round_of_read.push_back(round_of_pair[p]);
    int64_t most = 0;
    for (int64_t g = 0; g < ranks; ++g) most = std::max({most, reads_in[g], reads_out[g]});
    schedule.link_time_lower_bound = ceil_div(most, k);
  } else {
    // Step 2 (half duplex): colour the reads themselves, merge the colours into rounds, and
    // the bounds beside them.
    std::vector<int64_t> degree(static_cast<size_t>(ranks));
    for (int64_t g = 0; g < ranks; ++g) degree[g] = reads_from[g] + serves_to[g];
    schedule.max_peers = *std::max_element(degree.begin(), degree.end());
    std::vector<int32_t> reader, server;
    reader.reserve(reads.size());
    server.reserve(reads.size());
    for (const RemoteRead& r : reads) {
      reader.push_back(r.dst_rank);
      server.push_back(r.src_rank);
    }
    int64_t colours = 0;
    const std::vector<int32_t> colour = colour_reads(reader, server, ranks, colours);
    schedule.round_of_read =
        merge_colours(colour, colours, reader, server, ranks, k, schedule.rounds);
    const int64_t per_round = ranks * k / 2;  // a round holds at most this many pairs
    schedule.lower_bound = ceil_div(schedule.max_peers, k);
    if (per_round > 0) {
      schedule.lower_bound = std::max(
          schedule.lower_bound, ceil_div(static_cast<int64_t>(pairs.reader.size()), per_round));
    }
    int64_t most = 0;
    for (int64_t g = 0; g < ranks; ++g) most = std::max(most, reads_in[g] + reads_out[g]);
    schedule.link_time_lower_bound = ceil_div(most, k);
  }

  // Step 3: the link time of the schedule.
  schedule.link_time =
      link_time(reads, schedule.round_of_read, ranks, /*directed=*/!options.half_duplex);
  return schedule;
}

}  // namespace eplb::migration
