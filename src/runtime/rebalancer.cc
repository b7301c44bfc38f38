#include "eplb/runtime/rebalancer.h"

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/config.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/plan.h"

namespace eplb::runtime {
namespace {

// The worker and control threads yield to the forward thread: under SCHED_BATCH, waking them
// (a submitted agreement, an installed layer) does not preempt the thread that woke them.
// Their latency is hidden by the lag; the forward thread's is not. Best effort.
void make_background_thread() {
  sched_param param{};
  param.sched_priority = 0;
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
}

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The state one rebalance shares between the forward thread and the worker (async mode).
//   written by the worker, read by the forward thread after an acquire load of `progress`:
//     plan (before progress >= 1), failure (before progress < 0);
//   written by the forward thread under `mu`, waited on by the worker: installed, cancel.
struct Active {
  // Set by the forward thread before the worker sees it; then read-only.
  std::vector<int32_t> current_phy2log;  // [layers][physical] at the trigger
  BufferMap map;                         // at the trigger
  std::future<CollectiveResult> window;  // the worker's alone

  // Progress this rank contributes to the agreement: -1 - rank after a failure, 0 while
  // the placement is computed, 1 + the number of moved layers staged.
  std::atomic<int64_t> progress{0};
  RebalancePlan plan;
  Failure failure;

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

// Every catch on a runtime thread takes everything (a foreign exception type from a hook or a
// backend is still an error to report, never a reason to end the process from a thread the
// engine does not own, or to leave a rebalance half done) and keeps it as a Failure: plain
// values, never the exception object, cross to another thread (failure.h).

// What a worker that failed leaves for the forward thread: its failure first, then (release)
// the failure in the progress value.
void worker_failed(Active& a, int rank, Failure failure) {
  a.failure = std::move(failure);
  a.progress.store(-1 - rank, std::memory_order_release);
}

}  // namespace

class Rebalancer::Impl {
 public:
  Impl(Config config, control::Communicator& communicator, transport::Transport& transport,
       WeightSpec spec, const Placement& initial)
      : config_(std::move(config)),
        comm_(communicator),
        transport_(transport),
        spec_(std::move(spec)),
        rank_(communicator.rank()),
        layers_(spec_.layers),
        recorder_(spec_.layers, config_.layout.experts, std::max<int64_t>(config_.window, 1)),
        map_(spec_.layers),
        external_(static_cast<size_t>(config_.lag + 2)) {
    const Layout& layout = config_.layout;
    EPLB_CHECK_EQ(static_cast<int64_t>(comm_.size()), layout.ranks,
                  "the communicator's size must equal the layout's ranks");
    EPLB_CHECK_EQ(transport_.rank(), comm_.rank(),
                  "the transport and the communicator must be of the same rank");
    if (initial.layers != layers_ || initial.experts != layout.experts ||
        initial.physical != layout.physical) {
      fail("initial placement is ", initial.layers, " layers x ", initial.experts,
           " experts x ", initial.physical, " slots but the runtime needs ", layers_, " x ",
           layout.experts, " x ", layout.physical, " (weight spec layers, layout)");
    }
    initial.validate();
    // The arena: layers + 1 buffers of every tensor's slots on this rank.
    const int64_t layer_bytes = checked_mul(spec_.expert_bytes(), layout.slots_per_rank(),
                                            "the bytes of one layer on a rank");
    checked_mul(layer_bytes, layers_ + 1, "the bytes of a rank's weights and staging");
    arena_ = ArenaLayout(spec_, layout.slots_per_rank());
    if (spec_.engine_weights()) {
      map_ = BufferMap(0);  // the arena is the staging layer alone: buffer 0
      check_engine_slots_apart();
    }
    phy2log_ = initial.phy2log;
    tables_.reserve(static_cast<size_t>(layers_));
    for (int64_t l = 0; l < layers_; ++l) {
      tables_.push_back(routing::build_dispatch_tables(initial, l, layout));
    }
  }

  ~Impl() { shutdown(); }

  // No two slots of the engine's tensors may share a byte: an install into one would change
  // the other (the same tensor given for two layers, say). Interleaved layouts are fine.
  void check_engine_slots_apart() const {
    const int64_t spr = config_.layout.slots_per_rank();
    struct Slot {
      uintptr_t begin, end;
      int64_t layer, tensor;
    };
    std::vector<Slot> slots;
    for (int64_t l = 0; l < layers_; ++l) {
      for (int64_t t = 0; t < arena_.tensors(); ++t) {
        const int64_t stride = spec_.stride(l, t);
        checked_mul(stride, spr, "the bytes of a tensor");
        const auto base = reinterpret_cast<uintptr_t>(spec_.memory(l, t).base);
        for (int64_t j = 0; j < spr; ++j) {
          const uintptr_t begin = base + static_cast<uintptr_t>(j * stride);
          slots.push_back({begin, begin + static_cast<uintptr_t>(arena_.tensor_bytes(t)), l, t});
        }
      }
    }
    // Ties broken by layer and tensor, so the message is the same on every run.
    std::sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
      return std::tie(a.begin, a.layer, a.tensor) < std::tie(b.begin, b.layer, b.tensor);
    });
    for (size_t i = 1; i < slots.size(); ++i) {
      if (slots[i].begin < slots[i - 1].end) {
        fail("weight spec: layer ", slots[i - 1].layer, " tensor '",
             spec_.tensors[static_cast<size_t>(slots[i - 1].tensor)].name, "' and layer ",
             slots[i].layer, " tensor '", spec_.tensors[static_cast<size_t>(slots[i].tensor)].name,
             "' overlap in memory: every slot of every layer and tensor needs bytes of its own");
      }
    }
  }

