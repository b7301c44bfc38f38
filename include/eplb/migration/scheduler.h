#pragma once
// The migration scheduler: packs the remote reads of one layer into rounds.
//
// In a round every rank reads from at most k peers and serves at most k peers; reads between
// the same two ranks in one round travel together, and a round lasts as long as its largest
// such flow. Two link models:
//
//   duplex (default) - a rank may read and serve in the same round. All reads between the
//     same (reader, server) pair travel in one round. The distinct pairs form a bipartite
//     graph (readers on one side, servers on the other), which König's theorem edge-colours
//     with D colours, D the most distinct peers of one rank in one direction. Colours are
//     merged k at a time into rounds, so the schedule has exactly ceil(D / k) rounds, which is
//     also the lower bound: it is always optimal. The colouring recolours alternating paths,
//     O(pairs * ranks).
//   half duplex - a rank talks to at most k peers per round in both directions together (the
//     contention model of vLLM's migration scheduler). Each read is an edge of a multigraph on
//     the ranks; the scheduler colours the reads themselves, every colour a matching, with as
//     few colours as it can: no schedule does better than the largest number of reads one rank
//     takes part in (in plus out, divided by k), and the colouring reaches it on most layers.
//     It starts from that many colours, fills them greedily (a colour free at both ends, else
//     an interchange along an alternating path, as in Vizing's proof), moves an edge out of
//     the way when every interchange closes an odd cycle, and only opens another colour when a
//     bounded number of such moves has not placed every edge. The colours are then merged into
//     rounds: a colour joins the first round where every rank keeps at most k peers, first
//     among the rounds it does not lengthen. The link time is at most 2 * degree - 1 and
//     rounds at most the link time; the round bound max(ceil(D / k), ceil(pairs /
//     floor(ranks * k / 2))) is reported beside them. Deterministic: the moves are drawn from
//     a fixed-seed generator.

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
  // The sum over rounds of the most reads between two ranks in the round (the reads of one
  // reader from one server in duplex, of either from the other in half duplex): the time of
  // the schedule when every read takes one unit and a round ends with its largest flow.
  int64_t link_time = 0;
  // No schedule under these limits has a shorter link time: the most reads one rank takes part
  // in, per direction in duplex (max of in, out), both together in half duplex, divided by k
  // and rounded up.
  int64_t link_time_lower_bound = 0;
  std::vector<int32_t> round_of_read;  // [reads] the round of each read, in [0, rounds)

  // The indices of the reads of round r, in read order.
  std::vector<int32_t> reads_of_round(int64_t round) const;
};

// Schedules `reads` among `ranks` ranks. Throws InvalidArgument when k < 1 or a read names a
// rank outside [0, ranks) or a rank reading from itself.
Schedule schedule_reads(std::span<const RemoteRead> reads, int64_t ranks,
                        const ScheduleOptions& options);

}  // namespace eplb::migration
