// One rank process's serving loop (serve.h), phase by phase: RankServer's constructor sets the
// rank up (its weights, the runtime, connect or join); each step routes every sender's tokens
// through the tables (route_layer), computes what this rank's slots received (compute_layer),
// verifies sampled outputs against reference weights (verify_layer), keeps the ranks in step
// (lockstep), and hands the step to the runtime (hand_off: the counts, the cost models,
// step_end); report() is the process's report. Elastic runs add the losses and joins
// (elastic_events, regroup).

#include <fmt/core.h>
#include <fmt/format.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "emu/expert.h"
#include "emu/live_metrics.h"
#include "emu/serve.h"
#include "eplb/control/communicator.h"
#include "eplb/core/clock.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/types.h"
#include "eplb/placement/cost.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/runtime/rebalancer.h"
#include "runtime/cpu_wait.h"

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

class RankServer {
 public:
  // Set-up: the runtime's config and weight spec (the engine's own weights with
  // --weights engine), the Rebalancer, connect() or, for a joining process, the wait for a
  // group that lists its seat and reconfigure(); then the weights and the backup filled.
  RankServer(const RunOptions& options, const Workload& workload, Group group,
             const ElasticContext* elastic, const std::atomic<int>* stop);

  // Serves the steps, then returns the report (JSON text).
  std::string run();

 private:
  enum class Lockstep { kServed, kServeAgain, kStop };

  void join();
  // --kill-rank, EPLB_RUN_TEST_KILL and --rejoin-at-step at this step; false: the run stops.
  bool elastic_events();
  // Routing, compute and verification of every layer of this step.
  void serve_step();
  // Step 1: every sender's tokens through layer `layer`'s tables, as each sender routes them.
  void route_layer(int64_t layer);
  // Step 2: the expert outputs of every (token, expert) this rank's slots received.
  void compute_layer(int64_t layer);
  // Step 3: the sampled outputs against reference weights of the expert the token chose.
  void verify_layer(int64_t layer);
  // Step 4: the all-to-alls' stand-in, carrying the stop flag and each layer's times.
  Lockstep lockstep();
  // Step 5: the step's figures, its counts to the runtime, the cost models, step_end().
  void hand_off();
  bool regroup(control::MembershipBoard::View view);
  std::string report() const;

  const RunOptions& options_;
  const Workload& workload_;
  const ElasticContext* const elastic_;
  const std::atomic<int>* const stop_;
  const int me_;
  const bool joining_;
  const int64_t G_, T_, L_, k_;
  const runtime::Config config_;
  const int64_t spr_;
  const routing::DispatchPolicy dispatch_;
  const bool adaptive_, by_cost_, progress_;
  // Owned here: the group (replaced by each regroup), the engine's weights, then the runtime,
  // which uses both and goes first.
  Group group_;
  std::vector<std::vector<float>> own_;  // [layers][tensors], --weights engine
  std::unique_ptr<runtime::Rebalancer> rebalancer_;
  runtime::Rebalancer& rb_;
  int64_t bytes_held_ = 0;
  std::optional<SnapshotWriter> snapshots_;

  // Routing: every rank replays every sender's replica choice, so each sender has its random
  // stream here; adaptive_cost's model in ticks (the given one, or fitted before step
  // `interval`).
  std::vector<uint64_t> random_state_;
  std::optional<routing::CostTicks> ticks_;
  std::vector<int32_t> experts_;  // every sender's choices, this layer
  std::vector<int64_t> global_counts_, prefix_;
  routing::AdaptiveShares shares_;
  std::vector<int32_t> slots_;
  std::vector<int64_t> rank_load_;
  // Compute and verification.
  std::vector<float> x_, scratch_, y_, reference_y_, reference_gate_up_, reference_down_;
  std::vector<float> outputs_;  // the outputs to verify, this layer
  std::vector<Pending> pending_;
  struct Received {
    int64_t local;  // the slot on this rank
    int64_t entry;  // (sender, token, k) flattened
  };
  std::vector<Received> received_;  // this layer's entries for this rank's slots

