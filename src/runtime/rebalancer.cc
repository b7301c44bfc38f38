#include "eplb/runtime/rebalancer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/config.h"
#include "runtime/control_thread.h"
#include "runtime/cpu_wait.h"
#include "runtime/failure.h"
#include "runtime/impl.h"

#include "runtime/compute.h"
#include "runtime/stage.h"

// Rebalancer::Impl's construction and forward thread (record_pass, dispatch, step_end,
// shutdown), and the public Rebalancer, which calls Impl where Impl does the work and the part
// that owns a value (the weight store, the group state, the protocol, the records, the
// recorder) where Impl would only pass the call on. impl.h lists where each step of a
// rebalance lives.

namespace eplb::runtime {

// A joining rank in `seat`: no group until reconfigure().
Rebalancer::Impl::Impl(Config config, control::Communicator& communicator,
                       transport::Transport& transport, WeightSpec spec,
                       const Placement& initial)
    : Impl(std::move(config), std::move(spec), communicator.rank(), &initial, &communicator,
           &transport) {}

Rebalancer::Impl::Impl(Config config, WeightSpec spec, int seat)
    : Impl(std::move(config), std::move(spec), seat, nullptr, nullptr, nullptr) {}

Rebalancer::Impl::Impl(Config config, WeightSpec spec, int seat, const Placement* initial,
                       control::Communicator* communicator, transport::Transport* transport)
    : config_(std::move(config)),
      comm_(communicator),
      spec_(std::move(spec)),
      seat_(seat),
      weights_(config_, spec_, seat, transport),
      group_(config_.layout, spec_.layers, initial == nullptr),
      recorder_(spec_.layers, config_.layout.experts, std::max<int64_t>(config_.window, 1)),
      gain_book_(config_.cost),
      protocol_(config_) {
  const Layout& layout = config_.layout;
  const bool joining = initial == nullptr;
  lifecycle_ = joining ? Lifecycle::kJoining : Lifecycle::kBuilt;
  if (joining) {
    EPLB_CHECK(seat >= 0 && seat < layout.ranks, "joining seat ", seat, " is outside [0, ",
               layout.ranks, ") (the layout's ranks)");
  } else {
    EPLB_CHECK_EQ(static_cast<int64_t>(comm_->size()), layout.ranks,
                  "the communicator's size must equal the layout's ranks");
    EPLB_CHECK_EQ(transport->rank(), comm_->rank(),
                  "the transport and the communicator must be of the same rank");
    if (initial->layers != spec_.layers || initial->experts != layout.experts ||
        initial->physical != layout.physical) {
      fail("initial placement is ", initial->layers, " layers x ", initial->experts,
           " experts x ", initial->physical, " slots but the runtime needs ", spec_.layers, " x ",
           layout.experts, " x ", layout.physical, " (weight spec layers, layout)");
    }
    initial->validate();
  }
  const Placement start =
      joining ? trivial_placement(spec_.layers, layout.experts, layout.physical) : *initial;
  phy2log_ = start.phy2log;
  tables_.reserve(static_cast<size_t>(spec_.layers));
  for (int64_t l = 0; l < spec_.layers; ++l) tables_.push_back(build_tables(start, l));
  // Last, once everything is valid: nothing in the engine's registry from a refused config.
  // The monitor exists from here on, so collect_metrics() (any thread) never races its start.
  metrics_ = std::make_unique<RuntimeMetrics>(config_.registry, seat_, config_.metric_labels);
  if (!joining) metrics_->set_members(layout.ranks);
  monitor_ = std::make_unique<Monitor>(
      seat_, layout, config_.stall_warn, config_.timeout, progress_, *metrics_,
      [this](const Failure&, int64_t group) {
        group_.window_failed(group);
      });
}

Rebalancer::Impl::~Impl() { shutdown(); }

// ---------------------------------------------------------------- forward thread
// The engine's seams (engine_maps.h): one pass of its counters, its map tensors.
void Rebalancer::Impl::record_pass(const IntTensor& counts, CountsOf of) {
  const int64_t E = config_.layout.experts;
  if (pass_.step == step_) {
    fail("record_pass: already called at step ", step_, " (once per forward pass, before its "
         "step_end(); nothing of this call was counted)");
  }
  std::vector<int64_t>& pass = pass_.counts;
  pass.resize(static_cast<size_t>(spec_.layers * E));
  read_pass_counts(counts, of, spec_.layers, config_.layout, compact_slots(), phy2log_, pass);
  // The recorder refuses a step count past its limit layer by layer; checked here for every
  // layer first, so an error counts nothing.
  const std::span<const int64_t> open = recorder_.current();
  for (int64_t i = 0; i < spec_.layers * E; ++i) {
    if (pass[i] > stats::LoadRecorder::kMaxStepCount - open[i]) {
      fail("record_pass: layer ", i / E, " expert ", i % E, " would count ",
           open[i] + pass[i], " tokens in one step, more than ",
           stats::LoadRecorder::kMaxStepCount);
    }
  }
  for (int64_t l = 0; l < spec_.layers; ++l) {
    recorder_.record_counts(l, {pass.data() + l * E, static_cast<size_t>(E)});
  }
  pass_.step = step_;
}

void Rebalancer::Impl::bind_maps(std::vector<MapBinding> maps) {
  maps_.bind(std::move(maps), spec_.layers, config_.layout, compact_slots());
  for (int64_t l = 0; l < spec_.layers; ++l) write_maps(l);
}

const routing::DispatchTables& Rebalancer::Impl::dispatch(int64_t layer) const {
  EPLB_CHECK(layer >= 0 && layer < spec_.layers, "dispatch: layer ", layer, " is outside [0, ",
             spec_.layers, ")");
  return tables_[layer];
}

std::span<const int32_t> Rebalancer::Impl::phy2log(int64_t layer) const {
  EPLB_CHECK(layer >= 0 && layer < spec_.layers, "phy2log: layer ", layer, " is outside [0, ",
             spec_.layers, ")");
  return {phy2log_.data() + layer * config_.layout.physical,
          static_cast<size_t>(config_.layout.physical)};
}

Placement Rebalancer::Impl::placement() const {
  Placement p(spec_.layers, config_.layout.experts, config_.layout.physical);
  p.phy2log = phy2log_;
  p.derive_from_phy2log();
  return p;
}

void Rebalancer::Impl::set_cost_model(const placement::CostModel& model) {
  model.validate();
  gain_book_.set_model(model);
}

void Rebalancer::Impl::step_end() {
  EPLB_CHECK(lifecycle_ == Lifecycle::kConnected,
             "step_end() needs connect() first (a joining rank: reconfigure())");
  EPLB_CHECK(!shut_down_, "step_end() after shutdown()");
  const auto start = Clock::now();
  const int64_t waited_before = run_queue_wait_ns();
  recorder_.step_end();
  ++step_;
  // The window is measured under the placement it was served with: the one in force before
  // this step's protocol installs anything (sync mode installs a whole rebalance here).
  // Balancedness period 0: every interval (never with interval 0, no rebalance of the
  // runtime's own); below 0 never.
  const int64_t period = config_.balancedness_period == 0 ? config_.interval
                                                          : config_.balancedness_period;
  const bool measure = period > 0 && step_ % period == 0;
  std::vector<int32_t> served_with;
  ServedBy served_by;
  if (measure) {
    served_with = phy2log_;
    served_by = served_by_now();
  }
  std::optional<std::vector<int64_t>> all_reduced;  // sync: a window triggered at this step
  if (config_.mode == Mode::kAsync) {
    step_end_async();
  } else {
    step_end_sync(all_reduced);
  }
  if (measure) {
    submit_balancedness(std::move(served_with), std::move(served_by), std::move(all_reduced));
  }
  protocol_.publish_step(step_);
  const double wall_ms = ms_between(start, Clock::now());
  metrics_->on_step();
  if (!records_.open) return;
  // The stall is what eplb kept the forward thread for: its work and its waits for peers, not
  // the time the OS ran other threads on the core (cpu_wait.h).
  const int64_t waited_after = waited_before >= 0 ? run_queue_wait_ns() : -1;
  const double preempted_ms =
      waited_after >= waited_before
          ? std::min(wall_ms, static_cast<double>(waited_after - waited_before) / 1e6)
          : 0.0;
  const double ms = wall_ms - preempted_ms;
  records_.open->stall_total_ms += ms;
  records_.open->stall_max_ms = std::max(records_.open->stall_max_ms, ms);
  records_.open->stall_preempted_ms += preempted_ms;
  metrics_->on_stall(ms / 1000.0);
  metrics_->set_age_steps(step_ - records_.open->trigger_step);
  if (records_.ended()) publish_open();
}

Rebalancer::Impl::ServedBy Rebalancer::Impl::served_by_now() const {
  ServedBy by;
  if (!group_.all_members()) by.members = group_.members();
  if (!group_.all_usable()) by.usable = group_.usable();
  return by;
}

// At steps that are multiples of the balancedness period, after this step's protocol: the
// window for the monitor thread to measure under `phy2log`. A rebalance triggered at this step
// all-reduced it already (that result is shared); with one in flight since an earlier step
// there is no measurement (no collective queues up among its agreements); else one all-reduce,
// on every rank alike. `served_by`: the group's seats and usable slots when `phy2log` served.
void Rebalancer::Impl::submit_balancedness(std::vector<int32_t> phy2log, ServedBy served_by,
                                           std::optional<std::vector<int64_t>> all_reduced) {
  // Triggered at this step: its window is this very window, all-reduced already.
  if (all_reduced) {
    std::promise<CollectiveResult> ready;
    ready.set_value({.values = std::move(*all_reduced), .failure = std::nullopt});
    monitor_->measure(ready.get_future().share(), std::move(phy2log), step_, group_.group(),
                      std::move(served_by.members), std::move(served_by.usable));
    return;
  }
  if (protocol_.active() && records_.open && records_.open->trigger_step == step_) {
    monitor_->measure(protocol_.active()->window, std::move(phy2log), step_, group_.group(),
                      std::move(served_by.members), std::move(served_by.usable));
    return;
  }
  // In flight since an earlier step (its agreements must not wait behind a window), or a
  // broken control plane (no collective runs any more): no figure this time.
  if (records_.open || control_broken()) return;
  std::vector<int64_t> window(static_cast<size_t>(spec_.layers * config_.layout.experts));
  recorder_.snapshot_window(window);
  monitor_->measure(control_->all_reduce(std::move(window), control::ReduceOp::kSum,
                                         config_.timeout)
                        .share(),
                    std::move(phy2log), step_, group_.group(), std::move(served_by.members),
                    std::move(served_by.usable));
}

void Rebalancer::Impl::save_stats(const std::string& path, stats::LoadFormat format) const {
  stats::LoadHistory history;
  history.steps = recorder_.steps_in_window();
  history.layers = spec_.layers;
  history.experts = config_.layout.experts;
  if (history.steps == 0) fail("save_stats: no step recorded yet (call step_end() first)");
  const std::vector<int64_t> steps = recorder_.window_steps();
  history.values.assign(steps.begin(), steps.end());
  if (format == stats::LoadFormat::kAuto || format == stats::LoadFormat::kTrace) {
    fail("save_stats: format '", stats::load_format_name(format),
         "' cannot be written (choose eplb, sglang, vllm or csv)");
  }
  const std::string text = stats::format_load(history, format);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) fail<IoError>("save_stats: cannot write '", path, "'");
}

