#pragma once
// The serving emulator behind `eplb run` (docs/design.md, layer `emu`; docs/run.md): G rank
// processes, each an expert-parallel worker with real expert weights in the runtime's arena,
// routing a trace's tokens through the dispatch tables, computing every expert output on CPU,
// checking outputs bit for bit against reference weights, and rebalancing live through the
// runtime. Every step ends with a lockstep collective that stands for the all-to-alls keeping
// expert-parallel ranks in step, then step_end(), timed: that time is the stall a rebalance
// adds to the serving loop.
//
// Every rank replays every rank's tokens through the same tables (identical on all ranks at
// every step), so each knows which tokens its slots receive, and the global load of each step,
// without moving activations.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "emu/expert.h"
#include "emu/workload.h"
#include "eplb/placement/cost.h"
#include "eplb/runtime/config.h"

namespace prometheus {
class Registry;
}
namespace eplb::control {
class Communicator;
}
namespace eplb::transport {
class Transport;
}

namespace eplb::emu {

struct RunOptions {
  int ranks = 8;
  int nodes = 1;
  int64_t tokens_per_rank = 32;
  ExpertShape shape{.hidden = 256, .intermediate = 192};
  int64_t steps = 48;
  int64_t interval = 16;
  int64_t window = 16;
  int64_t redundant = -1;  // -1: one slot per rank
  int64_t lag = 2;
  std::string policy = "balanced";
  std::string mode = "async";  // async | sync | off (no rebalancing)
  // adaptive: every rank replays every sender's tokens, so each has the step's global counts
  // the best split needs (an engine gets them from its all-to-all's layout exchange).
  std::string dispatch = "adaptive";
  // The cost model (placement/cost.h) of adaptive_cost and of min_gain's check. None: the
  // ranks fit one from every rank's (activated slots, tokens, CPU time) of every layer of the
  // steps so far, gathered on the lockstep communicator, so that every rank fits the same model
  // from the same samples: adaptive_cost's once, at step `interval` (before the first rebalance
  // can be installed; adaptive's shares until then), min_gain's before every trigger.
  std::optional<placement::CostModel> cost;
  // runtime::Config::min_gain: skip a rebalance whose MoE time gain over the next interval,
  // predicted by the cost model, is below this times its price. 0: none.
  double min_gain = 0;
  // arena: the runtime allocates them (swap installs: no copy); engine: each rank allocates
  // its expert weights and registers them, as engines do (installs copy changed slots in).
  std::string weights = "arena";
  int64_t verify_every = 16;  // verify the tokens whose hash picks 1 in this many; 1: all
  uint64_t seed = 1;
  int64_t timeout_ms = 60'000;
  std::string transport = "auto";  // auto: shm on one node; hybrid (shm within a node, UCX
                                   // across) with emulated nodes or under a launcher
  // The backend `transport` means for forked ranks (launched: true, under mpirun or a
  // launcher, where "auto" is hybrid on any number of nodes).
  std::string transport_backend(bool launched = false) const {
    if (transport != "auto") return transport;
    return launched || nodes > 1 ? "hybrid" : "shm";
  }
  bool progress = false;  // rank 0 draws a progress line on stdout
  // Serve the ranks' metrics on 127.0.0.1 while running: forked ranks (run_local) merged on
  // this port, a launched rank (run_from_env) its own on port + its local rank. 0: off.
  int metrics_port = 0;
  // Where each forked rank writes its metric families every half second (set by run_local
  // when serving; empty: nowhere).
  std::string live_metrics_dir;
  // The registry a rank's metrics go in (null: the Rebalancer's own); set by run_from_env
  // when this rank serves them.
  std::shared_ptr<prometheus::Registry> registry;

  // Elastic serving (docs/elastic.md): the process in seat kill_rank kills itself (SIGKILL) at
  // the start of step kill_at_step; the survivors form a new group, reconfigure, shrink and
  // restore the lost experts; with rejoin_at_step a new process takes the seat back at that
  // step. -1: none.
  int kill_rank = -1;
  int64_t kill_at_step = -1;
  int64_t rejoin_at_step = -1;
  // Host copies of every expert kept across the ranks (runtime::Backup::copies); -1: 2 in an
  // elastic run, else 0. Elastic runs also have the loader (the weights' generator stands for
  // the checkpoint).
  int64_t backup_copies = -1;
  bool elastic() const { return kill_rank >= 0; }
  int64_t backup_copies_resolved() const {
    return backup_copies >= 0 ? backup_copies : (elastic() ? std::min<int64_t>(2, ranks) : 0);
  }

