#include "runtime/harness.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "runtime/doubles.h"
#include "runtime/testing.h"

namespace eplb::runtime::testing {
namespace {

uint64_t fnv(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

template <typename T>
uint64_t fnv_vec(uint64_t h, const std::vector<T>& v) {
  return fnv(h, v.data(), v.size() * sizeof(T));
}

// Loads: the FLAME trace's tokens (each rank its own slice of the tokens of every step), or a
// skewed synthetic load whose hot experts change every few intervals.
class LoadSourceState {
 public:
  LoadSourceState(const Scenario& s, int rank) : scenario_(s), rank_(rank) {
    if (s.load == LoadSource::kFlame) {
      trace_ = stats::read_routing_trace(EPLB_SOURCE_DIR "/data/flame-moe-290m/routing_top6.csv",
                                         s.config.layout.experts);
      EPLB_CHECK_EQ(trace_.experts, s.config.layout.experts, "FLAME scenarios need E = 64");
    }
  }

  void record(Rebalancer& rb, int64_t step) {
    const int64_t layers = scenario_.weights.layers;
    const int64_t experts = scenario_.config.layout.experts;
    if (scenario_.load == LoadSource::kFlame) {
      constexpr int64_t kTokens = 16;
      const int64_t ranks = scenario_.config.layout.ranks;
      const int64_t first = ((step * ranks + rank_) * kTokens) % trace_.tokens;
      for (int64_t l = 0; l < layers; ++l) {
        const int64_t tl = l % trace_.layers;
        for (int64_t t = 0; t < kTokens; ++t) {
          const int64_t token = (first + t) % trace_.tokens;
          const int32_t* ids = trace_.routes.data() + (tl * trace_.tokens + token) * trace_.top_k;
          if (scenario_.counters == Scenario::Counters::kPerLayer) {
            rb.record(l, std::span<const int32_t>(ids, static_cast<size_t>(trace_.top_k)));
          } else {
            for (int64_t k = 0; k < trace_.top_k; ++k) ++pass(l, ids[k], rb);
          }
        }
      }
      if (scenario_.counters != Scenario::Counters::kPerLayer) record_pass(rb);
      return;
    }
    // Zipf-like weights over a permutation that depends on the phase and the layer (interval
    // 0, no rebalance of the runtime's own: a phase of 8 steps).
    const int64_t phase = step / (2 * std::max<int64_t>(scenario_.config.interval, 4));
    std::vector<int64_t> counts(static_cast<size_t>(experts));
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t position =
            static_cast<int64_t>(mix64(static_cast<uint64_t>(phase * 7919 + l * 104729 + e)) %
                                 static_cast<uint64_t>(experts));
        const uint64_t noise = mix64(scenario_.seed ^ static_cast<uint64_t>(
                                                          (step * 131 + rank_) * 977 + l * 31 + e));
        counts[e] = 1000 / (1 + position) + static_cast<int64_t>(noise % 7);
      }
      record_layer(rb, l, counts);
    }
    if (scenario_.counters != Scenario::Counters::kPerLayer) record_pass(rb);
  }

 private:
  void record_layer(Rebalancer& rb, int64_t layer, const std::vector<int64_t>& counts) {
    if (scenario_.counters == Scenario::Counters::kPerLayer) {
      rb.record_counts(layer, counts);
      return;
    }
    for (size_t e = 0; e < counts.size(); ++e) {
      pass(layer, static_cast<int32_t>(e), rb) += counts[e];
    }
  }

  // The pass's count of expert e of `layer`: per expert, or (as the engine's router counts)
  // on one of the slots holding e now, a different one from step to step.
  int64_t& pass(int64_t layer, int32_t expert, const Rebalancer& rb) {
    const Layout& layout = scenario_.config.layout;
    const bool slots = scenario_.counters == Scenario::Counters::kPassSlots;
    const int64_t width = slots ? layout.physical : layout.experts;
    pass_.resize(static_cast<size_t>(scenario_.weights.layers * width));
    if (!slots) return pass_[static_cast<size_t>(layer * width + expert)];
    const auto phy2log = rb.phy2log(layer);
    std::vector<int64_t> holders;
    for (int64_t p = 0; p < layout.physical; ++p) {
      if (phy2log[p] == expert) holders.push_back(p);
    }
    const int64_t p = holders[static_cast<size_t>((passes_ + expert) % holders.size())];
    return pass_[static_cast<size_t>(layer * width + p)];
  }