void Rebalancer::Impl::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (protocol_.active()) {
    AsyncProtocol::cancel_worker(*protocol_.active());
    if (records_.open) {
      records_.open->outcome = Outcome::kCancelled;
      records_.open->error = "shutdown() while the rebalance ran";
      close_open(std::nullopt);
      publish_open();
    }
    protocol_.finish(false);
  }
  worker_.stop();
  if (control_) control_->stop();
  if (monitor_) monitor_->stop();
  protocol_.drop_agreements();
  metrics_->set_in_flight({});
}

bool Rebalancer::Impl::control_broken() const {
  // A failed window of the monitor names the group it belonged to: only the current one's
  // breaks anything (an old group's may arrive after reconfigure()).
  return protocol_.control_broken() || group_.window_broken();
}

int64_t Rebalancer::Impl::host_bytes() const {
  EPLB_CHECK(lifecycle_ == Lifecycle::kConnected, "host_bytes() needs connect() first (it "
             "allocates the arena; a joining rank: reconfigure())");
  const auto of = [](const auto& v) {
    return static_cast<int64_t>(v.size() * sizeof(typename std::decay_t<decltype(v)>::value_type));
  };
  int64_t bytes = weights_.device_memory() ? 0 : weights_.bytes_held();
  bytes += stats::LoadRecorder::bytes_for(recorder_.layers(), recorder_.experts(),
                                          recorder_.window());
  bytes += weights_.backup_bytes();
  bytes += of(phy2log_) + of(group_.usable());
  for (const routing::DispatchTables& t : tables_) {
    bytes += of(t.log2phy) + of(t.replica_count) + of(t.static_slot) + of(t.cumulative_share);
  }
  return bytes;
}