  // ---------------------------------------------------------------- start-up
  int64_t connect() {
    EPLB_CHECK(!connected_, "connect() was already called");
    const std::chrono::milliseconds timeout = config_.timeout;
    if (transport_.capabilities().device_memory && !config_.installer) {
      fail("the ", transport_.backend(), " transport keeps the weights in device memory: set "
           "Config::installer (eplb::cuda::StreamInstaller on the engine's stream) so that "
           "installs are ordered with the engine's queued work");
    }
    // Step 1: the arena, staging included, as one region; or the staging layer alone and the
    // engine's tensors registered, one region each.
    const bool engine = spec_.engine_weights();
    region_ = transport_.allocate(
        static_cast<size_t>(engine ? arena_.layer_bytes() : arena_.total_bytes()));
    if (engine) register_engine_tensors();
    // Step 2: exchange (fingerprint, region id, descriptor) with every peer.
    const std::vector<std::byte> descriptor = transport_.export_descriptor();
    const uint64_t fingerprint = config_fingerprint(config_, spec_);
    std::vector<std::byte> mine(sizeof(uint64_t) + sizeof(int32_t) + descriptor.size());
    const int32_t region_id = region_.id;
    std::memcpy(mine.data(), &fingerprint, sizeof fingerprint);
    std::memcpy(mine.data() + sizeof fingerprint, &region_id, sizeof region_id);
    std::memcpy(mine.data() + sizeof fingerprint + sizeof region_id, descriptor.data(),
                descriptor.size());
    const std::vector<control::Bytes> all = comm_.all_gather(mine, timeout);
    peer_region_.assign(all.size(), 0);
    for (size_t g = 0; g < all.size(); ++g) {
      const control::Bytes& b = all[g];
      uint64_t theirs = 0;
      EPLB_CHECK_GE(b.size(), sizeof theirs + sizeof(int32_t), "runtime: short descriptor");
      std::memcpy(&theirs, b.data(), sizeof theirs);
      if (theirs != fingerprint) {
        fail("runtime: rank ", g, " has a different configuration or weight spec than rank ",
             rank_, " (layout, interval, window, policy, lag, mode, peers_per_round and tensor "
             "sizes must be the same on every rank)");
      }
      std::memcpy(&peer_region_[g], b.data() + sizeof theirs, sizeof(int32_t));
      // The engine's tensors follow the staging region in the same order on every rank, so
      // their region ids are the same everywhere when the staging regions' are.
      if (engine && peer_region_[g] != region_id) {
        fail("runtime: rank ", g, " registered its regions in another order than rank ", rank_,
             " (staging region ", peer_region_[g], " against ", region_id,
             "): create the transport for the Rebalancer alone, or register the same regions "
             "before connect() on every rank");
      }
      if (static_cast<int>(g) != rank_) {
        transport_.import_descriptor(
            static_cast<int>(g),
            std::span<const std::byte>(b).subspan(sizeof theirs + sizeof(int32_t)));
      }
    }
    // Step 3: one small read from every peer proves every connection now, not at the first
    // rebalance.
    constexpr size_t kProbe = 8;
    std::vector<std::byte> probe(kProbe * all.size());
    std::vector<transport::Read> reads;
    for (int g = 0; g < static_cast<int>(all.size()); ++g) {
      if (g == rank_) continue;
      // With the engine's tensors, from the first of them: what rebalances will read.
      reads.push_back({.peer = g,
                       .region = engine ? engine_.at.front().region : peer_region_[g],
                       .offset = 0,
                       .dst = probe.data() + kProbe * g,
                       .bytes = std::min<size_t>(
                           kProbe, engine ? static_cast<size_t>(arena_.tensor_bytes(0))
                                          : region_.bytes)});
    }
    if (!reads.empty()) {
      std::unique_ptr<transport::Batch> batch = transport_.post(reads);
      batch->wait(timeout);
    }
    comm_.barrier(timeout);
    // Step 4: the threads. From here on only the control thread calls the communicator.
    control_ = std::make_unique<ControlThread>(
        comm_, [this] { if (config_.delay_hook) config_.delay_hook(DelayPoint::kControl); },
        make_background_thread);
    worker_ = std::thread([this] {
      make_background_thread();
      worker_loop();
    });
    connected_ = true;
    bytes_held_.store(static_cast<int64_t>(region_.bytes), std::memory_order_release);
    if (engine) {
      spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                   "of staging beside the engine's {} layers x {} tensors, mode {}",
                   rank_, all.size() - 1, transport_.backend(), comm_.backend(), region_.bytes,
                   layers_, arena_.tensors(), mode_name(config_.mode));
    } else {
      spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                   "({} layers + 1 staging of {} bytes), mode {}",
                   rank_, all.size() - 1, transport_.backend(), comm_.backend(), region_.bytes,
                   layers_, arena_.layer_bytes(), mode_name(config_.mode));
    }
    return static_cast<int64_t>(region_.bytes);
  }

  // The engine's tensors, one transport region each, right after the staging region.
  void register_engine_tensors() {
    if (!transport_.capabilities().register_memory) {
      fail<NotSupported>("the ", transport_.backend(), " transport cannot serve reads from "
                         "memory the engine allocated (register_memory); use a transport that "
                         "can (shm, ucx, hybrid, inproc) or let eplb allocate the arena");
    }
    const int64_t spr = config_.layout.slots_per_rank();
    engine_.tensors = arena_.tensors();
    engine_.at.clear();
    for (int64_t l = 0; l < layers_; ++l) {
      for (int64_t t = 0; t < arena_.tensors(); ++t) {
        const TensorMemory& m = spec_.memory(l, t);
        const int64_t stride = spec_.stride(l, t);
        const int64_t bytes = (spr - 1) * stride + arena_.tensor_bytes(t);
        const transport::Region r = transport_.register_memory(m.base, static_cast<size_t>(bytes));
        EPLB_CHECK_EQ(r.id, region_.id + 1 + static_cast<int>(engine_.at.size()),
                      "the engine's regions follow the staging region");
        engine_.at.push_back({r.id, static_cast<std::byte*>(m.base), stride});
      }
    }
  }

  // ---------------------------------------------------------------- forward thread
  void record(int64_t layer, std::span<const int32_t> ids) { recorder_.record(layer, ids); }
  void record_counts(int64_t layer, std::span<const int64_t> counts) {
    recorder_.record_counts(layer, counts);
  }

  const routing::DispatchTables& dispatch(int64_t layer) const {
    EPLB_CHECK(layer >= 0 && layer < layers_, "dispatch: layer ", layer, " is outside [0, ",
               layers_, ")");
    return tables_[layer];
  }

  std::span<std::byte> weights(int64_t layer, int64_t tensor) const {
    EPLB_CHECK(connected_, "weights() needs connect() first (it allocates the arena)");
    EPLB_CHECK(layer >= 0 && layer < layers_, "weights: layer ", layer, " is outside [0, ",
               layers_, ")");
    EPLB_CHECK(tensor >= 0 && tensor < arena_.tensors(), "weights: tensor ", tensor,
               " is outside [0, ", arena_.tensors(), ")");
    const int64_t spr = config_.layout.slots_per_rank();
    if (spec_.engine_weights()) {
      const EngineTensors::Tensor& e = engine_.of(layer, tensor);
      return {e.base, static_cast<size_t>((spr - 1) * e.stride + arena_.tensor_bytes(tensor))};
    }
    return {region_.data + arena_.offset(map_.buffer_of_layer[layer], tensor, 0),
            static_cast<size_t>(arena_.tensor_bytes(tensor) * spr)};
  }

  std::span<std::byte> slot_weights(int64_t layer, int64_t tensor, int64_t slot) const {
    const int64_t spr = config_.layout.slots_per_rank();
    EPLB_CHECK(slot >= 0 && slot < spr, "slot_weights: slot ", slot, " is outside [0, ", spr,
               ")");
    const std::span<std::byte> all = weights(layer, tensor);
    const int64_t stride =
        spec_.engine_weights() ? engine_.of(layer, tensor).stride : arena_.tensor_bytes(tensor);
    return all.subspan(static_cast<size_t>(slot * stride),
                       static_cast<size_t>(arena_.tensor_bytes(tensor)));
  }

  std::span<const int32_t> phy2log(int64_t layer) const {
    EPLB_CHECK(layer >= 0 && layer < layers_, "phy2log: layer ", layer, " is outside [0, ",
               layers_, ")");
    return {phy2log_.data() + layer * config_.layout.physical,
            static_cast<size_t>(config_.layout.physical)};
  }

  Placement placement() const {
    Placement p(layers_, config_.layout.experts, config_.layout.physical);
    p.phy2log = phy2log_;
    p.derive_from_phy2log();
    return p;
  }

  void step_end() {
    EPLB_CHECK(connected_, "step_end() needs connect() first");
    EPLB_CHECK(!shut_down_, "step_end() after shutdown()");
    const auto start = Clock::now();
    recorder_.step_end();
    ++step_;
    if (config_.mode == Mode::kAsync) {
      step_end_async();
    } else {
      step_end_sync();
    }
    published_step_.store(step_, std::memory_order_release);
    const double ms = ms_between(start, Clock::now());
    if (!open_) return;
    open_->stall_total_ms += ms;
    open_->stall_max_ms = std::max(open_->stall_max_ms, ms);
    if (open_finished_) publish_open();
  }

  void save_stats(const std::string& path, stats::LoadFormat format) const {
    stats::LoadHistory history;
    history.steps = recorder_.steps_in_window();
    history.layers = layers_;
    history.experts = config_.layout.experts;
    if (history.steps == 0) fail("save_stats: no step recorded yet (call step_end() first)");
    const std::vector<int64_t> steps = recorder_.window_steps();
    history.values.assign(steps.begin(), steps.end());
    std::string text;
    if (format == stats::LoadFormat::kEplb) {
      text = stats::format_load_eplb(history);
    } else if (format == stats::LoadFormat::kSglang) {
      text = stats::format_load_sglang(history);
    } else {
      fail("save_stats: format '", stats::load_format_name(format),
           "' cannot be written (choose eplb or sglang)");
    }
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) fail<IoError>("save_stats: cannot write '", path, "'");
  }

  void shutdown() {
    if (shut_down_) return;
    shut_down_ = true;
    if (active_) {
      cancel_worker(*active_);
      if (open_) {
        open_->outcome = Outcome::kCancelled;
        open_->error = "shutdown() while the rebalance ran";
        close_open(std::nullopt);
        publish_open();
      }
      active_.reset();
    }
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      worker_stop_ = true;
    }
    worker_cv_.notify_one();
    if (worker_.joinable()) worker_.join();
    if (control_) control_->stop();
    agreements_.clear();
  }

  int64_t agreement_contribution() const {
    return contribution_.load(std::memory_order_acquire);
  }

  void agreement_result(int64_t step, int64_t min_value) {
    if (config_.agreement != Agreement::kExternal) {
      fail("agreement_result(): this runtime's agreement is internal (it runs on the control "
           "plane); set Config::agreement = external to hand results in");
    }
    const int64_t now = published_step_.load(std::memory_order_acquire);
    if (step < 0 || step > now) {
      fail("agreement_result(step ", step, "): step() is ", now, "; hand in the result of a "
           "step after the step_end() that ended it");
    }
    {
      std::lock_guard<std::mutex> lock(external_mu_);
      ExternalResult& slot = external_[static_cast<size_t>(step) % external_.size()];
      if (step > slot.step) slot = {step, min_value};  // a stale result never hides a newer one
    }
    external_cv_.notify_all();
  }

  int rank() const { return rank_; }
  int64_t step() const { return step_; }
  bool rebalancing() const { return open_.has_value(); }
  int64_t installed_layers() const { return installed_total_; }
  bool control_broken() const { return control_broken_.load(std::memory_order_acquire); }
  int64_t bytes_held() const { return bytes_held_.load(std::memory_order_acquire); }
  std::vector<RebalanceRecord> history() const {
    std::lock_guard<std::mutex> lock(history_mu_);
    return history_;
  }
  const Config& config() const { return config_; }
  const WeightSpec& weight_spec() const { return spec_; }

 private:
  bool should_trigger() const {
    return step_ > 0 && step_ % config_.interval == 0 && !control_broken() && !open_;
  }

  // The longest the forward thread waits for a collective's result: each queued collective
  // (at most lag + 1 agreements and a window) is bounded by the timeout itself.
  std::chrono::milliseconds result_bound() const { return config_.timeout * (config_.lag + 3); }

  void open_record() {
    open_.emplace();
    open_->index = next_index_++;
    open_->trigger_step = step_;
    open_finished_ = false;
    open_started_ = Clock::now();
  }

  // Ends the open record at this step; `raise` is what step_end throws under on_error=raise.
  void close_open(std::optional<Failure> raise) {
    open_->end_step = step_;
    open_->steps = step_ - open_->trigger_step;
    open_->seconds = ms_between(open_started_, Clock::now()) / 1000.0;
    open_finished_ = true;
    raise_ = std::move(raise);
  }

  void fill_plan_figures(const RebalancePlan& plan) {
    open_->placement_ms = plan.placement_ms;
    open_->balancedness_before = plan.balancedness_before;
    open_->balancedness_after = plan.balancedness_after;
    open_->layers_moved = static_cast<int64_t>(plan.moved_layers.size());
    open_->slots_moved = plan.slots_moved;
    open_->bytes_intra_node = plan.bytes_intra_node;
    open_->bytes_inter_node = plan.bytes_inter_node;
    open_->bytes_local_copy = plan.bytes_local_copy;
    open_->rounds = plan.rounds;
  }

  // Logs, calls back, appends to the history and, under on_error=raise, throws.
  void publish_open() {
    RebalanceRecord record = std::move(*open_);
    open_.reset();
    open_finished_ = false;
    const std::optional<Failure> raise = std::exchange(raise_, std::nullopt);
    const auto level = record.outcome == Outcome::kFailed      ? spdlog::level::warn
                       : record.outcome == Outcome::kCompleted ? spdlog::level::info
                                                               : spdlog::level::debug;
    spdlog::log(level,
                "eplb runtime rank {}: rebalance {} {} at step {} (triggered at {}): "
                "balancedness {:.4f} -> {:.4f}, {} layers ({} installed), {} slots, "
                "{} B intra-node + {} B inter-node, {} rounds, {} steps, {:.3f} s, placement "
                "{:.2f} ms, stall {:.3f} ms (max {:.3f} ms){}{}",
                rank_, record.index, outcome_name(record.outcome), record.end_step,
                record.trigger_step, record.balancedness_before, record.balancedness_after,
                record.layers_moved, record.layers_installed, record.slots_moved,
                record.bytes_intra_node, record.bytes_inter_node, record.rounds, record.steps,
                record.seconds, record.placement_ms, record.stall_total_ms,
                record.stall_max_ms, record.error.empty() ? "" : ": ", record.error);
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      history_.push_back(record);
    }
    if (record.outcome == Outcome::kFailed) {
      if (config_.on_failure) config_.on_failure(record);
      if (config_.on_error == OnError::kRaise && raise) raise->raise();
    }
  }

  // Installs moved layer k of `plan` on this rank: the staged buffer becomes live, the new
  // tables and phy2log take effect. kSwap: O(1) in the weights' size; kCopy: one layer copied
  // (or enqueued, by the installer).
  void install(RebalancePlan& plan, int64_t k) {
    const int64_t layer = plan.moved_layers[k];
    if (spec_.engine_weights()) {
      install_into_engine(plan, k);
    } else if (swaps()) {
      map_.install(layer);
    } else {
      std::byte* live = region_.data + arena_.offset(map_.buffer_of_layer[layer], 0, 0);
      const std::byte* staged = region_.data + arena_.offset(map_.spare, 0, 0);
      const auto bytes = static_cast<size_t>(arena_.layer_bytes());
      if (config_.installer) {
        installer_or_stop([&] { config_.installer->copy(live, staged, bytes); }, layer);
      } else {
        std::memcpy(live, staged, bytes);
      }
      open_->bytes_installed += static_cast<int64_t>(bytes);
    }
    if (config_.installer) installer_or_stop([&] { config_.installer->mark(); }, layer);
    std::swap(tables_[layer], plan.tables[k]);
    std::copy(plan.phy2log[k].begin(), plan.phy2log[k].end(),
              phy2log_.begin() + layer * config_.layout.physical);
    ++installed_total_;
    ++open_->layers_installed;
  }

  // Installs swap buffers only with the arena and Install::kSwap.
  bool swaps() const { return !spec_.engine_weights() && config_.install == Install::kSwap; }

  // The engine's tensors of layer k of `plan` get, slot by slot, the staged bytes of every
  // slot whose expert changes; the others are not written.
  void install_into_engine(const RebalancePlan& plan, int64_t k) {
    const int64_t layer = plan.moved_layers[k];
    const auto actions = plan.migrations[k].plan.rank_actions(rank_, config_.layout);
    for (size_t j = 0; j < actions.size(); ++j) {
      if (actions[j].action == migration::Action::kUnchanged) continue;
      for (int64_t t = 0; t < arena_.tensors(); ++t) {
        const EngineTensors::Tensor& e = engine_.of(layer, t);
        std::byte* live = e.base + static_cast<int64_t>(j) * e.stride;
        const std::byte* staged = region_.data + arena_.offset(0, t, static_cast<int64_t>(j));
        const auto bytes = static_cast<size_t>(arena_.tensor_bytes(t));
        if (config_.installer) {
          installer_or_stop([&] { config_.installer->copy(live, staged, bytes); }, layer);
        } else {
          std::memcpy(live, staged, bytes);
        }
        open_->bytes_installed += static_cast<int64_t>(bytes);
      }
    }
  }

  // An installer that fails mid-install (a CUDA error on the engine's stream) leaves this
  // rank's weights, tables and buffer map no longer in step with each other or with the other
  // ranks', and there is no consistent way back: the process stops, loudly, so that its peers
  // see a dead rank and abandon the rebalance cleanly instead of serving wrong experts.
  template <typename F>
  void installer_or_stop(F&& call, int64_t layer) {
    try {
      call();
    } catch (...) {
      spdlog::critical("eplb runtime rank {}: the installer failed installing layer {}: {}; "
                       "this rank's weights can no longer be trusted, stopping the process",
                       rank_, layer, Failure::current().message);
      spdlog::shutdown();
      std::abort();
    }
  }

  // `error`: what step_end raises under on_error=raise (by default an IoError with `message`).
  void fail_open(std::string message, std::optional<Failure> error) {
    open_->outcome = Outcome::kFailed;
    open_->error = std::move(message);
    close_open(error ? std::move(error) : Failure{FailureKind::kIoError, open_->error});
  }

  // -------------------------------------------------------------- async protocol
  void step_end_async() {
    if (active_) advance_async();
    if (!active_ && should_trigger()) trigger_async();
    if (active_) {
      submit_agreement();
    } else {
      contribution_.store(kNoAgreement, std::memory_order_release);
    }
  }

  // Run on the control thread before this rank contributes its window: peers start reading
  // this rank's live buffers once every window is in, so the last install's queued work (a copy
  // into a live buffer, kCopy) must have run by then. Nothing to wait for on host memory.
  std::function<void()> installs_done() {
    if (!config_.installer) return {};
    return [installer = config_.installer, timeout = config_.timeout] {
      installer->wait_marked(timeout);
    };
  }

  void trigger_async() {
    open_record();
    auto a = std::make_shared<Active>();
    std::vector<int64_t> window(static_cast<size_t>(layers_ * config_.layout.experts));
    recorder_.snapshot_window(window);
    a->window = control_->all_reduce(std::move(window), control::ReduceOp::kSum,
                                     config_.timeout, installs_done());
    a->current_phy2log = phy2log_;
    a->map = map_;
    {
      std::lock_guard<std::mutex> lock(worker_mu_);
      worker_queue_.push_back(a);
    }
    worker_cv_.notify_one();
    active_ = std::move(a);
  }

  void submit_agreement() {
    const int64_t progress = active_->progress.load(std::memory_order_acquire);
    PendingAgreement pending;
    pending.step = step_;
    pending.mine = progress;
    if (config_.agreement == Agreement::kInternal) {
      pending.result = control_->all_reduce({progress}, control::ReduceOp::kMin, config_.timeout);
    }
    agreements_.push_back(std::move(pending));
    contribution_.store(progress, std::memory_order_release);
  }

  // The agreed value of `pending`, waiting for it within its bound. When there is none (a
  // failed or late collective, a missing or impossible external result) the rebalance is
  // abandoned here and nothing is returned: the agreement can no longer be trusted to be the
  // same on every rank, so no rebalance triggers again.
  std::optional<int64_t> take_agreement(PendingAgreement pending) {
    const auto broken = [&](std::string message, std::optional<Failure> error) {
      control_broken_.store(true, std::memory_order_release);
      end_active(std::move(message), std::move(error));
      return std::nullopt;
    };
    if (config_.agreement == Agreement::kExternal) {
      int64_t value = 0;
      {
        std::unique_lock<std::mutex> lock(external_mu_);
        ExternalResult& slot = external_[static_cast<size_t>(pending.step) % external_.size()];
        if (!external_cv_.wait_for(lock, config_.timeout,
                                   [&] { return slot.step == pending.step; })) {
          lock.unlock();
          return broken(detail::concat("the agreement result of step ", pending.step,
                                       " was not handed in (agreement_result) within ",
                                       config_.timeout.count(), " ms"),
                        std::nullopt);
        }
        value = slot.value;
      }
      if (value > pending.mine) {
        return broken(detail::concat("agreement_result(", pending.step, ", ", value,
                                     ") is above this rank's contribution ", pending.mine,
                                     ": it must be the minimum over all ranks of "
                                     "agreement_contribution()"),
                      std::nullopt);
      }
      return value;
    }
    if (pending.result.wait_for(result_bound()) != std::future_status::ready) {
      return broken(detail::concat("the agreement of step ", pending.step,
                                   " gave no result within ", result_bound().count(), " ms"),
                    std::nullopt);
    }
    CollectiveResult result = pending.result.get();
    if (result.failure) {
      std::string message = detail::concat("the agreement of step ", pending.step, " failed: ",
                                           result.failure->message);
      return broken(std::move(message), std::move(result.failure));
    }
    return result.values.at(0);
  }

  void advance_async() {
    Active& a = *active_;
    if (agreements_.empty() || agreements_.front().step != step_ - config_.lag) return;
    PendingAgreement pending = std::move(agreements_.front());
    agreements_.pop_front();
    const std::optional<int64_t> result = take_agreement(std::move(pending));
    if (!result) return;
    const int64_t agreed = *result;
    if (agreed < 0) {
      const int64_t failed_rank = -1 - agreed;
      if (a.progress.load(std::memory_order_acquire) < 0) {
        end_active(detail::concat("rank ", rank_, ": ", a.failure.message), a.failure);
      } else {
        end_active(detail::concat("rank ", failed_rank, " failed (its log has the error)"),
                   std::nullopt);
      }
      return;
    }
    if (agreed == 0) return;  // some rank is still placing
    // Every rank has the (same) plan: this rank's own contribution was >= 1, loaded with
    // acquire after the worker wrote the plan.
    RebalancePlan& plan = a.plan;
    if (!a.figures_filled) {
      fill_plan_figures(plan);
      a.figures_filled = true;
    }
    if (plan.skipped) {
      open_->outcome = Outcome::kSkipped;
      open_->error = plan.skip_reason;
      close_open(std::nullopt);
      finish_active();
      return;
    }
    const int64_t moved = static_cast<int64_t>(plan.moved_layers.size());
    if (a.installed_fwd < agreed - 1 && a.installed_fwd < moved) {
      install(plan, a.installed_fwd);
      ++a.installed_fwd;
      {
        std::lock_guard<std::mutex> lock(a.mu);
        a.installed = a.installed_fwd;
      }
      a.cv.notify_one();
    }
    if (a.installed_fwd == moved) {
      open_->outcome = Outcome::kCompleted;
      close_open(std::nullopt);
      finish_active();
    }
  }

  // Abandons the running rebalance at this step: layers installed so far stay (they are
  // complete on every rank), the others keep their old buffers and tables.
  //
  // The record keeps the plan's figures only if an agreement proved every rank had the plan
  // (figures_filled): filling them from this rank's own plan would make the records of ranks
  // whose workers were at different points differ.
  void end_active(std::string message, std::optional<Failure> error) {
    fail_open(std::move(message), std::move(error));
    cancel_worker(*active_);
    finish_active();
  }

  void finish_active() {
    active_.reset();
    // Agreements still queued run on every rank alike; their results are not needed.
    agreements_.clear();
  }

  static void cancel_worker(Active& a) {
    {
      std::lock_guard<std::mutex> lock(a.mu);
      a.cancel.store(true, std::memory_order_release);
    }
    a.cv.notify_one();
  }

  StageContext stage_context(const std::atomic<bool>* cancel) {
    StageContext context;
    context.transport = &transport_;
    context.arena = &arena_;
    context.base = region_.data;
    context.peer_region = &peer_region_;
    context.layout = &config_.layout;
    context.rank = rank_;
    context.timeout = config_.timeout;
    context.delay_hook = &config_.delay_hook;
    context.cancel = cancel;
    context.installer = config_.installer.get();
    context.device_memory = transport_.capabilities().device_memory;
    context.own_region = region_.id;
    context.engine = spec_.engine_weights() ? &engine_ : nullptr;
    return context;
  }

  // -------------------------------------------------------------- worker thread
  void worker_loop() {
    for (;;) {
      std::shared_ptr<Active> job;
      {
        std::unique_lock<std::mutex> lock(worker_mu_);
        worker_cv_.wait(lock, [&] { return worker_stop_ || !worker_queue_.empty(); });
        if (worker_stop_) return;
        job = std::move(worker_queue_.front());
        worker_queue_.pop_front();
      }
      run_job(*job);
    }
  }

  void run_job(Active& a) {
    const auto cancelled = [&] { return a.cancel.load(std::memory_order_acquire); };
    try {
      while (a.window.wait_for(std::chrono::milliseconds(2)) != std::future_status::ready) {
        if (cancelled()) return;
      }
      const std::vector<int64_t> window = a.window.get().take();
      if (config_.delay_hook) config_.delay_hook(DelayPoint::kPlacement);
      a.plan = make_plan(window, a.current_phy2log, config_, spec_.expert_bytes());
      a.progress.store(1, std::memory_order_release);
      if (a.plan.skipped) return;
      BufferMap map = a.map;
      const StageContext context = stage_context(&a.cancel);
      for (size_t k = 0; k < a.plan.moved_layers.size(); ++k) {
        const int64_t layer = a.plan.moved_layers[k];
        if (!stage_layer(context, map, layer, a.plan.migrations[k])) return;
        a.progress.store(2 + static_cast<int64_t>(k), std::memory_order_release);
        // One layer of staging: the next layer waits until this one is installed everywhere.
        std::unique_lock<std::mutex> lock(a.mu);
        a.cv.wait(lock, [&] { return a.installed > static_cast<int64_t>(k) || cancelled(); });
        if (cancelled()) return;
        if (swaps()) map.install(layer);
      }
    } catch (...) {
      worker_failed(a, rank_, Failure::current());
    }
  }

  // -------------------------------------------------------------- sync mode
  // The whole rebalance inside this step_end: the baseline. The collectives are the window,
  // one agreement on the plan, and one per moved layer, the same on every rank.
  void step_end_sync() {
    if (!should_trigger()) return;
    open_record();
    std::vector<int64_t> window(static_cast<size_t>(layers_ * config_.layout.experts));
    recorder_.snapshot_window(window);
    try {
      window = await(control_->all_reduce(std::move(window), control::ReduceOp::kSum,
                                          config_.timeout, installs_done()));
    } catch (...) {
      control_broken_.store(true, std::memory_order_release);
      Failure failure = Failure::current();
      fail_open(detail::concat("the window all-reduce failed: ", failure.message),
                std::move(failure));
      return;
    }
    RebalancePlan plan;
    std::optional<Failure> local;
    try {
      if (config_.delay_hook) config_.delay_hook(DelayPoint::kPlacement);
      plan = make_plan(window, phy2log_, config_, spec_.expert_bytes());
    } catch (...) {
      local = Failure::current();
    }
    if (!agree_sync(local)) return;
    fill_plan_figures(plan);
    if (plan.skipped) {
      open_->outcome = Outcome::kSkipped;
      open_->error = plan.skip_reason;
      close_open(std::nullopt);
      return;
    }
    const StageContext context = stage_context(nullptr);
    for (size_t k = 0; k < plan.moved_layers.size(); ++k) {
      try {
        stage_layer(context, map_, plan.moved_layers[k], plan.migrations[k]);
      } catch (...) {
        local = Failure::current();
      }
      if (!agree_sync(local)) return;
      install(plan, static_cast<int64_t>(k));
    }
    open_->outcome = Outcome::kCompleted;
    close_open(std::nullopt);
  }

  // One agreement of sync mode, on whether this rank failed (`local`); false (and the record
  // failed) unless every rank succeeded.
  bool agree_sync(const std::optional<Failure>& local) {
    const int64_t mine = local ? -1 - rank_ : 1;
    int64_t agreed = 0;
    try {
      agreed = await(control_->all_reduce({mine}, control::ReduceOp::kMin, config_.timeout)).at(0);
    } catch (...) {
      control_broken_.store(true, std::memory_order_release);
      Failure failure = Failure::current();
      fail_open(detail::concat("an agreement failed: ", failure.message), std::move(failure));
      return false;
    }
    if (agreed >= 0) return true;
    if (local) {
      fail_open(detail::concat("rank ", rank_, ": ", local->message), local);
    } else {
      fail_open(detail::concat("rank ", -1 - agreed, " failed (its log has the error)"),
                std::nullopt);
    }
    return false;
  }

  std::vector<int64_t> await(std::future<CollectiveResult> future) {
    if (future.wait_for(result_bound()) != std::future_status::ready) {
      fail<Timeout>("runtime: a collective gave no result within ", result_bound().count(),
                    " ms");
    }
    return future.get().take();
  }

  // Immutable after construction / connect().
  const Config config_;
  control::Communicator& comm_;
  transport::Transport& transport_;
  const WeightSpec spec_;
  const int rank_;
  const int64_t layers_;
  ArenaLayout arena_;
  transport::Region region_;
  std::vector<int> peer_region_;  // [ranks] the arena's region id on each rank
  bool connected_ = false;
  std::atomic<int64_t> bytes_held_{0};

  // Forward thread.
  stats::LoadRecorder recorder_;
  std::vector<int32_t> phy2log_;                 // [layers][physical]
  std::vector<routing::DispatchTables> tables_;  // [layers]
  BufferMap map_;
  EngineTensors engine_;  // the engine's own tensors, from connect() on; empty with the arena
  int64_t step_ = 0;
  int64_t installed_total_ = 0;
  int64_t next_index_ = 0;
  bool shut_down_ = false;
  std::shared_ptr<Active> active_;
  std::deque<PendingAgreement> agreements_;  // by step
  std::optional<RebalanceRecord> open_;  // the running rebalance's record
  bool open_finished_ = false;           // it ended at this step: publish at the end of it
  Clock::time_point open_started_;
  std::optional<Failure> raise_;
  std::atomic<bool> control_broken_{false};
  std::atomic<int64_t> published_step_{0};          // step_, for agreement_result's check
  std::atomic<int64_t> contribution_{kNoAgreement};  // agreement_contribution()

  // External agreement: results handed in by agreement_result() (any thread), in a ring of
  // lag + 2 slots by step, so the result of step s is still there when s + lag acts on it.
  struct ExternalResult {
    int64_t step = -1;
    int64_t value = 0;
  };
  std::mutex external_mu_;
  std::condition_variable external_cv_;
  std::vector<ExternalResult> external_;  // guarded by external_mu_

  // Threads.
  std::unique_ptr<ControlThread> control_;
  std::thread worker_;
  std::mutex worker_mu_;
  std::condition_variable worker_cv_;
  std::deque<std::shared_ptr<Active>> worker_queue_;  // guarded by worker_mu_
  bool worker_stop_ = false;                          // guarded by worker_mu_

  mutable std::mutex history_mu_;
  std::vector<RebalanceRecord> history_;  // guarded by history_mu_
};