  void record_pass(Rebalancer& rb) {
    const bool slots = scenario_.counters == Scenario::Counters::kPassSlots;
    const Layout& layout = scenario_.config.layout;
    IntTensor counts;
    counts.data = pass_.data();
    counts.shape = {scenario_.weights.layers, slots ? layout.physical : layout.experts};
    rb.record_pass(counts, slots ? CountsOf::kSlots : CountsOf::kExperts);
    std::fill(pass_.begin(), pass_.end(), 0);
    ++passes_;
  }

  const Scenario& scenario_;
  int rank_;
  stats::RoutingTrace trace_;
  std::vector<int64_t> pass_;  // the engine's per-pass counters
  int64_t passes_ = 0;
};

// The engine's map tensors in both engines' layouts, some int32, one strided, each [layers]
// rows, bound to the Rebalancer; check() compares them with what it serves and hashes them.
class EngineMapTensors {
 public:
  EngineMapTensors(const Scenario& s, Rebalancer& rb) : layout_(s.config.layout),
                                                         layers_(s.weights.layers) {
    const int64_t L = layers_, E = layout_.experts, P = layout_.physical;
    const int64_t R = P - E + 1;  // vLLM's num_redundant_experts + 1
    phy2log_.assign(static_cast<size_t>(L * P), -7);
    log2phy_.assign(static_cast<size_t>(L * E * R), -7);
    count_.assign(static_cast<size_t>(L * E), -7);
    all_.assign(static_cast<size_t>(L * E * (P + 3)), -7);  // padded rows: a strided view
    valid_.assign(static_cast<size_t>(L * E), -7);
    dispatch_.assign(static_cast<size_t>(L * E), -7);
    const auto i64 = [](std::vector<int64_t>& v, std::vector<int64_t> shape) {
      return IntTensor{.data = v.data(), .type = IntTensor::Type::kInt64, .shape = shape, .strides = {}};
    };
    const auto i32 = [](std::vector<int32_t>& v, std::vector<int64_t> shape) {
      return IntTensor{.data = v.data(), .type = IntTensor::Type::kInt32, .shape = shape, .strides = {}};
    };
    IntTensor all = i32(all_, {L, E, P});
    all.strides = {E * (P + 3), P + 3, 1};
    rb.bind_maps({{MapKind::kPhysicalToLogical, i64(phy2log_, {L, P}), "physical_to_logical_map"},
                  {MapKind::kLogicalToPhysical, i64(log2phy_, {L, E, R}),
                   "logical_to_physical_map"},
                  {MapKind::kReplicaCount, i64(count_, {L, E}), "logical_replica_count"},
                  {MapKind::kLogicalToPhysical, all, "logical_to_all_physical_map"},
                  {MapKind::kReplicaCount, i32(valid_, {L, E}),
                   "logical_to_all_physical_map_num_valid"},
                  {MapKind::kRankDispatch, i64(dispatch_, {L, E}),
                   "logical_to_rank_dispatch_physical_map"}});
  }