std::vector<prometheus::MetricFamily> Rebalancer::Impl::collect_metrics() const {
  if (monitor_) monitor_->refresh();
  return metrics_->registry()->Collect();
}

// The tables of `layer` of `placement` routing only to the slots usable now.
routing::DispatchTables Rebalancer::Impl::build_tables(const Placement& placement,
                                                       int64_t layer) const {
  const Layout& layout = config_.layout;
  const std::span<const uint8_t> row = group_.usable_row(layer);
  const bool all_usable = std::all_of(row.begin(), row.end(), [](uint8_t u) { return u != 0; });
  if (group_.all_members() && all_usable) {
    return routing::build_dispatch_tables(placement, layer, layout);
  }
  return routing::build_dispatch_tables(placement, layer, layout, {},
                                        std::vector<uint8_t>(row.begin(), row.end()));
}

Rebalancer::Rebalancer(Config config, control::Communicator& communicator,
                       transport::Transport& transport, WeightSpec weights, Placement initial) {
  config.validate();
  weights.validate();
  impl_ = std::make_unique<Impl>(std::move(config), communicator, transport, std::move(weights),
                                 initial);
}

Rebalancer::Rebalancer(Config config, WeightSpec weights, int seat) {
  config.validate();
  weights.validate();
  impl_ = std::make_unique<Impl>(std::move(config), std::move(weights), seat);
}

