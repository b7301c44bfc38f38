#pragma once
// The runtime's test hooks, kept off the public API (leveldb keeps its TEST_ methods on DBImpl,
// not on DB): the runtime's tests and `eplb bench runtime --threads` (random delays) reach them
// through RebalancerTesting, a friend of Rebalancer.

#include <functional>

#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime {

// Where the delay hook is called.
enum class DelayPoint {
  kPlacement,  // worker, before computing the placement
  kRead,       // worker (forward thread in sync mode), before posting each round of reads
  kControl,    // control thread, before each collective
  kInstall,    // forward thread, inside step_end(), before each layer install (must not throw)
};

class RebalancerTesting {
 public:
  // `hook` is called at each DelayPoint, from the thread named there (so it must be
  // thread-safe). It may sleep; at kPlacement and kRead it may also throw, which fails the
  // rebalance as a worker error would. It must not throw at kControl. Set it before connect()
  // (a joining Rebalancer: before reconfigure()), while no runtime thread runs.
  static void set_delay_hook(Rebalancer& rebalancer, std::function<void(DelayPoint)> hook);
};

}  // namespace eplb::runtime