  // Differences from the Rebalancer's placement and tables as error lines; `h` takes the maps
  // every rank must hold alike (the rank's own dispatch row left out).
  void check(const Rebalancer& rb, int rank, uint64_t& h,
             const std::function<void(std::string)>& error) const {
    const int64_t E = layout_.experts, P = layout_.physical, R = P - E + 1;
    for (int64_t l = 0; l < layers_; ++l) {
      const auto phy2log = rb.phy2log(l);
      const routing::DispatchTables& t = rb.dispatch(l);
      for (int64_t p = 0; p < P; ++p) {
        if (phy2log_[l * P + p] != phy2log[p]) {
          return error(detail::concat("bound physical_to_logical_map[", l, "][", p, "] is ",
                                      phy2log_[l * P + p], ", eplb's ", phy2log[p]));
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        const auto replicas = t.replicas(e);
        if (count_[l * E + e] != t.replica_count[e] || valid_[l * E + e] != t.replica_count[e]) {
          return error(detail::concat("bound replica counts of layer ", l, " expert ", e, " are ",
                                      count_[l * E + e], " and ", valid_[l * E + e], ", eplb's ",
                                      t.replica_count[e]));
        }
        for (int64_t i = 0; i < P; ++i) {
          const int64_t want = i < static_cast<int64_t>(replicas.size()) ? replicas[i] : -1;
          if ((i < R && log2phy_[(l * E + e) * R + i] != want) ||
              all_[(l * E + e) * (P + 3) + i] != want) {
            return error(detail::concat("bound log2phy of layer ", l, " expert ", e, " column ",
                                        i, " differs from the tables (", want, ")"));
          }
        }
        if (dispatch_[l * E + e] != t.static_slot[rank * E + e]) {
          return error(detail::concat("bound dispatch row of layer ", l, " expert ", e, " is ",
                                      dispatch_[l * E + e], ", eplb's ",
                                      t.static_slot[rank * E + e]));
        }
      }
    }
    h = fnv_vec(h, phy2log_);
    h = fnv_vec(h, log2phy_);
    h = fnv_vec(h, count_);
    h = fnv_vec(h, all_);
  }

 private:
  const Layout layout_;
  const int64_t layers_;
  std::vector<int64_t> phy2log_, log2phy_, count_, dispatch_;
  std::vector<int32_t> all_, valid_;
};

// An Installer for host memory that checks how the runtime uses it: one mark per install, and
// no read posted into the staging buffer while a mark has not been waited for (as if the
// engine's queued work still read the bytes that install replaced).
class CountingInstaller final : public Installer {
 public:
  void copy(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    copies_.fetch_add(1, std::memory_order_relaxed);
  }
  void mark() override {
    unwaited_.store(true, std::memory_order_release);
    marks_.fetch_add(1, std::memory_order_release);
  }
  void wait_marked(std::chrono::milliseconds) override {
    unwaited_.store(false, std::memory_order_release);
  }
  // Before every read this rank posts: a read while a mark is unwaited is a violation.
  void before_post() {
    if (unwaited_.load(std::memory_order_acquire)) {
      violations_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  int64_t marks() const { return marks_.load(std::memory_order_acquire); }
  int64_t violations() const { return violations_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> unwaited_{false};
  std::atomic<int64_t> copies_{0}, marks_{0}, violations_{0};
};

void fill_expected(const Scenario& s, Rebalancer& rb) {
  (void)s;
  fill_weights(rb, [](int64_t layer, int64_t tensor, int32_t expert, std::span<std::byte> bytes) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = weight_byte(layer, tensor, expert, static_cast<int64_t>(i));
    }
  });
}

// Invariant 1 on this rank; returns the hash of every layer's tables (invariant 2's input).
uint64_t check_rank(const Scenario& s, const Rebalancer& rb, int rank, int64_t step,
                    std::vector<std::string>& errors) {
  const Layout& layout = s.config.layout;
  const int64_t spr = layout.slots_per_rank();
  const int64_t first = rank * spr;
  uint64_t h = 1469598103934665603ull;
  const auto error = [&](auto&&... parts) {
    if (errors.size() < 20) {
      errors.push_back(detail::concat("rank ", rank, " step ", step, ": ", parts...));
    }
  };
  for (int64_t l = 0; l < s.weights.layers; ++l) {
    const auto phy2log = rb.phy2log(l);
    const routing::DispatchTables& tables = rb.dispatch(l);
    h = fnv(h, phy2log.data(), phy2log.size_bytes());
    h = fnv_vec(h, tables.log2phy);
    h = fnv_vec(h, tables.replica_count);
    h = fnv_vec(h, tables.static_slot);
    // Every local slot holds its expert's weights, byte for byte.
    for (int64_t t = 0; t < static_cast<int64_t>(s.weights.tensors.size()); ++t) {
      const int64_t bytes = s.weights.tensors[t].expert_bytes;
      for (int64_t j = 0; j < spr; ++j) {
        const auto slot = rb.slot_weights(l, t, j);
        const int32_t expert = phy2log[first + j];
        for (int64_t i = 0; i < bytes; ++i) {
          if (slot[i] != weight_byte(l, t, expert, i)) {
            error("layer ", l, " tensor ", t, " slot ", first + j, " byte ", i,
                  " does not hold expert ", expert, "'s weights");
            break;
          }
        }
      }
    }
    // Every slot a table names holds the expert it is named for.
    int64_t replicas = 0;
    for (int64_t e = 0; e < layout.experts; ++e) {
      if (tables.replica_count[e] < 1) error("layer ", l, " expert ", e, " has no replica");
      for (const int32_t p : tables.replicas(e)) {
        ++replicas;
        if (p < 0 || p >= layout.physical || phy2log[p] != e) {
          error("layer ", l, " log2phy names slot ", p, " for expert ", e, " but it holds ",
                (p >= 0 && p < layout.physical) ? phy2log[p] : -1);
        }
      }
      const int32_t p = tables.static_slot[rank * layout.experts + e];
      if (p < 0 || p >= layout.physical || phy2log[p] != e) {
        error("layer ", l, " static_slot sends expert ", e, " to slot ", p);
      }
    }
    if (replicas != layout.physical) {
      error("layer ", l, " tables name ", replicas, " slots, not ", layout.physical);
    }
  }
  return h;
}

std::string summary(const std::vector<RebalanceRecord>& history) {
  std::ostringstream out;
  out << history.size();
  if (!history.empty()) {
    const RebalanceRecord& r = history.back();
    out << " last " << outcome_name(r.outcome) << " " << r.trigger_step << "-" << r.end_step
        << " installed " << r.layers_installed << "/" << r.layers_moved;
    // min_gain's check decides from figures every rank shares: they match bit for bit.
    if (r.gain_checked) {
      out << " gain " << r.below_min_gain << r.priced << " " << std::hexfloat << r.moe_us_before
          << " " << r.moe_us_after << " " << r.gain_us << " " << r.price_us << std::defaultfloat;
    }
  }
  return out.str();
}

int64_t completed_count(const std::vector<RebalanceRecord>& history) {
  return std::count_if(history.begin(), history.end(),
                       [](const RebalanceRecord& r) { return r.outcome == Outcome::kCompleted; });
}

RankResult run_rank(const Scenario& s, int rank, const std::string& rendezvous,
                    SharedMinReduction* reduction) {
  RankResult result;
  result.rank = rank;
  const int ranks = static_cast<int>(s.config.layout.ranks);
  control::Options options;
  options.rank = rank;
  options.size = ranks;
  options.rendezvous = rendezvous + "-rt";
  options.group = "runtime";
  options.timeout = s.config.timeout;
  std::unique_ptr<control::Communicator> comm = control::connect(s.control, options);
  std::unique_ptr<control::Communicator> harness;
  if (s.compare_through_control) {
    options.rendezvous = rendezvous + "-h";
    options.group = "harness";
    harness = control::connect(s.control, options);
  }
  transport::Options topts;
  topts.rank = rank;
  std::unique_ptr<transport::Transport> backend;
  try {
    backend = transport::create(s.transport, topts);
  } catch (const IoError& e) {
    result.skipped = e.what();
    result.ran = true;
    return result;
  }
  CountingTransport transport(std::move(backend));

  Config config = s.config;
  if (s.carrier != Carrier::kControl) config.agreement = Agreement::kExternal;
  auto hook = std::make_shared<DelayHook>(s, rank);
  const std::function<void(DelayPoint)> delays = [hook](DelayPoint p) { (*hook)(p); };
  const Placement initial = trivial_placement(s.weights.layers, config.layout.experts,
                                              config.layout.physical);
  std::shared_ptr<CountingInstaller> installer;
  if (s.installer) {
    installer = std::make_shared<CountingInstaller>();
    config.installer = installer;
    transport.set_before_post([installer] { installer->before_post(); });
  }
  // The engine's own tensors: one buffer per layer and tensor, at an unaligned base, with
  // `engine_pad` bytes between slots (the gaps must never be written), as an engine allocates.
  WeightSpec spec = s.weights;
  std::vector<std::vector<std::byte>> own;
  constexpr std::byte kGap{0x5a};
  const int64_t spr = config.layout.slots_per_rank();
  if (s.engine_weights) {
    for (int64_t l = 0; l < spec.layers; ++l) {
      for (const TensorSpec& t : spec.tensors) {
        const int64_t stride = t.expert_bytes + s.engine_pad;
        own.emplace_back(static_cast<size_t>(8 + spr * stride), kGap);
        const size_t skew = static_cast<size_t>(1 + (l + rank) % 7);
        spec.engine.push_back({.base = own.back().data() + skew,
                               .stride = s.engine_pad == 0 ? 0 : stride});
      }
    }
  }
  const auto gaps_intact = [&] {
    if (s.engine_pad == 0) return true;
    for (size_t i = 0; i < own.size(); ++i) {
      const auto t = static_cast<int64_t>(i % spec.tensors.size());
      const int64_t bytes = spec.tensors[static_cast<size_t>(t)].expert_bytes;
      const auto* base = static_cast<const std::byte*>(spec.engine[i].base);
      for (int64_t j = 0; j < spr; ++j) {
        for (int64_t g = 0; g < s.engine_pad; ++g) {
          if (base[j * (bytes + s.engine_pad) + bytes + g] != kGap) return false;
        }
      }
    }
    return true;
  };
  Rebalancer rb(config, *comm, transport, spec, initial);
  RebalancerTesting::set_delay_hook(rb, delays);
  const int64_t held = rb.connect();
  // With Install::kCopy, or the engine's own tensors, the weights never move.
  std::vector<const std::byte*> addresses;
  for (int64_t l = 0; l < s.weights.layers; ++l) {
    for (int64_t t = 0; t < static_cast<int64_t>(s.weights.tensors.size()); ++t) {
      addresses.push_back(rb.weights(l, t).data());
      if (s.engine_weights && addresses.back() != spec.memory(l, t).base) {
        result.errors.push_back(detail::concat("rank ", rank, ": weights(", l, ", ", t,
                                               ") is not the engine's tensor"));
      }
    }
  }
  const int64_t allocations = transport.allocations();
  const int64_t allocated = transport.allocated_bytes();
  const int64_t imports = transport.imports();
  if (held != allocated) {
    result.errors.push_back(detail::concat("connect() reports ", held, " bytes, the transport ",
                                           allocated));
  }
  fill_expected(s, rb);
  std::optional<EngineMapTensors> maps;
  if (s.engine_maps) maps.emplace(s, rb);
  LoadSourceState load(s, rank);
  std::optional<Delivery> delivery;
  if (s.carrier == Carrier::kSharedMemory) {
    EPLB_CHECK(reduction != nullptr, "Carrier::kSharedMemory runs ranks as threads");
    delivery.emplace(s, rank, *reduction, rb);
    reduction->contribute(rb.step(), rb.agreement_contribution());
  }

  int64_t failure_step = -1;
  int64_t kill_trigger = -1;
  int64_t installed_at_kill_trigger = 0;
  for (int64_t step = 0; step < s.max_steps; ++step) {
    load.record(rb, step);
    uint64_t full_hash = check_rank(s, rb, rank, step, result.errors);
    if (maps) {
      maps->check(rb, rank, full_hash, [&](std::string e) {
        if (result.errors.size() < 20) {
          result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": ", e));
        }
      });
    }
    const uint64_t hash = full_hash & ((1ull << 62) - 1);
    if (s.engine_weights && !gaps_intact() && result.errors.size() < 20) {
      result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": an install wrote "
                                             "between the slots of an engine tensor"));
    }
    if (config.install == Install::kCopy || s.engine_weights) {
      for (int64_t l = 0, i = 0; l < s.weights.layers; ++l) {
        for (int64_t t = 0; t < static_cast<int64_t>(s.weights.tensors.size()); ++t, ++i) {
          if (rb.weights(l, t).data() != addresses[static_cast<size_t>(i)]) {
            result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": layer ", l,
                                                   " tensor ", t, " moved under Install::kCopy"));
          }
        }
      }
    }
    if (installer && installer->violations() > 0) {
      result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": ",
                                             installer->violations(), " reads posted into the "
                                             "staging buffer before the last install's mark was "
                                             "waited for"));
    }
    if (installer && installer->marks() != rb.installed_layers()) {
      result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": ",
                                             installer->marks(), " installer marks for ",
                                             rb.installed_layers(), " installs"));
    }
    const std::vector<RebalanceRecord> history = rb.history();
    const int64_t completed = completed_count(history);
    const int64_t failed = std::count_if(history.begin(), history.end(), [](const auto& r) {
      return r.outcome == Outcome::kFailed;
    });
    const int64_t skipped = std::count_if(history.begin(), history.end(), [](const auto& r) {
      return r.outcome == Outcome::kSkipped;
    });
    // Invariant 3: nothing allocated or connected since connect().
    if (transport.allocations() != allocations || transport.imports() != imports ||
        rb.bytes_held() != held) {
      if (result.errors.size() < 20) {
        result.errors.push_back(detail::concat("rank ", rank, " step ", step,
                                               ": memory or connections grew after connect()"));
      }
    }
    // Invariant 2 through the harness's own communicator: max of (h, -h) gives (max, -min).
    if (harness) {
      // Carrier::kHarnessCollective: this collective also carries the contribution of the
      // step just ended (max of -c is -min c), and the result comes in before the step_end
      // that may act on it (lag >= 1).
      std::vector<int64_t> v = {static_cast<int64_t>(hash), -static_cast<int64_t>(hash),
                                static_cast<int64_t>(history.size()),
                                -static_cast<int64_t>(history.size()), completed, -completed,
                                -rb.agreement_contribution()};
      harness->all_reduce(v, control::ReduceOp::kMax);
      if (s.carrier == Carrier::kHarnessCollective) rb.agreement_result(rb.step(), -v[6]);
      if (v[0] != -v[1] || v[2] != -v[3] || v[4] != -v[5]) {
        if (result.errors.size() < 20) {
          result.errors.push_back(detail::concat("rank ", rank, " step ", step,
                                                 ": ranks' tables or histories differ"));
        }
      }
    }
    result.log.push_back(detail::concat(step, " ", hash, " ", summary(history), " ",
                                        rb.rebalancing() ? "R" : "-"));
    result.steps = step + 1;
    // The end: the same step on every rank, since the histories are the same.
    const bool expect_failure = s.fail_rank >= 0 || s.kill_rank >= 0 || s.drop_results_from >= 0;
    if (completed >= s.completed && skipped >= s.skipped && !expect_failure &&
        !s.stop_mid_rebalance) {
      break;
    }
    if (expect_failure && failure_step < 0 && failed > 0) {
      failure_step = step;
    }
    if (failure_step >= 0 && step >= failure_step + s.steps_after_failure &&
        completed >= s.completed) {
      break;
    }
    if (s.kill_rank >= 0 && failure_step >= 0 && rb.control_broken() &&
        step >= failure_step + s.steps_after_failure) {
      break;
    }
    if (s.stop_mid_rebalance && completed >= s.completed && rb.rebalancing()) break;
    // Mid-rebalance: this rebalance has installed a layer, or run a few steps.
    if (rank == s.kill_rank && completed >= s.kill_after && rb.rebalancing()) {
      if (kill_trigger < 0) {
        kill_trigger = step;
        installed_at_kill_trigger = rb.installed_layers();
      }
      // After this rebalance installed a layer (so installed layers must survive the failure
      // everywhere), or after enough steps anyway.
      if (rb.installed_layers() > installed_at_kill_trigger || step >= kill_trigger + 40) {
        std::fflush(stdout);
        std::fflush(stderr);
        ::kill(::getpid(), SIGKILL);
      }
    }
    if (s.before_step_end) {
      std::string line = s.before_step_end(rb, rank, step);
      if (line.rfind("error: ", 0) == 0) {
        result.errors.push_back(detail::concat("rank ", rank, " step ", step, ": ", line));
      } else if (!line.empty()) {
        result.log.push_back(std::move(line));
      }
    }
    try {
      rb.step_end();
    } catch (...) {
      ++result.raised;
      // The message differs by rank (the failing one has the cause); the step must not.
      result.log.push_back(detail::concat("raised at step ", step));
    }
    if (delivery) reduction->contribute(rb.step(), rb.agreement_contribution());
  }
  if (harness) harness->barrier();
  if (delivery) {
    delivery->stop();
    if (!delivery->error().empty()) {
      result.errors.push_back(detail::concat("rank ", rank, " delivery: ", delivery->error()));
    }
  }
  rb.shutdown();
  result.history = rb.history();
  result.metrics = rb.metrics_text();
  result.ran = true;
  return result;
}

