#pragma once
// Staging one layer on this rank, the other half sync and async modes share: local copies and
// one-sided reads of peers' live weights into the staging buffer, before the layer is
// installed. Called on the worker thread (the forward thread in sync mode).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "eplb/migration/migration.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/rebalancer.h"
#include "runtime/testing.h"
#include "runtime/arena.h"
#include "runtime/monitor.h"
#include "runtime/weight_store.h"

namespace eplb::runtime {

struct StageContext {
  const WeightStore& weights;  // this rank's regions and every peer's (read only)
  const std::atomic<bool>* cancel = nullptr;  // null: never cancelled
  const std::function<void(DelayPoint)>* delay_hook = nullptr;
  PhaseTracker* progress = nullptr;  // told of each round of reads (null: nobody watches)
  int64_t rebalance = 0;             // the index the progress is told of
};

// Builds layer `layer`'s new content for this rank in the staging buffer of `map` (the weight
// store's buffer map as the rebalance found it, changed by the installs since): unchanged
// slots (arena only: with the engine's tensors they stay where they are) and local copies from
// the live weights, reads from peers' live weights round by round, then free rides within the
// staging buffer. First waits for the Config::installer's last mark, so
// nothing the engine may still read is overwritten. Local copies are memcpy on host memory and
// reads of this rank's own region (the transport's copy engine) on device memory. Restores of
// lost experts (a backup copy, read or copied, or the loader) come first of all. Nothing live
// changes on any rank. Returns false
// when cancelled (the staging buffer is then garbage); throws on a failed or late read.
bool stage_layer(const StageContext& context, const BufferMap& map, int64_t layer,
                 const migration::LayerMigration& migration);

// The bytes seat `seat` reads from peers in `migration` (its remote reads; restores apart).
inline int64_t bytes_read_by(const migration::LayerMigration& migration, int seat) {
  const std::vector<int64_t>& in = migration.plan.rank_bytes_in;
  return seat >= 0 && static_cast<size_t>(seat) < in.size() ? in[static_cast<size_t>(seat)] : 0;
}

}  // namespace eplb::runtime