Rebalancer::~Rebalancer() = default;

void Rebalancer::reconfigure(control::Communicator& communicator, transport::Transport& transport,
                             const Membership& membership) {
  impl_->reconfigure(communicator, transport, membership);
}
std::vector<int32_t> Rebalancer::members() const { return impl_->group_.members(); }
std::vector<int32_t> Rebalancer::unavailable(int64_t layer) const {
  return impl_->unavailable(layer);
}
bool Rebalancer::any_unavailable() const { return impl_->any_unavailable(); }
std::vector<int32_t> Rebalancer::backup_experts() const {
  return impl_->weights_.backup_experts();
}
std::span<std::byte> Rebalancer::backup_weights(int64_t layer, int64_t tensor, int32_t expert) {
  return impl_->weights_.backup_weights(layer, tensor, expert);
}
int64_t Rebalancer::backup_bytes() const { return impl_->weights_.backup_bytes(); }
void Rebalancer::fill_backup(
    const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>& fill) {
  impl_->weights_.fill_backup(fill);
}

int64_t Rebalancer::connect() { return impl_->connect(); }
void Rebalancer::record(int64_t layer, std::span<const int32_t> expert_ids) {
  impl_->recorder_.record(layer, expert_ids);
}
void Rebalancer::record_counts(int64_t layer, std::span<const int64_t> counts) {
  impl_->recorder_.record_counts(layer, counts);
}