// Processes hand their result to the parent as a small text file.
void write_result(const RankResult& r, const std::string& path) {
  std::ofstream out(path);
  if (!r.skipped.empty()) out << "skipped " << r.skipped << "\n";
  out << "ran " << r.ran << "\nraised " << r.raised << "\nsteps " << r.steps << "\n";
  for (const auto& e : r.errors) out << "error " << e << "\n";
  for (const auto& l : r.log) out << "log " << l << "\n";
  for (const auto& h : r.history) {
    out << "history " << static_cast<int>(h.outcome) << " " << h.trigger_step << " "
        << h.end_step << " " << h.layers_moved << " " << h.layers_installed << " "
        << h.slots_moved << " " << h.bytes_installed << " " << h.error << "\n";
  }
}

RankResult read_result(const std::string& path, int rank) {
  RankResult r;
  r.rank = rank;
  std::ifstream in(path);
  if (!in) return r;
  std::string line;
  while (std::getline(in, line)) {
    const auto space = line.find(' ');
    const std::string key = line.substr(0, space);
    const std::string rest = space == std::string::npos ? "" : line.substr(space + 1);
    if (key == "ran") r.ran = rest == "1";
    if (key == "skipped") r.skipped = rest;
    if (key == "raised") r.raised = std::stoll(rest);
    if (key == "steps") r.steps = std::stoll(rest);
    if (key == "error") r.errors.push_back(rest);
    if (key == "log") r.log.push_back(rest);
    if (key == "history") {
      std::istringstream fields(rest);
      RebalanceRecord h;
      int outcome = 0;
      fields >> outcome >> h.trigger_step >> h.end_step >> h.layers_moved >> h.layers_installed >>
          h.slots_moved >> h.bytes_installed;
      h.outcome = static_cast<Outcome>(outcome);
      std::getline(fields, h.error);
      r.history.push_back(h);
    }
  }
  return r;
}

