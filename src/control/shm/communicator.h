#pragma once
// shm: the processes of one machine share one POSIX shared-memory segment holding an arrival
// counter (a futex word) and two message buffers per rank. A collective is one or more rounds:
// each rank writes its buffer for the round, counts itself in, and waits (spinning briefly,
// then yielding, then sleeping on the futex) until every rank has; then it reads what it needs.
// Buffers alternate between rounds, so a buffer is rewritten only after every rank has moved
// past the round that read it. Peers that die are found from the pids in the segment.

#include <memory>

#include "eplb/control/communicator.h"

namespace eplb::control::shm {

std::unique_ptr<Communicator> connect(const Options& options);

}  // namespace eplb::control::shm
