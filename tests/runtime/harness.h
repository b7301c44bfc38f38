#pragma once
// A serving loop on G ranks (threads with inproc control + inproc transport, or forked
// processes with shm control + shm/ucx transport) that checks the runtime's invariants at every
// step, on every rank:
//   1. every slot of this rank holds exactly the weights of the expert phy2log says, and every
//      slot a dispatch table names holds the expert it is named for (weights encode
//      (layer, tensor, logical expert, byte), so content proves identity);
//   2. every rank's tables of every layer, and its rebalance history, are identical (a hash
//      compared through a second communicator, the harness's own, at the same point of every
//      step; and, after the run, every rank's per-step log);
//   3. the transport holds what connect() allocated and nothing more.
// Ranks record routed tokens from the FLAME trace or skewed synthetic loads whose hot experts
// move, so that rebalances really move experts.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime::testing {

enum class LoadSource { kSkewed, kFlame };

// What carries the per-step agreement of an async rebalance.
enum class Carrier {
  kControl,  // Config::agreement = internal: the runtime's control plane
  // Config::agreement = external, the harness standing for the engine's collective:
  kSharedMemory,  // threads only: a min-reduction shared by the rank threads; each rank's own
                  // delivery thread hands the results in, in step order, after random delays
  kHarnessCollective,  // the harness's per-step all-reduce (its own communicator) carries the
                       // contribution; the forward thread hands the result in before step_end
};

struct Scenario {
  std::string name;
  bool processes = false;
  std::string control = "inproc";    // processes: "shm"
  std::string transport = "inproc";  // processes: "shm" or "ucx"
  Config config;                     // layout, interval, window, mode, lag, policy, ...
  WeightSpec weights;
  LoadSource load = LoadSource::kSkewed;
  Carrier carrier = Carrier::kControl;
  int64_t drop_results_from = -1;  // kSharedMemory: results of steps >= this never come

  // The loop ends at the first step at which `completed` rebalances have completed and
  // `skipped` have been skipped (the same step on every rank), or after max_steps.
  int64_t completed = 4;
  int64_t skipped = 0;
  int64_t max_steps = 5000;

  uint64_t seed = 1;
  bool delays = false;           // random sleeps at every DelayPoint
  int delay_max_us = 300;

  int fail_rank = -1;            // this rank's worker throws at its fail_at-th read round
  int fail_at = 3;
  bool fail_not_std = false;     // the injected failure is not a std::exception (an int)
  bool fail_placement = false;   // ... is thrown at the first placement instead of a read
  int slow_placement_rank = -1;  // this rank's worker sleeps before each placement
  int slow_placement_ms = 100;   // ... this long
  int kill_rank = -1;            // this rank SIGKILLs itself mid-rebalance (processes only)
  int64_t kill_after = 0;        // ... in the first rebalance after this many completed
  int64_t steps_after_failure = 30;  // survivors serve this long after the failure
  bool stop_mid_rebalance = false;   // every rank shuts down at the same step mid-rebalance
  bool compare_through_control = true;  // per-step hash through the harness communicator
  bool installer = false;  // a counting Installer: one mark per install, checked every step
  // The engine allocates the weights (WeightSpec::engine) instead of the runtime's arena: one
  // buffer per layer and tensor at an unaligned base, `engine_pad` bytes between slots.
  bool engine_weights = false;
  int64_t engine_pad = 0;
  // The engine's other seams (engine_maps.h): its map tensors bound in both engines' layouts
  // (checked at every step against the tables, and compared across ranks with them), and its
  // counters recorded once per pass with record_pass, per slot or per expert.
  bool engine_maps = false;
  enum class Counters { kPerLayer, kPassSlots, kPassExperts } counters = Counters::kPerLayer;
  // The engine's own calls on every rank before each step_end() (propose(), say); a line it
  // returns goes into the rank's log, which is compared across ranks, or into its errors when
  // it starts with "error: ".
  std::function<std::string(Rebalancer& rb, int rank, int64_t step)> before_step_end;
};

struct RankResult {
  int rank = 0;
  bool ran = false;                 // produced a result (a killed rank does not)
  std::string skipped;              // why the transport cannot start here (then nothing ran)
  std::vector<std::string> errors;  // invariant violations and exceptions
  std::vector<std::string> log;     // one line per step: step, tables hash, history summary
  std::vector<RebalanceRecord> history;
  int64_t raised = 0;               // step_end calls that threw (on_error = raise)
  std::string metrics;              // metrics_text() after shutdown (threads only)
  int64_t steps = 0;
};

// Runs the scenario on every rank and returns every rank's result ([ranks]); a process rank
// that died has ran = false. Throws (test failure) when the launcher itself failed.
std::vector<RankResult> run_scenario(const Scenario& scenario);

// The scenario's seed: EPLB_TEST_SEED when set, else `fallback`.
uint64_t test_seed(uint64_t fallback);

// The expected byte `index` of `tensor` of logical expert `expert` of `layer`.
std::byte weight_byte(int64_t layer, int64_t tensor, int64_t expert, int64_t index);

}  // namespace eplb::runtime::testing