  void validate(const Workload& workload) const;  // InvalidArgument naming the option
  // InvalidArgument when `local_ranks` ranks' load windows would not fit in memory here.
  void check_window_fits(const Workload& workload, int64_t local_ranks) const;
  // Before any rank starts (resources.cc): InvalidArgument naming the option when what
  // `local_ranks` ranks of this machine hold (weights, a step's tokens, the load windows) would
  // not fit in memory, or when one step's compute would take
  // longer than --timeout-ms at any core's pace. Both estimates are lower bounds.
  void check_resources(const Workload& workload, int64_t local_ranks) const;
  // Redundant slots per layer, the -1 default resolved: one per rank; in an elastic run the
  // fewest (at least one per rank) with which the ranks left after a loss hold every expert.
  int64_t redundant_slots(int64_t experts) const;
};

// The runtime's Config of a rank of this run (every rank's the same; run_options.cc).
runtime::Config make_config(const RunOptions& options, const Workload& workload);

// What one step looked like, merged over ranks.
struct StepFigures {
  double balancedness = 0;  // sum_l mean rank load / sum_l max rank load, global loads
  // Sum over the layers of the busiest rank's expert compute in that layer (every layer waits
  // for its slowest rank), in the ranks' thread CPU time; the same in wall time (with more
  // ranks than cores, mostly waiting).
  double moe_ms = 0;
  double moe_wall_ms = 0;
  // What the run's cost model (RunResult::cost_model) predicts for moe_ms: the sum over the
  // layers of the layer time of the ranks' modeled times (each rank's activated slots and
  // tokens; the expected largest under the model's noise); 0 without a model.
  double moe_ms_predicted = 0;
  // What no placement or dispatch of the step's tokens beats under that model: per layer, every
  // rank at the mean tokens and at the fewest activated slots (one per expert with a token)
  // spread evenly; at most moe_ms_predicted; 0 without a model.
  double moe_ms_floor = 0;
  // The sum over the layers of the mean rank CPU time over the sum of the largest: how much of
  // the step's MoE time is waiting for the busiest rank (1: none).
  double time_balancedness = 0;
  double stall_ms = 0;   // max over ranks of the time in step_end
  int64_t installs = 0;  // layers installed at this step's step_end
  bool unavailable = false;  // some expert had no replica to serve it (elastic runs)
  // Top-k choices of the step's tokens, all layers, that went to an expert with no replica
  // (elastic runs): they reached no rank, so the balancedness leaves them out.
  int64_t dropped = 0;
};

// A rank process an elastic run lost (docs/elastic.md, "Lost ranks").
struct LostRank {
  int rank = 0;        // its seat
  int64_t step = -1;   // the first step the group served without it (or stopped at); -1: no
                       // member saw it go (a replacement lost before it joined)
  bool planned = false;  // the process --kill-rank ends; else killed from outside eplb
  std::string how;       // "rank 5 (pid 4711): killed by signal 9 (Killed)"
};

struct RebalanceFigures {
  int64_t trigger_step = 0;
  int64_t end_step = 0;
  std::string outcome;
  std::string error;
  int64_t slots_moved = 0;
  int64_t bytes_moved = 0;  // remote reads, all ranks
  int64_t bytes_local_copy = 0;
  int64_t bytes_installed = 0;  // written into live weights by installs, all ranks
  int64_t bytes_restored = 0;   // restored from a backup copy or the loader, all ranks
  bool repair = false;          // started by a reconfigure (elastic runs)
  double stall_total_ms = 0;    // max over ranks
  double stall_max_ms = 0;      // max over ranks
  double stall_preempted_ms = 0;  // max over ranks: waits for a core, left out of the stall
  double predicted_before = 0;
  double predicted_after = 0;
  // min_gain's check (runtime::RebalanceRecord), where it was made: skipped for it, priced, the
  // modeled MoE time per step with the placement in force and the new one, the predicted gain
  // over the next interval and the price, in ms.
  bool gain_checked = false;
  bool below_min_gain = false;
  bool priced = false;
  double moe_ms_modeled_before = 0;
  double moe_ms_modeled_after = 0;
  double predicted_gain_ms = 0;
  double price_ms = 0;
};

struct RunResult {
  std::string mode;
  int64_t steps = 0;  // steps run (fewer than asked when interrupted)
  bool interrupted = false;
  int64_t rebalances = 0;  // completed
  int64_t rebalances_triggered = 0;
  int64_t rebalances_below_min_gain = 0;  // skipped: the gain did not pay min_gain x the price
  int64_t before_first = 0, before_last = 0;  // [first, last) steps measured "before"
  int64_t after_first = 0, after_last = 0;    // and "after"; either may be empty (a short run)
  bool has_before() const { return before_last > before_first; }
  bool has_after() const { return after_last > after_first; }
  double balancedness_before = 0;  // 0 for an empty range
  double balancedness_after = 0;
  double moe_ms_before = 0;  // mean over the same steps (CPU time)
  double moe_ms_after = 0;
  double moe_wall_ms_before = 0;  // the same in wall time
  double moe_wall_ms_after = 0;
  // The cost model (placement/cost.h) fitted by least squares on every rank's (activated slots,
  // tokens, CPU time) of every layer of the steps before the "after" range (the "before" steps
  // and those of the first rebalance), with its noise and its error on held-back steps, and its
  // prediction of moe_ms over each range (out of sample after). No model (cost_fit_error says
  // why) when those steps are too few or cannot tell slots from tokens.
  std::optional<placement::CostModel> cost_model;
  std::string cost_fit_error;
  int64_t cost_samples = 0;
  double moe_ms_predicted_before = 0;
  double moe_ms_predicted_after = 0;
  double moe_ms_floor_before = 0;  // StepFigures::moe_ms_floor over each range (with a model)
  double moe_ms_floor_after = 0;
  double time_balancedness_before = 0;  // StepFigures::time_balancedness over each range
  double time_balancedness_after = 0;
  int64_t bytes_moved = 0;
  int64_t bytes_local_copy = 0;
  int64_t bytes_installed = 0;  // written into live weights by installs, all ranks
  double stall_max_ms = 0;
  double stall_total_ms = 0;
  double stall_preempted_ms = 0;  // the time step_end waited for a core (not in the stall)
  int64_t mismatches = 0;
  int64_t verified = 0;    // expert outputs checked
  int64_t outputs = 0;     // expert outputs computed
  int64_t bytes_held = 0;  // per rank
  // Elastic runs: rank processes lost (lost.size(), planned or not) and seats taken back,
  // steps during which some expert was unavailable, steps served again because a lost rank
  // ended them (no service), the bytes restored from the backup copies or the loader, all ranks,
  // and the top-k choices that went to an unavailable expert (StepFigures::dropped, summed).
  int64_t kills = 0;
  int64_t rejoins = 0;
  int64_t unavailable_steps = 0;
  int64_t no_service_steps = 0;
  int64_t restored_bytes = 0;
  int64_t tokens_dropped = 0;
  std::vector<LostRank> lost;  // in the order they were lost
  // Why the run ended before its last step other than by an interrupt; empty when it did not.
  // An elastic run stops when the ranks left cannot hold every expert, or when a rank fails
  // with an error; the figures are those of the steps served (`steps` of them).
  std::string stopped;
  double wall_s = 0;
  // Every rank's metric families at the end, merged (runtime::families_to_json; every sample
  // has a rank and a mode label).
  std::string metrics;
  std::vector<StepFigures> per_step;
  std::vector<RebalanceFigures> per_rebalance;
};

// One rank's part. `lockstep` is a communicator of its own (not the runtime's) on which the
// ranks meet once per step; `stop` (may be null) asks every rank to stop at the same step.
// Returns this rank's report as JSON text; merge the reports of all ranks with merge_reports.
std::string run_rank(const RunOptions& options, const Workload& workload,
                     control::Communicator& communicator, control::Communicator& lockstep,
                     transport::Transport& transport, const std::atomic<int>* stop);

// `reports`: one per rank process that finished, any order; in an elastic run a seat may have
// two (its first process and the one that took it back) or none.
RunResult merge_reports(const RunOptions& options, const Workload& workload,
                        const std::vector<std::string>& reports);

// Runs the ranks as forked processes of this machine and merges their reports. A rank that
// dies or fails stops the run: IoError naming it. In an elastic run (--kill-rank) a rank
// process killed by a signal eplb did not send, whoever sent it, is lost like the one
// --kill-rank ends (control::is_lost): the others serve on while they can hold every expert,
// and else stop; either way the result covers the steps served, names the ranks lost
// (RunResult::lost) and says why the run stopped early (RunResult::stopped), also when a rank
// failed with an error (IoError only when no report was left to merge). SIGINT/SIGTERM during
// the run stop every rank at the same step; the result then says interrupted.
RunResult run_local(const RunOptions& options, const Workload& workload);

// Runs every element of `runs` at the same time, each run_local in a process of its own, so that
// they see the same machine (its load, its clock, the other runs' work): what `eplb run
// --compare` uses, whose runs would otherwise meet different conditions one after the other.
// Results in the order of `runs`. A run that fails: IoError naming its mode and why. SIGINT and
// SIGTERM are passed on to every run (each then reports interrupted).
std::vector<RunResult> run_side_by_side(const std::vector<RunOptions>& runs,
                                        const Workload& workload);

// A RunResult as JSON text and back, every field (how run_side_by_side carries results).
std::string result_to_json(const RunResult& result);
RunResult result_from_json(const std::string& text);  // IoError for text that is not one

// One rank per process under mpirun or a torchrun-style launcher (control::connect_from_env);
// every rank returns the merged result (rank 0 prints it).
RunResult run_from_env(RunOptions options, const Workload& workload);

}  // namespace eplb::emu
