#pragma once
// The rebalance in flight, as the forward thread, the worker and the control thread share it
// (async mode): Active, and the agreements the forward thread has contributed and not yet acted
// on. Every field says which thread writes it and how it is handed over.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "eplb/core/types.h"
#include "runtime/arena.h"
#include "runtime/compute.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"

namespace eplb::runtime {

// The state one rebalance shares between the forward thread and the worker (async mode).
//   written by the worker, read by the forward thread after an acquire load of `progress`:
//     plan (before progress >= 1), failure (before progress < 0);
//   written by the forward thread under `mu`, waited on by the worker: installed, cancel.
struct Active {
  // Set by the forward thread before the worker sees it; then read-only.
  int64_t index = 0;                     // the rebalance's record index (for the PhaseTracker)
  std::vector<int32_t> current_phy2log;  // [layers][physical] at the trigger
  BufferMap map;                         // at the trigger
  ElasticInputs elastic;                 // members, usable slots, backups at the trigger
  // The window all-reduce: the worker waits on it (and the monitor, to measure the window).
  std::shared_future<CollectiveResult> window;
  // A placement proposed from outside (proposal.h), and the all-reduce that proves every rank
  // proposed it: the worker plans it instead of placing.
  std::optional<Placement> proposed;
  std::shared_future<CollectiveResult> proposal_check;

  // Progress this rank contributes to the agreement: -1 - rank after a failure, 0 while
  // the placement is computed, 1 + the number of moved layers staged.
  std::atomic<int64_t> progress{0};
  RebalancePlan plan;
  Failure failure;

  // This rank's remote reads and the time they took: added by the worker after each layer it
  // stages, before the progress that publishes the layer; read by the forward thread when the
  // rebalance completes (every layer's progress seen by then).
  std::atomic<int64_t> read_ns{0};
  std::atomic<int64_t> bytes_read{0};

  std::mutex mu;
  std::condition_variable cv;
  int64_t installed = 0;            // guarded by mu
  std::atomic<bool> cancel{false};  // set under mu, read anywhere

  // Forward thread only.
  int64_t installed_fwd = 0;
  bool figures_filled = false;
};

// One agreement contributed by the forward thread, to be acted on at step + lag.
struct PendingAgreement {
  int64_t step = 0;
  int64_t mine = 0;  // this rank's contribution
  std::future<CollectiveResult> result;  // internal agreement only
};

}  // namespace eplb::runtime
