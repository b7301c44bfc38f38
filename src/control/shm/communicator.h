#pragma once
// shm: the processes of one machine share one POSIX shared-memory segment holding an arrival
// counter, a "round published" futex word, one round outcome and two message buffers per rank.
// A collective is one or more rounds: each rank writes its buffer for the round and counts
// itself in; the rank that arrives last combines (checks that every rank made the same call,
// reduces an all-reduce into the outcome) and publishes the round; the others wait for that
// (spinning briefly, then yielding, then sleeping on the futex word, woken only if one sleeps)
// and read the outcome, or the buffers they need (broadcast, all-gather). So a round reads
// O(ranks) lines, not O(ranks^2). Buffers alternate between rounds, so a buffer is rewritten
// only after every rank has moved past the round that read it. Peers that die are found from
// the pids in the segment.
//
// Ownership: the segment is shared by the group's processes; each rank writes only its own
// buffers and rank state; the outcome is written only by the combining rank of a round, before
// it publishes, and read by the others after. One communicator is one thread at a time (the
// Communicator contract).

#include <memory>

#include "eplb/control/communicator.h"

namespace eplb::control::shm {

std::unique_ptr<Communicator> connect(const Options& options);

}  // namespace eplb::control::shm
