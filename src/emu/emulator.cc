#include "emu/emulator.h"

#include <fmt/core.h>
#include <fmt/format.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <sstream>

#include "emu/live_metrics.h"
#include "emu/serve.h"
#include "runtime/cpu_wait.h"
#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/clock.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/placement/cost.h"
#include "eplb/placement/gain.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"

namespace eplb::emu {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// This thread's CPU time in ms: what the expert compute costs, whatever the scheduler does with
// more rank processes than cores (wall time then mostly measures the waiting).
double thread_cpu_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Whether the outputs of global token `token` at `step` are verified this step.
bool verified_token(int64_t verify_every, int64_t step, int64_t token) {
  if (verify_every <= 1) return true;
  const uint64_t h = mix64((static_cast<uint64_t>(step) << 32) ^ static_cast<uint64_t>(token) ^
                           0x3C6EF372FE94F82Bull);
  return h % static_cast<uint64_t>(verify_every) == 0;
}

// A verification waiting for its reference: the output computed from the slot's weights.
struct Pending {
  int32_t expert = 0;
  int64_t token = 0;
  size_t output = 0;  // offset in the outputs buffer
};

// The run's cost model when none is given (RunOptions::cost): every rank's own (activated
// slots, tokens, CPU ns) of every layer of the steps so far (`own`: [steps][layers][3] from
// step `first_step`), gathered from all ranks, and fitted (placement/cost.h), each sample with
// its step. Every rank fits the same samples in the same order, so every rank has the same
// model. Samples that cannot be fitted give the tokens preset, and `why` says why.
placement::CostModel fit_run_cost(control::Communicator& lockstep, const std::vector<int64_t>& own,
                                  int64_t first_step, int64_t layers, std::string& why) {
  std::vector<int64_t> mine{first_step};
  mine.insert(mine.end(), own.begin(), own.end());
  const std::vector<control::Bytes> all = lockstep.all_gather(
      {reinterpret_cast<const std::byte*>(mine.data()), mine.size() * sizeof(int64_t)});
  std::vector<placement::CostSample> samples;
  for (const control::Bytes& rank : all) {
    std::vector<int64_t> v(rank.size() / sizeof(int64_t));
    std::memcpy(v.data(), rank.data(), v.size() * sizeof(int64_t));
    for (size_t i = 1; i + 3 <= v.size(); i += 3) {
      if (v[i + 1] > 0) {
        samples.push_back({.slots = static_cast<double>(v[i]),
                           .tokens = static_cast<double>(v[i + 1]),
                           .time_us = static_cast<double>(v[i + 2]) / 1e3,
                           .step = v[0] + static_cast<int64_t>((i - 1) / 3) / layers});
      }
    }
  }
  return placement::fit_cost_model_or_tokens(samples, &why);
}

}  // namespace

std::unique_ptr<transport::Transport> make_transport(const RunOptions& options, int rank, int seat) {
  const std::string name = options.transport_backend();
  // Emulated nodes: reads across them go over TCP, as between machines, unless the caller chose
  // UCX's transports; reads within one (hybrid) stay in shared memory.
  if ((name == "ucx" || name == "hybrid") && options.nodes > 1) ::setenv("UCX_TLS", "tcp", 0);
  const int ranks_per_node = options.ranks / std::max(options.nodes, 1);
  return transport::create(
      name, transport::Options{.rank = rank,
                               .node = "emulated-node-" + std::to_string(seat / ranks_per_node)});
}

std::string run_rank(const RunOptions& options, const Workload& workload,
                     control::Communicator& communicator, control::Communicator& lockstep,
                     transport::Transport& transport, const std::atomic<int>* stop) {
  Group group;
  group.communicator = &communicator;
  group.lockstep = &lockstep;
  group.transport = &transport;
  for (int g = 0; g < communicator.size(); ++g) group.seats.push_back(g);
  return serve(options, workload, std::move(group), nullptr, stop);
}