Rebalancer::Rebalancer(Config config, control::Communicator& communicator,
                       transport::Transport& transport, WeightSpec weights, Placement initial) {
  config.validate();
  weights.validate();
  impl_ = std::make_unique<Impl>(std::move(config), communicator, transport, std::move(weights),
                                 initial);
}

Rebalancer::~Rebalancer() = default;

int64_t Rebalancer::connect() { return impl_->connect(); }
void Rebalancer::record(int64_t layer, std::span<const int32_t> expert_ids) {
  impl_->record(layer, expert_ids);
}
void Rebalancer::record_counts(int64_t layer, std::span<const int64_t> counts) {
  impl_->record_counts(layer, counts);
}
const routing::DispatchTables& Rebalancer::dispatch(int64_t layer) const {
  return impl_->dispatch(layer);
}
std::span<std::byte> Rebalancer::weights(int64_t layer, int64_t tensor) {
  return impl_->weights(layer, tensor);
}
std::span<const std::byte> Rebalancer::weights(int64_t layer, int64_t tensor) const {
  return impl_->weights(layer, tensor);
}
std::span<std::byte> Rebalancer::slot_weights(int64_t layer, int64_t tensor, int64_t slot) {
  return impl_->slot_weights(layer, tensor, slot);
}
std::span<const std::byte> Rebalancer::slot_weights(int64_t layer, int64_t tensor,
                                                    int64_t slot) const {
  return impl_->slot_weights(layer, tensor, slot);
}
std::span<const int32_t> Rebalancer::phy2log(int64_t layer) const {
  return impl_->phy2log(layer);
}
Placement Rebalancer::placement() const { return impl_->placement(); }
void Rebalancer::step_end() { impl_->step_end(); }
void Rebalancer::save_stats(const std::string& path, stats::LoadFormat format) const {
  impl_->save_stats(path, format);
}
void Rebalancer::shutdown() { impl_->shutdown(); }
int Rebalancer::rank() const { return impl_->rank(); }
int64_t Rebalancer::step() const { return impl_->step(); }
bool Rebalancer::rebalancing() const { return impl_->rebalancing(); }
int64_t Rebalancer::installed_layers() const { return impl_->installed_layers(); }
bool Rebalancer::control_broken() const { return impl_->control_broken(); }
int64_t Rebalancer::agreement_contribution() const { return impl_->agreement_contribution(); }
void Rebalancer::agreement_result(int64_t step, int64_t min_value) {
  impl_->agreement_result(step, min_value);
}
int64_t Rebalancer::bytes_held() const { return impl_->bytes_held(); }
std::vector<RebalanceRecord> Rebalancer::history() const { return impl_->history(); }
const Config& Rebalancer::config() const { return impl_->config(); }
const WeightSpec& Rebalancer::weight_spec() const { return impl_->weight_spec(); }

}  // namespace eplb::runtime