  // This step: the senders, and its figures.
  std::vector<int32_t> seats_;
  int64_t senders_ = 0;
  bool some_unavailable_ = false;
  double sum_mean_ = 0, sum_max_ = 0;
  int64_t step_dropped_ = 0;
  // [0] the stop flag, then [1 + l] CPU and [1 + L + l] wall ns of each layer's expert compute,
  // maxed over the ranks by lockstep().
  std::vector<int64_t> step_max_;
  // This rank's own figures of each layer of the step, before the lockstep collective maxes
  // step_max: [l][0] activated slots, [l][1] tokens computed, [l][2] CPU ns. They are the
  // samples the cost model is fitted from (merge_reports).
  std::vector<int64_t> step_own_;
  // The experts that had a token served in each layer of the step, all ranks' tokens (the same
  // on every rank): no placement activates fewer slots, so with the tokens they bound the step's
  // time from below (merge_reports' floor). served_mark[e] == mark: expert e counted already.
  std::vector<int64_t> step_active_;
  std::vector<int64_t> served_mark_;
  int64_t mark_ = 0;
  std::vector<int64_t> own_counts_;  // [layers][experts] this rank's tokens, this step

  // The run's figures, for the report.
  std::vector<int64_t> cost_samples_;    // [steps][layers][3], the steps served
  std::vector<int64_t> active_experts_;  // [steps][layers], the steps served
  bool fit_failure_said_ = false;        // a failed fit of the ranks' cost model, said once
  std::vector<double> moe_ms_, moe_wall_ms_, stall_ms_, balancedness_;
  std::vector<int64_t> installs_, dropped_;
  int64_t mismatches_ = 0, verified_ = 0, computed_ = 0;
  std::string first_mismatch_;
  bool interrupted_ = false;
  // Elastic runs: steps whose tokens some expert could not serve (every replica lost), steps
  // served again after a lost rank ended them, and this process's first step (a joining one
  // starts at the group's step).
  std::vector<uint8_t> unavailable_at_;
  int64_t no_service_steps_ = 0;
  int64_t step_ = 0;
  int64_t first_step_ = 0;
  // Elastic runs: the seats that left the group and joined it, each with the first step served
  // without or with it ([step, seat]), and why this process stopped before the last step (the
  // ranks left too few to hold every expert).
  json losses_ = json::array(), joins_ = json::array();
  std::string stopped_;
  std::string ended_;  // "killed" (--kill-rank) or "failed": a report left before the end
};

runtime::WeightSpec weight_spec(const Workload& workload, const ExpertShape& shape) {
  return {.layers = workload.layers,
          .tensors = {{"gate_up", shape.gate_up_bytes()}, {"down", shape.down_bytes()}}};
}