std::string serve(const RunOptions& options, const Workload& workload, Group group,
                  const ElasticContext* elastic, const std::atomic<int>* stop) {
  const int me = elastic != nullptr ? elastic->seat : group.communicator->rank();
  const bool joining = elastic != nullptr && elastic->joining;
  const int64_t G = options.ranks;
  const int64_t T = options.tokens_per_rank;
  const int64_t L = workload.layers;
  const int64_t k = workload.top_k;
  const ExpertShape& shape = options.shape;
  const runtime::Config config = make_config(options, workload);
  const int64_t spr = config.layout.slots_per_rank();
  const routing::DispatchPolicy dispatch = config.dispatch;

  runtime::WeightSpec spec{
      .layers = L, .tensors = {{"gate_up", shape.gate_up_bytes()}, {"down", shape.down_bytes()}}};
  // --weights engine: this rank allocates its experts itself, per layer and tensor,
  // expert-major, as an engine does at model load, and registers them; they never move.
  std::vector<std::vector<float>> own;  // [layers][tensors]
  if (options.weights == "engine") {
    for (int64_t l = 0; l < L; ++l) {
      for (const int64_t floats : {shape.gate_up_floats(), shape.down_floats()}) {
        own.emplace_back(static_cast<size_t>(spr * floats));
        spec.engine.push_back({.base = own.back().data(), .stride = 0});
      }
    }
  }
  // A joining process (a new one in a lost seat) has no group and no weights yet: it waits for
  // the group that lists its seat, enters through reconfigure(), and its slots are filled by the
  // repair rebalance that follows.
  std::unique_ptr<runtime::Rebalancer> rebalancer =
      joining ? std::make_unique<runtime::Rebalancer>(config, spec, me)
              : std::make_unique<runtime::Rebalancer>(
                    config, *group.communicator, *group.transport, spec,
                    trivial_placement(L, workload.experts, config.layout.physical));
  runtime::Rebalancer& rb = *rebalancer;
  if (joining) {
    elastic->board->set_ready(me, true);
    // As long as it takes the members to reach --rejoin-at-step: the launcher ends this process
    // if the run fails or stops meanwhile.
    control::MembershipBoard::View view = elastic->board->view();
    while (!view.has(me)) {
      try {
        view = elastic->board->wait_newer(view.epoch, std::chrono::milliseconds(options.timeout_ms));
      } catch (const Timeout&) {
        if (stop != nullptr && stop->load() != 0) fail<IoError>("stopped before joining");
      }
    }
    group = connect_group(options, elastic->rendezvous, view, me);
    rb.reconfigure(*group.communicator, *group.transport, runtime::Membership{view.seats});
  } else {
    rb.connect();
  }
  const int64_t bytes_held = rb.bytes_held();
  // --metrics-port: a forked rank's families go to the launcher through a file; a launched
  // rank serves its own.
  std::optional<SnapshotWriter> snapshots;
  if (!options.live_metrics_dir.empty()) {
    snapshots.emplace(snapshot_path(options.live_metrics_dir, me), std::chrono::milliseconds(500));
  }

  const auto generate = [&](int64_t layer, int64_t tensor, int32_t expert,
                            std::span<std::byte> bytes) {
    generate_weights_bytes(shape, layer, expert, static_cast<Tensor>(tensor), bytes);
  };
  if (!joining) runtime::fill_weights(rb, generate);
  rb.fill_backup(generate);

  // Every rank replays every sender's replica choice, so each sender has its random stream here.
  std::vector<uint64_t> random_state(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) random_state[g] = mix64(options.seed * 1000003 + g) | 1;

  std::vector<int32_t> experts(static_cast<size_t>(G * T * k));  // every sender's, this layer
  const bool adaptive = routing::routes_by_shares(dispatch);
  // adaptive_cost's model in ticks: the given one, or fitted before step `interval` (fit_run_cost).
  const bool by_cost = dispatch == routing::DispatchPolicy::kAdaptiveCost;
  std::optional<routing::CostTicks> ticks;
  if (by_cost && options.cost) ticks = routing::cost_ticks(*options.cost);
  std::vector<int64_t> global_counts(static_cast<size_t>(workload.experts));
  std::vector<int64_t> prefix(static_cast<size_t>(workload.experts));
  routing::AdaptiveShares shares;
  std::vector<int32_t> slots(static_cast<size_t>(G * T * k));
  std::vector<int64_t> rank_load(static_cast<size_t>(G));
  std::vector<float> x(static_cast<size_t>(shape.hidden));
  std::vector<float> scratch(static_cast<size_t>(2 * shape.intermediate));
  std::vector<float> y(static_cast<size_t>(shape.hidden));
  std::vector<float> reference_y(static_cast<size_t>(shape.hidden));
  std::vector<float> reference_gate_up(static_cast<size_t>(shape.gate_up_floats()));
  std::vector<float> reference_down(static_cast<size_t>(shape.down_floats()));
  std::vector<float> outputs;  // the outputs to verify, this layer
  std::vector<Pending> pending;
  struct Received {
    int64_t local;  // the slot on this rank
    int64_t entry;  // (sender, token, k) flattened
  };
  std::vector<Received> received;  // this layer's entries for this rank's slots
  std::vector<int64_t> step_max(static_cast<size_t>(1 + 2 * L));
  // This rank's own figures of each layer of the step, before the lockstep collective maxes
  // step_max: [l][0] activated slots, [l][1] tokens computed, [l][2] CPU ns. They are the
  // samples the cost model is fitted from (merge_reports).
  std::vector<int64_t> step_own(static_cast<size_t>(3 * L));
  std::vector<int64_t> cost_samples;  // [steps][layers][3], the steps served
  // The experts that had a token served in each layer of the step, all ranks' tokens (the same
  // on every rank): no placement activates fewer slots, so with the tokens they bound the step's
  // time from below (merge_reports' floor). served_mark[e] == mark: expert e counted already.
  std::vector<int64_t> step_active(static_cast<size_t>(L));
  std::vector<int64_t> active_experts;  // [steps][layers], the steps served
  std::vector<int64_t> served_mark(static_cast<size_t>(workload.experts), -1);
  int64_t mark = 0;
  std::vector<int64_t> own_counts(static_cast<size_t>(L * workload.experts));  // this step's

  bool fit_failure_said = false;  // a failed fit of the ranks' cost model, said once
  std::vector<double> moe_ms, moe_wall_ms, stall_ms, balancedness;
  std::vector<int64_t> installs, dropped;
  int64_t mismatches = 0, verified = 0, computed = 0;
  std::string first_mismatch;
  bool interrupted = false;
  const bool progress = options.progress && me == 0;

  // Elastic runs: steps whose tokens some expert could not serve (every replica lost), steps
  // served again after a lost rank ended them, and this process's first step (a joining one
  // starts at the group's step).
  std::vector<uint8_t> unavailable_at;
  int64_t no_service_steps = 0;
  int64_t step = rb.step();
  const int64_t first_step = step;
  // Elastic runs: the seats that left the group and joined it, each with the first step served
  // without or with it ([step, seat]), and why this process stopped before the last step (the
  // ranks left too few to hold every expert).
  json losses = json::array(), joins = json::array();
  std::string stopped;
  std::string ended;  // "killed" (--kill-rank) or "failed": a report left before the process ends
  // Moves this process onto the group of `view`: new communicators and transport, then
  // reconfigure(); the old group's objects go only after that. Returns false, with `stopped`
  // saying why, when the group's slots cannot hold every expert: the run stops there, on every
  // member at the same step, since each decides from the same view (docs/elastic.md, "Lost
  // ranks"). A group that changes again while it forms (another rank lost) is given up for the
  // newer one.
  const auto regroup = [&](control::MembershipBoard::View view) {
    for (;;) {
      std::vector<int32_t> left;
      for (const int32_t seat : group.seats) {
        if (!view.has(seat)) left.push_back(seat);
      }
      const auto live_slots = static_cast<int64_t>(view.seats.size()) * spr;
      if (live_slots < workload.experts) {
        for (const int32_t seat : left) losses.push_back({step, seat});
        std::string who;
        for (size_t i = 0; i < left.size(); ++i) {
          who += fmt::format("{}{}", i == 0 ? "" : ", ", left[i]);
        }
        stopped = fmt::format(
            "after losing rank{} {} at step {}, the {} ranks left hold {} slots per layer ({} "
            "each), fewer than the {} experts: every expert needs a slot on a live rank",
            left.size() == 1 ? "" : "s", who, step, view.seats.size(), live_slots, spr,
            workload.experts);
        return false;
      }
      try {
        Group next = connect_group(options, elastic->rendezvous, view, me);
        rb.reconfigure(*next.communicator, *next.transport, runtime::Membership{view.seats});
        for (const int32_t seat : left) losses.push_back({step, seat});
        for (const int32_t seat : view.seats) {
          if (std::find(group.seats.begin(), group.seats.end(), seat) == group.seats.end()) {
            joins.push_back({step, seat});
          }
        }
        group = std::move(next);
        return true;
      } catch (const Error&) {
        // reconfigure() leaves this rank as it was: try the newer group, if there is one.
        const control::MembershipBoard::View newer = elastic->board->view();
        if (newer.epoch <= view.epoch) throw;
        view = newer;
      }
    }
  };
  // This process's report (what run_local merges); also written by the process --kill-rank
  // ends, just before it dies, so that the outputs it checked still count.
  const auto make_report = [&] {
    json history = json::array();
    for (const runtime::RebalanceRecord& r : rb.history()) {
      history.push_back({{"trigger_step", r.trigger_step},
                         {"end_step", r.end_step},
                         {"outcome", std::string(runtime::outcome_name(r.outcome))},
                         {"error", r.error},
                         {"slots_moved", r.slots_moved},
                         {"bytes_intra_node", r.bytes_intra_node},
                         {"bytes_inter_node", r.bytes_inter_node},
                         {"bytes_local_copy", r.bytes_local_copy},
                         {"bytes_installed", r.bytes_installed},
                         {"bytes_restored", r.bytes_restored},
                         {"repair", r.repair},
                         {"index", r.index},
                         {"stall_total_ms", r.stall_total_ms},
                         {"stall_max_ms", r.stall_max_ms},
                         {"stall_preempted_ms", r.stall_preempted_ms},
                         {"balancedness_before", r.balancedness_before},
                         {"balancedness_after", r.balancedness_after},
                         {"gain_checked", r.gain_checked},
                         {"below_min_gain", r.below_min_gain},
                         {"priced", r.priced},
                         {"moe_us_before", r.moe_us_before},
                         {"moe_us_after", r.moe_us_after},
                         {"gain_us", r.gain_us},
                         {"price_us", r.price_us}});
    }
    const json report = json{{"rank", me},
                         {"first_step", first_step},
                         {"joined", joining},
                         {"no_service_steps", no_service_steps},
                         {"unavailable", unavailable_at},
                         {"dropped", dropped},
                         {"losses", losses},
                         {"joins", joins},
                         {"stopped", stopped},
                         {"ended", ended},
                         {"steps", step},
                         {"interrupted", interrupted},
                         {"bytes_held", bytes_held},
                         {"computed", computed},
                         {"verified", verified},
                         {"mismatches", mismatches},
                         {"first_mismatch", first_mismatch},
                         {"moe_ms", moe_ms},
                         {"moe_wall_ms", moe_wall_ms},
                         {"cost_samples", cost_samples},
                         {"active_experts", active_experts},
                         {"stall_ms", stall_ms},
                         {"balancedness", balancedness},
                         {"installs", installs},
                         {"history", history},
                         {"metrics", json::parse(runtime::families_to_json(rb.collect_metrics()))}};
    return report.dump();
  };
  // An elastic run prints the steps served even when a rank fails with an error: a process that
  // leaves by an exception leaves its report first, where the launcher looks for it (the error
  // itself reaches the launcher with the exit).
  struct ReportOnError {
    const std::function<void()> write;
    const int exceptions = std::uncaught_exceptions();
    ~ReportOnError() {
      if (std::uncaught_exceptions() <= exceptions) return;
      try {
        write();
      } catch (...) {  // the error that is unwinding is the one to report
      }
    }
  } report_on_error{[&] {
    if (elastic == nullptr) return;
    ended = "failed";
    write_report(elastic->report_path, make_report());
  }};
  while (step < options.steps) {
    if (elastic != nullptr) {
      // --kill-rank: this seat's first process ends itself here, as a lost GPU would.
      if (!joining && me == options.kill_rank && step == options.kill_at_step) {
        ended = "killed";
        write_report(elastic->report_path, make_report());
        std::fflush(stdout);
        std::fflush(stderr);
        ::kill(::getpid(), SIGKILL);
      }
      // EPLB_RUN_TEST_KILL: killed as from outside, with no report left.
      const std::pair<int, int64_t> here{me, step};
      if (!joining && std::find(elastic->outside_kills.begin(), elastic->outside_kills.end(),
                                here) != elastic->outside_kills.end()) {
        std::fflush(stdout);
        std::fflush(stderr);
        ::kill(::getpid(), SIGKILL);
      }
      // --rejoin-at-step: once the new process is up, the members add its seat together.
      if (step == options.rejoin_at_step &&
          std::find(group.seats.begin(), group.seats.end(), options.kill_rank) ==
              group.seats.end()) {
        const auto timeout = std::chrono::milliseconds(options.timeout_ms);
        elastic->board->wait_ready(options.kill_rank, timeout);
        elastic->board->add(options.kill_rank, group.epoch);
        control::MembershipBoard::View view = elastic->board->view();
        if (view.epoch <= group.epoch) view = elastic->board->wait_newer(group.epoch, timeout);
        if (!regroup(view)) break;
      }
    }
    const std::vector<int32_t>& seats = group.seats;  // the senders of this step
    const auto senders = static_cast<int64_t>(seats.size());
    const bool some_unavailable = rb.any_unavailable();
    // This thread's CPU time in each layer's expert compute, and the wall time it took, in ns:
    // [0] the stop flag, then [1 + l] CPU and [1 + L + l] wall, maxed over the ranks below.
    std::fill(step_max.begin(), step_max.end(), 0);
    std::fill(own_counts.begin(), own_counts.end(), 0);
    std::fill(step_active.begin(), step_active.end(), 0);
    double sum_mean = 0, sum_max = 0;
    int64_t step_dropped = 0;
    for (int64_t l = 0; l < L; ++l) {
      // Step 1: route every sender's tokens through this layer's tables, as each sender would.
      // Adaptive dispatch first needs the step's global count of every expert (what an engine
      // has after its all-to-all's layout exchange): every rank computes the same shares from
      // it, and each sender's tokens follow those of the lower ranks (`prefix`).
      const routing::DispatchTables& tables = rb.dispatch(l);
      std::fill(rank_load.begin(), rank_load.end(), 0);
      int64_t layer_dropped = 0;
      for (int64_t i = 0; i < senders; ++i) {
        const int64_t first = (step * G + seats[i]) * T;
        for (int64_t t = 0; t < T; ++t) {
          const auto e = workload.experts_of(l, first + t);
          std::copy(e.begin(), e.end(), experts.begin() + (i * T + t) * k);
        }
      }
      const std::span<const int32_t> sent{experts.data(), static_cast<size_t>(senders * T * k)};
      if (adaptive) {
        std::fill(global_counts.begin(), global_counts.end(), 0);
        routing::count_experts(sent, workload.experts, global_counts);
        if (ticks) {
          routing::adaptive_cost_shares(tables, global_counts, *ticks, shares);
        } else {
          routing::adaptive_shares(tables, global_counts, shares);
        }
        std::fill(prefix.begin(), prefix.end(), 0);
      }
      for (int64_t i = 0; i < senders; ++i) {
        const int64_t g = seats[i];
        const int64_t first = (step * G + g) * T;
        std::span<const int32_t> in{experts.data() + i * T * k, static_cast<size_t>(T * k)};
        std::span<int32_t> out{slots.data() + i * T * k, static_cast<size_t>(T * k)};
        if (adaptive) {
          routing::route_adaptive(tables, shares, prefix, in, k, out);
          routing::count_experts(in, workload.experts, prefix);
        } else {
          routing::route(tables, dispatch, in, k, out, static_cast<uint64_t>(first), g,
                         random_state[g]);
        }
        // This rank's own tokens are recorded once the step is served (below): a step that a
        // lost rank ends is served again, and its loads must count once.
        if (g == me) {
          const std::span<int64_t> counts{own_counts.data() + l * workload.experts,
                                          static_cast<size_t>(workload.experts)};
          routing::count_experts(in, workload.experts, counts);
        }
        // -1: every replica of the expert is lost; the token goes without it.
        for (size_t c = 0; c < out.size(); ++c) {
          if (out[c] >= 0) {
            ++rank_load[out[c] / spr];
            if (served_mark[in[c]] != mark) {
              served_mark[in[c]] = mark;
              ++step_active[l];
            }
          } else {
            ++layer_dropped;
          }
        }
      }
      ++mark;
      // The mean is over the members (a lost seat holds no slot that serves) and counts what
      // reached a rank: a choice dropped for want of a replica loads no rank, and counted in the
      // mean it would lift the balancedness above 1. The dropped ones are reported apart.
      const int64_t max_load = *std::max_element(rank_load.begin(), rank_load.end());
      sum_mean += static_cast<double>(senders * T * k - layer_dropped) /
                  static_cast<double>(senders);
      sum_max += static_cast<double>(max_load);
      step_dropped += layer_dropped;

      // Step 2: compute the expert outputs of every (token, expert) this rank's slots received,
      // slot by slot as a grouped expert kernel does (each slot's weights are read once per
      // step, not once per token), so that the time follows the tokens a rank computes.
      const auto* gate_up = reinterpret_cast<const float*>(rb.weights(l, 0).data());
      const auto* down = reinterpret_cast<const float*>(rb.weights(l, 1).data());
      outputs.clear();
      pending.clear();
      received.clear();
      for (int64_t i = 0; i < senders * T * k; ++i) {
        if (slots[i] >= 0 && slots[i] / spr == me) received.push_back({slots[i] % spr, i});
      }
      std::stable_sort(received.begin(), received.end(),
                       [](const Received& a, const Received& b) { return a.local < b.local; });
      const auto start = Clock::now();
      const double cpu_start = thread_cpu_ms();
      for (const Received& r : received) {
        const int64_t g = seats[r.entry / (T * k)], t = (r.entry / k) % T, j = r.entry % k;
        const int64_t token = (step * G + g) * T + t;
        generate_activation(shape.hidden, step, token, l, x);
        expert_forward(shape, gate_up + r.local * shape.gate_up_floats(),
                       down + r.local * shape.down_floats(), x.data(), scratch.data(), y.data());
        ++computed;
        if (verified_token(options.verify_every, step, token)) {
          pending.push_back({workload.experts_of(l, token)[j], token, outputs.size()});
          outputs.insert(outputs.end(), y.begin(), y.end());
        }
      }
      step_max[1 + l] = std::llround((thread_cpu_ms() - cpu_start) * 1e6);
      int64_t activated = 0;
      for (size_t i = 0; i < received.size(); ++i) {
        activated += i == 0 || received[i].local != received[i - 1].local ? 1 : 0;
      }
      step_own[3 * l] = activated;
      step_own[3 * l + 1] = static_cast<int64_t>(received.size());
      step_own[3 * l + 2] = step_max[1 + l];
      step_max[1 + L + l] = std::llround(ms_since(start) * 1e6);

      // Step 3: check the sampled outputs against the logical expert the token chose, from
      // reference weights generated afresh (once per expert).
      std::sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
        return a.expert != b.expert ? a.expert < b.expert : a.output < b.output;
      });
      int32_t generated = -1;
      for (const Pending& p : pending) {
        if (p.expert != generated) {
          generate_weights(shape, l, p.expert, Tensor::kGateUp, reference_gate_up);
          generate_weights(shape, l, p.expert, Tensor::kDown, reference_down);
          generated = p.expert;
        }
        generate_activation(shape.hidden, step, p.token, l, x);
        expert_forward(shape, reference_gate_up.data(), reference_down.data(), x.data(),
                       scratch.data(), reference_y.data());
        ++verified;
        if (std::memcmp(reference_y.data(), outputs.data() + p.output,
                        reference_y.size() * sizeof(float)) != 0) {
          if (mismatches == 0) {
            first_mismatch = fmt::format("step {} layer {} token {} expert {} on rank {}", step, l,
                                         p.token, p.expert, me);
          }
          ++mismatches;
        }
      }
    }
    const double step_balancedness = sum_max > 0 ? sum_mean / sum_max : 1.0;

    // Step 4: the all-to-alls that keep expert-parallel ranks in step, carrying the stop flag
    // so that every rank stops at the same step, and each layer's compute times: every layer
    // waits for its busiest rank, so a step's MoE time is the sum over the layers of the
    // slowest rank's time in each (what the balancedness measures, in time).
    step_max[0] = stop != nullptr && stop->load() != 0 ? 1 : 0;
    try {
      group.lockstep->all_reduce(step_max, control::ReduceOp::kMax);
    } catch (const Error& e) {
      // A rank is gone (elastic runs): this step served nobody. The survivors form the group the
      // board names next, reconfigure, and serve the step again. No new group: no rank was lost,
      // the collective itself failed (its peers too slow under load): say which, and whom.
      if (elastic == nullptr) throw;
      ++no_service_steps;
      const auto timeout = std::chrono::milliseconds(options.timeout_ms);
      control::MembershipBoard::View next;
      try {
        next = elastic->board->wait_newer(group.epoch, timeout);
      } catch (const Timeout&) {
        fail<Timeout>("the lockstep all-reduce ending step ", step, " (group of epoch ",
                      group.epoch, ", whose ranks are seats ",
                      fmt::format("{}", fmt::join(group.seats, ", ")), ") failed: ", e.what(),
                      "; no rank was lost (no new group within --timeout-ms ", options.timeout_ms,
                      "): raise --timeout-ms under load");
      }
      if (!regroup(next)) break;
      continue;
    }
    for (int64_t l = 0; l < L; ++l) {
      rb.record_counts(l, {own_counts.data() + l * workload.experts,
                           static_cast<size_t>(workload.experts)});
    }
    balancedness.push_back(step_balancedness);
    unavailable_at.push_back(some_unavailable ? 1 : 0);
    dropped.push_back(step_dropped);
    double cpu_ns = 0, wall_ns = 0;
    for (int64_t l = 0; l < L; ++l) {
      cpu_ns += static_cast<double>(step_max[1 + l]);
      wall_ns += static_cast<double>(step_max[1 + L + l]);
    }
    moe_ms.push_back(cpu_ns / 1e6);
    moe_wall_ms.push_back(wall_ns / 1e6);
    cost_samples.insert(cost_samples.end(), step_own.begin(), step_own.end());
    active_experts.insert(active_experts.end(), step_active.begin(), step_active.end());

    // The cost model the ranks fit where none is given: adaptive_cost's once, from the steps
    // before `interval` (its shares from that step on); min_gain's before every trigger (this
    // step_end), from every step so far.
    const bool fit_dispatch = by_cost && !ticks && step + 1 == options.interval;
    const bool fit_gain = options.min_gain > 0 && !options.cost && options.mode != "off" &&
                          (step + 1) % options.interval == 0;
    if (fit_dispatch || fit_gain) {
      std::string why;
      const placement::CostModel model =
          fit_run_cost(*group.lockstep, cost_samples, first_step, L, why);
      if (fit_dispatch) ticks = routing::cost_ticks(model);
      if (fit_gain) rb.set_cost_model(model);
      if (!why.empty() && me == 0 && !fit_failure_said) {
        fmt::print(stderr, "eplb run: the ranks' cost model could not be fitted at step {} ({}): "
                           "{} with the tokens preset (1 us per token) until it can\n",
                   step, why, fit_gain ? "min_gain's check prices" : "adaptive_cost splits");
        fit_failure_said = true;
      }
    }

    const int64_t installed = rb.installed_layers();
    // The step's stall as the runtime counts it: step_end's time less its waits for a core.
    const auto start = Clock::now();
    const int64_t waited = runtime::run_queue_wait_ns();
    rb.step_end();
    const double wall = ms_since(start);
    const int64_t waited_after = waited >= 0 ? runtime::run_queue_wait_ns() : -1;
    stall_ms.push_back(
        waited_after >= waited
            ? wall - std::min(wall, static_cast<double>(waited_after - waited) / 1e6)
            : wall);
    installs.push_back(rb.installed_layers() - installed);
    if (snapshots) snapshots->maybe_write(rb);
    if (progress) {
      fmt::print("\r  step {}/{}  rebalances {}  balancedness {:.3f}", step + 1, options.steps,
                 rb.history().size(), balancedness.back());
      std::fflush(stdout);
    }
    ++step;
    if (step_max[0] != 0) {
      interrupted = true;
      break;
    }
  }
  if (progress) {
    fmt::print("\r\033[K");
    std::fflush(stdout);
  }
  rb.shutdown();

  if (snapshots) write_snapshot(rb, snapshot_path(options.live_metrics_dir, me));
  return make_report();
}

}  // namespace eplb::emu
