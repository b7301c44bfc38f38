// RunOptions: checking them, and the runtime::Config a rank of the run serves with
// (emulator.h).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>

#include "emu/emulator.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/gain.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"

namespace eplb::emu {

namespace {

int64_t physical_of(const RunOptions& options, const Workload& workload) {
  return workload.experts + options.redundant_slots(workload.experts);
}

}  // namespace

runtime::Config make_config(const RunOptions& options, const Workload& workload) {
  runtime::Config config;
  config.layout = Layout{.experts = workload.experts,
                         .physical = physical_of(options, workload),
                         .ranks = options.ranks,
                         .nodes = options.nodes,
                         .groups = 1};
  const bool off = options.mode == "off";
  // EPLB off: the same workers and the same runtime, with a trigger that never comes.
  config.interval = off ? options.steps + 1 : options.interval;
  config.window = options.window;
  config.placement.policy = placement::parse_policy(options.policy);
  config.mode = off ? runtime::Mode::kAsync : runtime::parse_mode(options.mode);
  config.lag = options.lag;
  config.dispatch = routing::parse_dispatch_policy(options.dispatch);
  config.timeout = std::chrono::milliseconds(options.timeout_ms);
  config.min_gain = options.min_gain;
  config.cost = options.cost;
  // The recorded window's balancedness every interval, with EPLB off too; the mode tells the
  // runs of --compare apart in one exposition.
  config.balancedness_period = std::max<int64_t>(options.interval, 1);
  config.metric_labels = {{"mode", options.mode}};
  config.registry = options.registry;
  config.backup.copies = options.backup_copies_resolved();
  if (options.elastic()) {
    config.backup.loader = [shape = options.shape](int64_t layer, int64_t tensor, int32_t expert,
                                                   std::span<std::byte> bytes) {
      generate_weights_bytes(shape, layer, expert, static_cast<Tensor>(tensor), bytes);
    };
  }
  return config;
}

int64_t RunOptions::redundant_slots(int64_t experts) const {
  if (redundant >= 0) return redundant;
  if (!elastic() || ranks < 2) return ranks;
  // The fewest slots per rank with which ranks - 1 of them hold every expert.
  const int64_t per_rank = std::max<int64_t>((experts + ranks - 2) / (ranks - 1),
                                             (experts + ranks) / ranks);
  return std::max<int64_t>(per_rank * ranks - experts, ranks);
}

void RunOptions::validate(const Workload& workload) const {
  if (ranks < 1 || ranks > kMaxRanks) fail("--ranks ", ranks, " is outside [1, ", kMaxRanks, "]");
  if (redundant < -1) {
    fail("--redundant ", redundant, " must not be negative (-1 means one per rank, or with "
         "--kill-rank enough for the survivors to hold every expert)");
  }
  if (redundant > kMaxPhysical - workload.experts) {
    fail("--redundant ", redundant, " gives more than ", kMaxPhysical,
         " physical slots per layer, the most eplb supports");
  }
  if (nodes < 1 || ranks % nodes != 0) {
    fail("--nodes ", nodes, " must divide --ranks ", ranks, " (every node has as many ranks)");
  }
  if (tokens_per_rank < 1) fail("--tokens-per-rank ", tokens_per_rank, " must be at least 1");
  if (metrics_port < 0 || metrics_port > 65535) {
    fail("--metrics-port ", metrics_port, " is not a port (1 to 65535, or 0: none)");
  }
  shape.validate();
  if (steps < 1) fail("--steps ", steps, " must be at least 1");
  if (steps > kMaxSteps) fail("--steps ", steps, " is outside [1, ", kMaxSteps, "]");
  if (interval < 1) fail("--interval ", interval, " must be at least 1");
  if (window < 1) fail("--window ", window, " must be at least 1");
  if (interval > kMaxSteps) fail("--interval ", interval, " is outside [1, ", kMaxSteps, "]");
  if (window > kMaxSteps) fail("--window ", window, " is outside [1, ", kMaxSteps, "]");
  if (lag < 1 || lag > runtime::kMaxLag) {
    fail("--lag ", lag, " is outside [1, ", runtime::kMaxLag, "] steps");
  }
  if (verify_every < 1) {
    fail("--verify ", verify_every, " is not all, sample or a number N >= 1 (one token in N)");
  }
  if (timeout_ms < 1) fail("--timeout-ms ", timeout_ms, " must be at least 1");
  if (mode != "async" && mode != "sync" && mode != "off") {
    fail("--mode '", mode, "' is not one of async, sync, off");
  }
  placement::parse_policy(policy);
  if (routing::parse_dispatch_policy(dispatch) == routing::DispatchPolicy::kAdaptiveCost &&
      elastic() && !cost) {
    fail("--dispatch adaptive_cost with --kill-rank needs --cost MODEL: the model fitted at step "
         "--interval is gathered from every rank, which a lost rank cannot give");
  }
  placement::check_min_gain(min_gain, "--min-gain");
  if (min_gain > 0 && elastic() && !cost) {
    fail("--min-gain with --kill-rank needs --cost MODEL: the model fitted before each trigger "
         "is gathered from every rank, which a lost rank cannot give");
  }
  if (cost) cost->validate();
  const int64_t physical = workload.experts + redundant_slots(workload.experts);
  if (physical % ranks != 0) {
    fail("--redundant ", redundant_slots(workload.experts), " gives ", physical, " physical slots (",
         workload.experts, " experts + redundant), not a multiple of --ranks ", ranks,
         " (physical slots must divide evenly)");
  }
  if (physical < ranks) {
    fail("--ranks ", ranks, " is more than the ", physical,
         " physical slots (experts + --redundant): every rank needs a slot");
  }
  if (weights != "engine" && weights != "arena") {
    fail("--weights '", weights,
         "' is not engine (each rank allocates its experts and eplb "
         "registers them) or arena (eplb allocates them)");
  }
  if (transport != "auto" && !transport::has_backend(transport)) {
    fail("--transport '", transport, "' is not built in");
  }
  if (transport == "auto" && nodes > 1 && !transport::has_backend("hybrid")) {
    fail("--nodes ", nodes,
         " needs the hybrid transport (shm within a node, UCX across), "
         "which this build lacks: it needs UCX (use --nodes 1)");
  }
  if (kill_rank < -1 || kill_rank >= ranks) {
    fail("--kill-rank ", kill_rank, " is outside [0, ", ranks, ") (a rank of this run)");
  }
  if (elastic()) {
    if (ranks < 2) fail("--kill-rank needs at least 2 ranks (one must survive)");
    if (kill_at_step < 1 || kill_at_step >= steps) {
      fail("--at-step ", kill_at_step, " must be in [1, ", steps, ") (a step of the run after the "
           "first; set it with --kill-rank)");
    }
    if (rejoin_at_step != -1 && (rejoin_at_step <= kill_at_step || rejoin_at_step >= steps)) {
      fail("--rejoin-at-step ", rejoin_at_step, " must be in (", kill_at_step, ", ", steps,
           ") (after the kill, before the last step)");
    }
    if (rejoin_at_step != -1 && dispatch == "random") {
      fail("--dispatch random with --rejoin-at-step: every rank replays every sender's random "
           "stream, which a new process cannot know; choose another dispatch");
    }
    const int64_t spr = physical / ranks;
    if ((ranks - 1) * spr < workload.experts) {
      fail("--redundant ", redundant_slots(workload.experts), " leaves ", (ranks - 1) * spr,
           " slots on the ", ranks - 1, " ranks left after --kill-rank, fewer than the ",
           workload.experts, " experts: raise --redundant (or leave it at -1)");
    }
    if (nodes > 1) fail("--kill-rank runs on one node (--nodes 1)");
    if (transport_backend() != "shm") {
      fail("--kill-rank needs the shm transport (--transport auto or shm)");
    }
  } else if (kill_at_step != -1 || rejoin_at_step != -1) {
    fail("--at-step and --rejoin-at-step need --kill-rank");
  }
  if (backup_copies < -1 || backup_copies > ranks) {
    fail("--backup-copies ", backup_copies, " is outside [0, ", ranks, "] (-1: 2 with --kill-rank)");
  }
  make_config(*this, workload).validate();
  check_resources(workload, 1);
}

void RunOptions::check_window_fits(const Workload& workload, int64_t local_ranks) const {
  // Every rank records a window of loads: what the ranks of this machine will hold together,
  // checked before any starts (each rank's recorder checks its own share again).
  const int64_t window_bytes =
      stats::LoadRecorder::bytes_for(workload.layers, workload.experts, window);
  check_fits_in_memory(
      checked_mul(window_bytes, local_ranks, "the load windows of this machine's ranks"),
      detail::concat("--window ", window, " (", local_ranks, local_ranks == 1 ? " rank" : " ranks",
                     " here, each keeping ", window, " steps x ", workload.layers, " layers x ",
                     workload.experts, " experts of counts)"),
      "lower --window");
}

}  // namespace eplb::emu
