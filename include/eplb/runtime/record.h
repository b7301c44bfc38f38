#pragma once
// What a rebalance did: Rebalancer::history() returns one RebalanceRecord per rebalance.

#include <cstdint>
#include <string>
#include <string_view>

namespace eplb::runtime {

enum class Outcome {
  kCompleted,  // every moved layer installed on every rank
  kSkipped,    // predicted gain below min_balancedness_gain or min_gain's price, or nothing to move
  kFailed,     // abandoned on every rank at the same step (see RebalanceRecord::error)
  kCancelled,  // shutdown() came while it ran
};
std::string_view outcome_name(Outcome outcome);

// What one rebalance did, as seen from this rank. Every rank records the same trigger_step,
// end_step, outcome and (for the same load) the same plan figures; timings are this rank's.
// A rebalance that failed before every rank had its plan records no plan figures.
struct RebalanceRecord {
  int64_t index = 0;         // 0, 1, ... in order of triggering
  int64_t trigger_step = 0;  // step() when it was triggered
  int64_t end_step = 0;      // step() when it ended (installed, skipped or abandoned)
  Outcome outcome = Outcome::kCompleted;
  std::string error;         // why it failed or was skipped; empty when completed
  double placement_ms = 0;   // placement + plan + tables on the worker
  double balancedness_before = 0;  // predicted on the window's load, current placement
  double balancedness_after = 0;   // predicted on the window's load, new placement
  int64_t layers_moved = 0;        // layers whose slots change
  int64_t layers_installed = 0;
  int64_t slots_moved = 0;         // slots whose expert changes, all ranks
  int64_t bytes_intra_node = 0;    // remote reads of all ranks, moved layers
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;
  int64_t rounds = 0;              // read rounds, summed over moved layers
  int64_t bytes_read = 0;          // this rank's remote reads of the rebalance, and the time
  double read_ms = 0;              //   they took: its pull bandwidth (async: when completed)
  int64_t bytes_installed = 0;     // bytes this rank's installs wrote into live weights
  int64_t bytes_restored = 0;      // bytes this rank restored from a backup (host copy or loader)
  bool repair = false;             // triggered by reconfigure(): lost or empty slots to fill
  bool proposed = false;           // installs a placement proposed from outside (propose())
  // Config::min_gain's check (placement/gain.h), when it was made (gain_checked: min_gain > 0,
  // not a repair, slots to move): the modeled MoE time per step on the window's load with the
  // placement in force and with the new one, the gain over the next interval and the price, in
  // us (price 0 and priced false before any rebalance measured the pull bandwidth: not priced,
  // it goes ahead); below_min_gain: skipped for it. The same on every rank.
  bool gain_checked = false;
  bool below_min_gain = false;
  bool priced = false;
  double moe_us_before = 0;
  double moe_us_after = 0;
  double gain_us = 0;
  double price_us = 0;
  int64_t steps = 0;               // end_step - trigger_step
  double seconds = 0;              // wall time from trigger to end on this rank
  double stall_total_ms = 0;       // this rank's forward thread in step_end, steps of this
  double stall_max_ms = 0;         //   rebalance (trigger to end, both included): sum, max;
                                   //   less the time it waited for a core (below)
  double stall_preempted_ms = 0;   // time in those step_ends the forward thread was runnable
                                   //   but the OS ran other threads (Linux; 0 elsewhere)
};

}  // namespace eplb::runtime
