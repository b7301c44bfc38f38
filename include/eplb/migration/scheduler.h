#pragma once
// The migration scheduler: packs the remote reads of one layer into rounds.
//
// In a round every rank reads from at most k peers and serves at most k peers; all reads
// between the same (reader, server) pair travel together in one round. Two link models:
//
//   duplex (default) - a rank may read and serve in the same round. The distinct
//     (reader, server) pairs form a bipartite graph (readers on one side, servers on the
//     other), which König's theorem edge-colours with D colours, D the most distinct peers of
//     one rank in one direction. Colours are merged k at a time into rounds, so the schedule
//     has exactly ceil(D / k) rounds, which is also the lower bound: it is always optimal.
//     The colouring recolours alternating paths, O(pairs * ranks).
//   half duplex - a rank talks to at most k peers per round in both directions together. The
//     pairs form a general multigraph and the fewest rounds is NP-hard to find; the schedule
//     is greedy (busiest pairs first, each into the first round with room) and the lower bound
//     max(ceil(D / k), ceil(pairs / floor(ranks * k / 2))) is reported beside it.

#include <cstdint>
#include <span>
#include <vector>

#include "eplb/migration/planner.h"

namespace eplb::migration {

struct ScheduleOptions {
  int64_t peers_per_round = 1;  // k >= 1
  bool half_duplex = false;
};

struct Schedule {
  int64_t rounds = 0;
  int64_t lower_bound = 0;  // no schedule of these reads under these limits has fewer rounds
  int64_t max_peers = 0;    // D: the most distinct peers of one rank (per direction in duplex,
                            // both directions together in half duplex)
  std::vector<int32_t> round_of_read;  // [reads] the round of each read, in [0, rounds)

  // The indices of the reads of round r, in read order.
  std::vector<int32_t> reads_of_round(int64_t round) const;
};

// Schedules `reads` among `ranks` ranks. Throws InvalidArgument when k < 1 or a read names a
// rank outside [0, ranks) or a rank reading from itself.
Schedule schedule_reads(std::span<const RemoteRead> reads, int64_t ranks,
                        const ScheduleOptions& options);

}  // namespace eplb::migration