void Rebalancer::record_pass(const IntTensor& counts, CountsOf of) {
  impl_->record_pass(counts, of);
}

void Rebalancer::bind_maps(std::vector<MapBinding> maps) { impl_->bind_maps(std::move(maps)); }
void Rebalancer::propose(const Placement& placement) { impl_->propose(placement); }
const routing::DispatchTables& Rebalancer::dispatch(int64_t layer) const {
  return impl_->dispatch(layer);
}
std::span<std::byte> Rebalancer::weights(int64_t layer, int64_t tensor) {
  return impl_->weights_.weights(layer, tensor);
}
std::span<const std::byte> Rebalancer::weights(int64_t layer, int64_t tensor) const {
  return impl_->weights_.weights(layer, tensor);
}
std::span<std::byte> Rebalancer::slot_weights(int64_t layer, int64_t tensor, int64_t slot) {
  return impl_->weights_.slot_weights(layer, tensor, slot);
}
std::span<const std::byte> Rebalancer::slot_weights(int64_t layer, int64_t tensor,
                                                    int64_t slot) const {
  return impl_->weights_.slot_weights(layer, tensor, slot);
}
std::span<const int32_t> Rebalancer::phy2log(int64_t layer) const {
  return impl_->phy2log(layer);
}
Placement Rebalancer::placement() const { return impl_->placement(); }
void Rebalancer::step_end() { impl_->step_end(); }
void Rebalancer::set_cost_model(const placement::CostModel& model) {
  impl_->set_cost_model(model);
}
void Rebalancer::save_stats(const std::string& path, stats::LoadFormat format) const {
  impl_->save_stats(path, format);
}
void Rebalancer::shutdown() { impl_->shutdown(); }
int Rebalancer::rank() const { return impl_->seat_; }
int64_t Rebalancer::step() const { return impl_->step_; }
bool Rebalancer::rebalancing() const { return impl_->records_.open.has_value(); }
int64_t Rebalancer::installed_layers() const { return impl_->group_.installed_total(); }
bool Rebalancer::control_broken() const { return impl_->control_broken(); }
int64_t Rebalancer::agreement_contribution() const { return impl_->protocol_.contribution(); }
void Rebalancer::agreement_result(int64_t step, int64_t min_value) {
  impl_->protocol_.hand_in(step, min_value);
}
int64_t Rebalancer::bytes_held() const { return impl_->weights_.bytes_held(); }
int64_t Rebalancer::host_bytes() const { return impl_->host_bytes(); }
std::vector<RebalanceRecord> Rebalancer::history() const { return impl_->records_.history(); }
std::shared_ptr<prometheus::Registry> Rebalancer::registry() const {
  return impl_->metrics_->registry();
}
std::vector<prometheus::MetricFamily> Rebalancer::collect_metrics() const {
  return impl_->collect_metrics();
}
std::string Rebalancer::metrics_text() const {
  return runtime::metrics_text(impl_->collect_metrics());
}
const Config& Rebalancer::config() const { return impl_->config_; }
const WeightSpec& Rebalancer::weight_spec() const { return impl_->spec_; }

void RebalancerTesting::set_delay_hook(Rebalancer& rebalancer,
                                       std::function<void(DelayPoint)> hook) {
  rebalancer.impl_->delay_hook_ = std::move(hook);
}

}  // namespace eplb::runtime