std::string unique_rendezvous(const Scenario& s) {
  static std::atomic<int> counter{0};
  return detail::concat("eplb-rt-", s.name, "-", ::getpid(), "-", counter++);
}

}  // namespace

std::byte weight_byte(int64_t layer, int64_t tensor, int64_t expert, int64_t index) {
  const uint64_t word = mix64((static_cast<uint64_t>(layer) << 40) ^
                              (static_cast<uint64_t>(tensor) << 32) ^
                              (static_cast<uint64_t>(expert) << 16) ^
                              static_cast<uint64_t>(index / 8));
  return static_cast<std::byte>((word >> (8 * (index % 8))) & 0xff);
}

uint64_t test_seed(uint64_t fallback) {
  const char* env = std::getenv("EPLB_TEST_SEED");
  return env && *env ? std::strtoull(env, nullptr, 10) : fallback;
}

std::vector<RankResult> run_scenario(const Scenario& s) {
  const int ranks = static_cast<int>(s.config.layout.ranks);
  const std::string rendezvous = unique_rendezvous(s);
  std::vector<RankResult> results(static_cast<size_t>(ranks));
  if (!s.processes) {
    SharedMinReduction reduction(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        try {
          results[r] = run_rank(s, r, rendezvous, &reduction);
        } catch (const std::exception& e) {
          results[r].rank = r;
          results[r].errors.push_back(detail::concat("rank ", r, " threw: ", e.what()));
        }
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/eplb-runtime-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) fail<IoError>("mkdtemp failed for ", dir);
  control::ForkOptions fork_options;
  fork_options.timeout = std::chrono::milliseconds(240'000);
  // Survivors of a killed rank go on serving; give them the time to finish their run.
  fork_options.grace = std::chrono::milliseconds(120'000);
  const std::vector<control::RankExit> exits = control::fork_ranks(
      ranks,
      [&](int r) {
        RankResult result;
        try {
          result = run_rank(s, r, rendezvous, nullptr);
        } catch (const std::exception& e) {
          result.rank = r;
          result.ran = true;
          result.errors.push_back(detail::concat("rank ", r, " threw: ", e.what()));
        }
        write_result(result, detail::concat(dir, "/rank", r));
        return 0;
      },
      fork_options);
  for (int r = 0; r < ranks; ++r) {
    results[r] = read_result(detail::concat(dir, "/rank", r), r);
    const control::RankExit& exit = exits[r];
    const bool expected_kill = r == s.kill_rank && exit.signal == SIGKILL && !exit.killed_by_launcher;
    if (!exit.ok() && !expected_kill) {
      results[r].errors.push_back("process " + exit.describe());
    }
    if (r == s.kill_rank && !expected_kill) {
      results[r].errors.push_back("rank " + std::to_string(r) + " was to be killed mid-rebalance: " +
                                  exit.describe());
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return results;
}

}  // namespace eplb::runtime::testing