RankServer::RankServer(const RunOptions& options, const Workload& workload, Group group,
                       const ElasticContext* elastic, const std::atomic<int>* stop)
    : options_(options),
      workload_(workload),
      elastic_(elastic),
      stop_(stop),
      me_(elastic != nullptr ? elastic->seat : group.communicator->rank()),
      joining_(elastic != nullptr && elastic->joining),
      G_(options.ranks),
      T_(options.tokens_per_rank),
      L_(workload.layers),
      k_(workload.top_k),
      config_(make_config(options, workload)),
      spr_(config_.layout.slots_per_rank()),
      dispatch_(config_.dispatch),
      adaptive_(routing::routes_by_shares(dispatch_)),
      by_cost_(dispatch_ == routing::DispatchPolicy::kAdaptiveCost),
      progress_(options.progress && me_ == 0),
      group_(std::move(group)),
      rebalancer_([&] {
        const ExpertShape& shape = options.shape;
        runtime::WeightSpec spec = weight_spec(workload, shape);
        // --weights engine: this rank allocates its experts itself, per layer and tensor,
        // expert-major, as an engine does at model load, and registers them; they never move.
        if (options.weights == "engine") {
          for (int64_t l = 0; l < L_; ++l) {
            for (const int64_t floats : {shape.gate_up_floats(), shape.down_floats()}) {
              own_.emplace_back(static_cast<size_t>(spr_ * floats));
              spec.engine.push_back({.base = own_.back().data(), .stride = 0});
            }
          }
        }
        // A joining process (a new one in a lost seat) has no group and no weights yet: it
        // waits for the group that lists its seat, enters through reconfigure(), and its slots
        // are filled by the repair rebalance that follows.
        return joining_ ? std::make_unique<runtime::Rebalancer>(config_, spec, me_)
                        : std::make_unique<runtime::Rebalancer>(
                              config_, *group_.communicator, *group_.transport, spec,
                              trivial_placement(L_, workload.experts, config_.layout.physical));
      }()),
      rb_(*rebalancer_) {
  if (joining_) {
    join();
  } else {
    rb_.connect();
  }
  bytes_held_ = rb_.bytes_held();
  // --metrics-port: a forked rank's families go to the launcher through a file; a launched
  // rank serves its own.
  if (!options.live_metrics_dir.empty()) {
    snapshots_.emplace(snapshot_path(options.live_metrics_dir, me_),
                       std::chrono::milliseconds(500));
  }
  const auto generate = [&shape = options.shape](int64_t layer, int64_t tensor, int32_t expert,
                                                 std::span<std::byte> bytes) {
    generate_weights_bytes(shape, layer, expert, static_cast<Tensor>(tensor), bytes);
  };
  if (!joining_) runtime::fill_weights(rb_, generate);
  rb_.fill_backup(generate);

  random_state_.resize(static_cast<size_t>(G_));
  for (int64_t g = 0; g < G_; ++g) random_state_[g] = mix64(options.seed * 1000003 + g) | 1;
  if (by_cost_ && options.cost) ticks_ = routing::cost_ticks(*options.cost);
  const ExpertShape& shape = options.shape;
  const auto E = static_cast<size_t>(workload.experts);
  experts_.resize(static_cast<size_t>(G_ * T_ * k_));
  slots_.resize(static_cast<size_t>(G_ * T_ * k_));
  global_counts_.resize(E);
  prefix_.resize(E);
  rank_load_.resize(static_cast<size_t>(G_));
  x_.resize(static_cast<size_t>(shape.hidden));
  scratch_.resize(static_cast<size_t>(2 * shape.intermediate));
  y_.resize(static_cast<size_t>(shape.hidden));
  reference_y_.resize(static_cast<size_t>(shape.hidden));
  reference_gate_up_.resize(static_cast<size_t>(shape.gate_up_floats()));
  reference_down_.resize(static_cast<size_t>(shape.down_floats()));
  step_max_.resize(static_cast<size_t>(1 + 2 * L_));
  step_own_.resize(static_cast<size_t>(3 * L_));
  step_active_.resize(static_cast<size_t>(L_));
  served_mark_.assign(E, -1);
  own_counts_.resize(static_cast<size_t>(L_) * E);
  step_ = rb_.step();
  first_step_ = step_;
}

void RankServer::join() {
  elastic_->board->set_ready(me_, true);
  // As long as it takes the members to reach --rejoin-at-step: the launcher ends this process
  // if the run fails or stops meanwhile.
  control::MembershipBoard::View view = elastic_->board->view();
  while (!view.has(me_)) {
    try {
      view = elastic_->board->wait_newer(view.epoch,
                                         std::chrono::milliseconds(options_.timeout_ms));
    } catch (const Timeout&) {
      if (stop_ != nullptr && stop_->load() != 0) fail<IoError>("stopped before joining");
    }
  }
  group_ = connect_group(options_, elastic_->rendezvous, view, me_);
  rb_.reconfigure(*group_.communicator, *group_.transport, runtime::Membership{view.seats});
}

std::string RankServer::run() {
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
    if (elastic_ == nullptr) return;
    ended_ = "failed";
    write_report(elastic_->report_path, report());
  }};
  while (step_ < options_.steps) {
    if (elastic_ != nullptr && !elastic_events()) break;
    serve_step();
    const Lockstep served = lockstep();
    if (served == Lockstep::kStop) break;
    if (served == Lockstep::kServeAgain) continue;
    hand_off();
    ++step_;
    if (step_max_[0] != 0) {
      interrupted_ = true;
      break;
    }
  }
  if (progress_) {
    fmt::print("\r\033[K");
    std::fflush(stdout);
  }
  rb_.shutdown();
  if (snapshots_) write_snapshot(rb_, snapshot_path(options_.live_metrics_dir, me_));
  return report();
}

bool RankServer::elastic_events() {
  // --kill-rank: this seat's first process ends itself here, as a lost GPU would.
  if (!joining_ && me_ == options_.kill_rank && step_ == options_.kill_at_step) {
    ended_ = "killed";
    write_report(elastic_->report_path, report());
    std::fflush(stdout);
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
  // EPLB_RUN_TEST_KILL: killed as from outside, with no report left.
  const std::pair<int, int64_t> here{me_, step_};
  if (!joining_ && std::find(elastic_->outside_kills.begin(), elastic_->outside_kills.end(),
                             here) != elastic_->outside_kills.end()) {
    std::fflush(stdout);
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
  // --rejoin-at-step: once the new process is up, the members add its seat together.
  if (step_ == options_.rejoin_at_step &&
      std::find(group_.seats.begin(), group_.seats.end(), options_.kill_rank) ==
          group_.seats.end()) {
    const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
    elastic_->board->wait_ready(options_.kill_rank, timeout);
    elastic_->board->add(options_.kill_rank, group_.epoch);
    control::MembershipBoard::View view = elastic_->board->view();
    if (view.epoch <= group_.epoch) view = elastic_->board->wait_newer(group_.epoch, timeout);
    if (!regroup(view)) return false;
  }
  return true;
}

void RankServer::serve_step() {
  seats_ = group_.seats;  // the senders of this step
  senders_ = static_cast<int64_t>(seats_.size());
  some_unavailable_ = rb_.any_unavailable();
  std::fill(step_max_.begin(), step_max_.end(), 0);
  std::fill(own_counts_.begin(), own_counts_.end(), 0);
  std::fill(step_active_.begin(), step_active_.end(), 0);
  sum_mean_ = sum_max_ = 0;
  step_dropped_ = 0;
  for (int64_t l = 0; l < L_; ++l) {
    route_layer(l);
    compute_layer(l);
    verify_layer(l);
  }
}

void RankServer::route_layer(int64_t l) {
  // Adaptive dispatch first needs the step's global count of every expert (what an engine has
  // after its all-to-all's layout exchange): every rank computes the same shares from it, and
  // each sender's tokens follow those of the lower ranks (`prefix`).
  const int64_t E = workload_.experts;
  const routing::DispatchTables& tables = rb_.dispatch(l);
  std::fill(rank_load_.begin(), rank_load_.end(), 0);
  int64_t layer_dropped = 0;
  for (int64_t i = 0; i < senders_; ++i) {
    const int64_t first = (step_ * G_ + seats_[i]) * T_;
    for (int64_t t = 0; t < T_; ++t) {
      const auto e = workload_.experts_of(l, first + t);
      std::copy(e.begin(), e.end(), experts_.begin() + (i * T_ + t) * k_);
    }
  }
  const std::span<const int32_t> sent{experts_.data(), static_cast<size_t>(senders_ * T_ * k_)};
  if (adaptive_) {
    std::fill(global_counts_.begin(), global_counts_.end(), 0);
    routing::count_experts(sent, E, global_counts_);
    if (ticks_) {
      routing::adaptive_cost_shares(tables, global_counts_, *ticks_, shares_);
    } else {
      routing::adaptive_shares(tables, global_counts_, shares_);
    }
    std::fill(prefix_.begin(), prefix_.end(), 0);
  }
  for (int64_t i = 0; i < senders_; ++i) {
    const int64_t g = seats_[i];
    const int64_t first = (step_ * G_ + g) * T_;
    std::span<const int32_t> in{experts_.data() + i * T_ * k_, static_cast<size_t>(T_ * k_)};
    std::span<int32_t> out{slots_.data() + i * T_ * k_, static_cast<size_t>(T_ * k_)};
    if (adaptive_) {
      routing::route_adaptive(tables, shares_, prefix_, in, k_, out);
      routing::count_experts(in, E, prefix_);
    } else {
      routing::route(tables, dispatch_, in, k_, out, static_cast<uint64_t>(first), g,
                     random_state_[g]);
    }
    // This rank's own tokens are recorded once the step is served (hand_off): a step that a
    // lost rank ends is served again, and its loads must count once.
    if (g == me_) {
      const std::span<int64_t> counts{own_counts_.data() + l * E, static_cast<size_t>(E)};
      routing::count_experts(in, E, counts);
    }
    // -1: every replica of the expert is lost; the token goes without it.
    for (size_t c = 0; c < out.size(); ++c) {
      if (out[c] >= 0) {
        ++rank_load_[out[c] / spr_];
        if (served_mark_[in[c]] != mark_) {
          served_mark_[in[c]] = mark_;
          ++step_active_[l];
        }
      } else {
        ++layer_dropped;
      }
    }
  }
  ++mark_;
  // The mean is over the members (a lost seat holds no slot that serves) and counts what
  // reached a rank: a choice dropped for want of a replica loads no rank, and counted in the
  // mean it would lift the balancedness above 1. The dropped ones are reported apart.
  const int64_t max_load = *std::max_element(rank_load_.begin(), rank_load_.end());
  sum_mean_ += static_cast<double>(senders_ * T_ * k_ - layer_dropped) /
               static_cast<double>(senders_);
  sum_max_ += static_cast<double>(max_load);
  step_dropped_ += layer_dropped;
}

void RankServer::compute_layer(int64_t l) {
  // Slot by slot as a grouped expert kernel does (each slot's weights are read once per step,
  // not once per token), so that the time follows the tokens a rank computes.
  const ExpertShape& shape = options_.shape;
  const auto* gate_up = reinterpret_cast<const float*>(rb_.weights(l, 0).data());
  const auto* down = reinterpret_cast<const float*>(rb_.weights(l, 1).data());
  outputs_.clear();
  pending_.clear();
  received_.clear();
  for (int64_t i = 0; i < senders_ * T_ * k_; ++i) {
    if (slots_[i] >= 0 && slots_[i] / spr_ == me_) received_.push_back({slots_[i] % spr_, i});
  }
  std::stable_sort(received_.begin(), received_.end(),
                   [](const Received& a, const Received& b) { return a.local < b.local; });
  const auto start = Clock::now();
  const double cpu_start = thread_cpu_ms();
  for (const Received& r : received_) {
    const int64_t g = seats_[r.entry / (T_ * k_)], t = (r.entry / k_) % T_, j = r.entry % k_;
    const int64_t token = (step_ * G_ + g) * T_ + t;
    generate_activation(shape.hidden, step_, token, l, x_);
    expert_forward(shape, gate_up + r.local * shape.gate_up_floats(),
                   down + r.local * shape.down_floats(), x_.data(), scratch_.data(), y_.data());
    ++computed_;
    if (verified_token(options_.verify_every, step_, token)) {
      pending_.push_back({workload_.experts_of(l, token)[j], token, outputs_.size()});
      outputs_.insert(outputs_.end(), y_.begin(), y_.end());
    }
  }
  step_max_[1 + l] = std::llround((thread_cpu_ms() - cpu_start) * 1e6);
  int64_t activated = 0;
  for (size_t i = 0; i < received_.size(); ++i) {
    activated += i == 0 || received_[i].local != received_[i - 1].local ? 1 : 0;
  }
  step_own_[3 * l] = activated;
  step_own_[3 * l + 1] = static_cast<int64_t>(received_.size());
  step_own_[3 * l + 2] = step_max_[1 + l];
  step_max_[1 + L_ + l] = std::llround(ms_since(start) * 1e6);
}

void RankServer::verify_layer(int64_t l) {
  // Reference weights generated afresh, once per expert.
  const ExpertShape& shape = options_.shape;
  std::sort(pending_.begin(), pending_.end(), [](const Pending& a, const Pending& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.output < b.output;
  });
  int32_t generated = -1;
  for (const Pending& p : pending_) {
    if (p.expert != generated) {
      generate_weights(shape, l, p.expert, Tensor::kGateUp, reference_gate_up_);
      generate_weights(shape, l, p.expert, Tensor::kDown, reference_down_);
      generated = p.expert;
    }
    generate_activation(shape.hidden, step_, p.token, l, x_);
    expert_forward(shape, reference_gate_up_.data(), reference_down_.data(), x_.data(),
                   scratch_.data(), reference_y_.data());
    ++verified_;
    if (std::memcmp(reference_y_.data(), outputs_.data() + p.output,
                    reference_y_.size() * sizeof(float)) != 0) {
      if (mismatches_ == 0) {
        first_mismatch_ = fmt::format("step {} layer {} token {} expert {} on rank {}", step_, l,
                                      p.token, p.expert, me_);
      }
      ++mismatches_;
    }
  }
}

RankServer::Lockstep RankServer::lockstep() {
  // The all-to-alls that keep expert-parallel ranks in step, carrying the stop flag so that
  // every rank stops at the same step, and each layer's compute times: every layer waits for
  // its busiest rank, so a step's MoE time is the sum over the layers of the slowest rank's
  // time in each (what the balancedness measures, in time).
  step_max_[0] = stop_ != nullptr && stop_->load() != 0 ? 1 : 0;
  try {
    group_.lockstep->all_reduce(step_max_, control::ReduceOp::kMax);
  } catch (const Error& e) {
    // A rank is gone (elastic runs): this step served nobody. The survivors form the group the
    // board names next, reconfigure, and serve the step again. No new group: no rank was lost,
    // the collective itself failed (its peers too slow under load): say which, and whom.
    if (elastic_ == nullptr) throw;
    ++no_service_steps_;
    const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
    control::MembershipBoard::View next;
    try {
      next = elastic_->board->wait_newer(group_.epoch, timeout);
    } catch (const Timeout&) {
      fail<Timeout>("the lockstep all-reduce ending step ", step_, " (group of epoch ",
                    group_.epoch, ", whose ranks are seats ",
                    fmt::format("{}", fmt::join(group_.seats, ", ")), ") failed: ", e.what(),
                    "; no rank was lost (no new group within --timeout-ms ", options_.timeout_ms,
                    "): raise --timeout-ms under load");
    }
    if (!regroup(next)) return Lockstep::kStop;
    return Lockstep::kServeAgain;
  }
  return Lockstep::kServed;
}

void RankServer::hand_off() {
  const int64_t E = workload_.experts;
  for (int64_t l = 0; l < L_; ++l) {
    rb_.record_counts(l, {own_counts_.data() + l * E, static_cast<size_t>(E)});
  }
  balancedness_.push_back(sum_max_ > 0 ? sum_mean_ / sum_max_ : 1.0);
  unavailable_at_.push_back(some_unavailable_ ? 1 : 0);
  dropped_.push_back(step_dropped_);
  double cpu_ns = 0, wall_ns = 0;
  for (int64_t l = 0; l < L_; ++l) {
    cpu_ns += static_cast<double>(step_max_[1 + l]);
    wall_ns += static_cast<double>(step_max_[1 + L_ + l]);
  }
  moe_ms_.push_back(cpu_ns / 1e6);
  moe_wall_ms_.push_back(wall_ns / 1e6);
  cost_samples_.insert(cost_samples_.end(), step_own_.begin(), step_own_.end());
  active_experts_.insert(active_experts_.end(), step_active_.begin(), step_active_.end());

  // The cost model the ranks fit where none is given: adaptive_cost's once, from the steps
  // before `interval` (its shares from that step on); min_gain's before every trigger (this
  // step_end), from every step so far.
  const bool fit_dispatch = by_cost_ && !ticks_ && step_ + 1 == options_.interval;
  const bool fit_gain = options_.min_gain > 0 && !options_.cost && options_.mode != "off" &&
                        (step_ + 1) % options_.interval == 0;
  if (fit_dispatch || fit_gain) {
    std::string why;
    const placement::CostModel model =
        fit_run_cost(*group_.lockstep, cost_samples_, first_step_, L_, why);
    if (fit_dispatch) ticks_ = routing::cost_ticks(model);
    if (fit_gain) rb_.set_cost_model(model);
    if (!why.empty() && me_ == 0 && !fit_failure_said_) {
      fmt::print(stderr, "eplb run: the ranks' cost model could not be fitted at step {} ({}): "
                         "{} with the tokens preset (1 us per token) until it can\n",
                 step_, why, fit_gain ? "min_gain's check prices" : "adaptive_cost splits");
      fit_failure_said_ = true;
    }
  }

  const int64_t installed = rb_.installed_layers();
  // The step's stall as the runtime counts it: step_end's time less its waits for a core.
  const auto start = Clock::now();
  const int64_t waited = runtime::run_queue_wait_ns();
  rb_.step_end();
  const double wall = ms_since(start);
  const int64_t waited_after = waited >= 0 ? runtime::run_queue_wait_ns() : -1;
  stall_ms_.push_back(
      waited_after >= waited
          ? wall - std::min(wall, static_cast<double>(waited_after - waited) / 1e6)
          : wall);
  installs_.push_back(rb_.installed_layers() - installed);
  if (snapshots_) snapshots_->maybe_write(rb_);
  if (progress_) {
    fmt::print("\r  step {}/{}  rebalances {}  balancedness {:.3f}", step_ + 1, options_.steps,
               rb_.history().size(), balancedness_.back());
    std::fflush(stdout);
  }
}

// Moves this process onto the group of `view`: new communicators and transport, then
// reconfigure(); the old group's objects go only after that. Returns false, with `stopped`
// saying why, when the group's slots cannot hold every expert: the run stops there, on every
// member at the same step, since each decides from the same view (docs/elastic.md, "Lost
// ranks"). A group that changes again while it forms (another rank lost) is given up for the
// newer one.
bool RankServer::regroup(control::MembershipBoard::View view) {
  for (;;) {
    std::vector<int32_t> left;
    for (const int32_t seat : group_.seats) {
      if (!view.has(seat)) left.push_back(seat);
    }
    const auto live_slots = static_cast<int64_t>(view.seats.size()) * spr_;
    if (live_slots < workload_.experts) {
      for (const int32_t seat : left) losses_.push_back({step_, seat});
      std::string who;
      for (size_t i = 0; i < left.size(); ++i) {
        who += fmt::format("{}{}", i == 0 ? "" : ", ", left[i]);
      }
      stopped_ = fmt::format(
          "after losing rank{} {} at step {}, the {} ranks left hold {} slots per layer ({} "
          "each), fewer than the {} experts: every expert needs a slot on a live rank",
          left.size() == 1 ? "" : "s", who, step_, view.seats.size(), live_slots, spr_,
          workload_.experts);
      return false;
    }
    try {
      Group next = connect_group(options_, elastic_->rendezvous, view, me_);
      rb_.reconfigure(*next.communicator, *next.transport, runtime::Membership{view.seats});
      for (const int32_t seat : left) losses_.push_back({step_, seat});
      for (const int32_t seat : view.seats) {
        if (std::find(group_.seats.begin(), group_.seats.end(), seat) == group_.seats.end()) {
          joins_.push_back({step_, seat});
        }
      }
      group_ = std::move(next);
      return true;
    } catch (const Error&) {
      // reconfigure() leaves this rank as it was: try the newer group, if there is one.
      const control::MembershipBoard::View newer = elastic_->board->view();
      if (newer.epoch <= view.epoch) throw;
      view = newer;
    }
  }
}

// This process's report (what run_local merges); also written by the process --kill-rank
// ends, just before it dies, so that the outputs it checked still count.
std::string RankServer::report() const {
  json history = json::array();
  for (const runtime::RebalanceRecord& r : rb_.history()) {
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
  const json report = json{{"rank", me_},
                           {"first_step", first_step_},
                           {"joined", joining_},
                           {"no_service_steps", no_service_steps_},
                           {"unavailable", unavailable_at_},
                           {"dropped", dropped_},
                           {"losses", losses_},
                           {"joins", joins_},
                           {"stopped", stopped_},
                           {"ended", ended_},
                           {"steps", step_},
                           {"interrupted", interrupted_},
                           {"bytes_held", bytes_held_},
                           {"computed", computed_},
                           {"verified", verified_},
                           {"mismatches", mismatches_},
                           {"first_mismatch", first_mismatch_},
                           {"moe_ms", moe_ms_},
                           {"moe_wall_ms", moe_wall_ms_},
                           {"cost_samples", cost_samples_},
                           {"active_experts", active_experts_},
                           {"stall_ms", stall_ms_},
                           {"balancedness", balancedness_},
                           {"installs", installs_},
                           {"history", history},
                           {"metrics",
                            json::parse(runtime::families_to_json(rb_.collect_metrics()))}};
  return report.dump();
}

}  // namespace

std::string serve(const RunOptions& options, const Workload& workload, Group group,
                  const ElasticContext* elastic, const std::atomic<int>* stop) {
  RankServer server(options, workload, std::move(group), elastic, stop);
  return server.run();
}

}  // namespace eplb::emu
