#include "runtime/runtime_metrics.h"

#include <array>
#include <limits>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>
#include <prometheus/text_serializer.h>

#include "eplb/core/error.h"
#include "eplb/runtime/metric_families.h"

namespace eplb::runtime {
namespace {

using prometheus::Labels;

// Powers of two from 1 to 1024 steps; 1 ms to ~2 min; 10 us to ~1.3 s per step.
prometheus::Histogram::BucketBoundaries exponential(double first, double factor, int count) {
  prometheus::Histogram::BucketBoundaries out;
  double v = first;
  for (int i = 0; i < count; ++i, v *= factor) out.push_back(v);
  return out;
}

constexpr std::array<Outcome, 4> kOutcomes = {Outcome::kCompleted, Outcome::kSkipped,
                                              Outcome::kFailed, Outcome::kCancelled};

std::string_view type_name(prometheus::MetricType type) {
  switch (type) {
    case prometheus::MetricType::Counter: return "counter";
    case prometheus::MetricType::Gauge: return "gauge";
    case prometheus::MetricType::Summary: return "summary";
    case prometheus::MetricType::Histogram: return "histogram";
    case prometheus::MetricType::Untyped: break;
  }
  return "untyped";
}

prometheus::MetricType type_of(std::string_view name) {
  for (const auto type : {prometheus::MetricType::Counter, prometheus::MetricType::Gauge,
                          prometheus::MetricType::Summary, prometheus::MetricType::Histogram,
                          prometheus::MetricType::Untyped}) {
    if (type_name(type) == name) return type;
  }
  fail("metric type '", name, "' is not one of counter, gauge, summary, histogram, untyped");
}

}  // namespace

std::string_view phase_name(Phase phase) {
  switch (phase) {
    case Phase::kIdle: return "idle";
    case Phase::kWindow: return "window";
    case Phase::kPlacement: return "placement";
    case Phase::kReading: return "reading";
    case Phase::kAgreeing: return "agreeing";
  }
  return "?";
}

RuntimeMetrics::RuntimeMetrics(std::shared_ptr<prometheus::Registry> registry, int rank,
                               const std::map<std::string, std::string>& labels)
    : registry_(registry ? std::move(registry) : std::make_shared<prometheus::Registry>()),
      own_(labels.begin(), labels.end()) {
  // Every label is a label of each metric, none of the family: the Rebalancers of one process
  // (rank threads, or an engine's several models) then share the families of one registry,
  // which takes a family of one name with one set of constant labels only.
  own_["rank"] = std::to_string(rank);
  prometheus::Registry& r = *registry_;
  auto& steps = prometheus::BuildCounter().Name("eplb_steps_total").Help("step_end() calls")
                    .Register(r);
  if (steps.Has(own_)) {
    std::string described;
    for (const auto& [k, v] : own_) described += (described.empty() ? "" : ", ") + k + "=" + v;
    fail("the metrics registry already holds the metrics of a Rebalancer labelled ", described,
         ": give each Rebalancer sharing a registry its own metric_labels (a model name, say)");
  }
  steps_ = &add(steps);
  const auto counter = [&](const char* name, const char* help) {
    return &add(prometheus::BuildCounter().Name(name).Help(help).Register(r));
  };
  const auto gauge = [&](const char* name, const char* help) {
    return &add(prometheus::BuildGauge().Name(name).Help(help).Register(r));
  };
  const auto histogram = [&](const char* name, const char* help,
                             prometheus::Histogram::BucketBoundaries buckets) {
    return &add(prometheus::BuildHistogram().Name(name).Help(help).Register(r), {},
                std::move(buckets));
  };

  balancedness_family_ =
      &prometheus::BuildGauge()
           .Name("eplb_balancedness")
           .Help("Mean rank load / max rank load, mean over the MoE layers: source=recorded is "
                 "the recorded window under the placement in force (measured every "
                 "balancedness_period steps); predicted_before / predicted_after are the last "
                 "rebalance's prediction on its window for the old and the new placement")
           .Register(r);
  auto& rebalances = prometheus::BuildCounter()
                         .Name("eplb_rebalances_total")
                         .Help("Rebalances ended, by outcome (the same on every rank)")
                         .Register(r);
  for (const Outcome o : kOutcomes) {
    rebalances_[o] = &add(rebalances, {{"outcome", std::string(outcome_name(o))}});
  }
  layers_installed_ =
      counter("eplb_layers_installed_total", "Layers installed on this rank by rebalances");
  slots_moved_ = counter("eplb_slots_moved_total",
                         "Slots of this rank whose expert a rebalance changed (installed layers)");
  auto& bytes = prometheus::BuildCounter()
                    .Name("eplb_bytes_moved_total")
                    .Help("Expert bytes this rank received in installed layers, by path: reads "
                          "from a rank of the same node, of another node, and copies within "
                          "this rank")
                    .Register(r);
  bytes_intra_ = &add(bytes, {{"path", "intra_node"}});
  bytes_inter_ = &add(bytes, {{"path", "inter_node"}});
  bytes_local_ = &add(bytes, {{"path", "local_copy"}});
  bytes_installed_ = counter("eplb_bytes_installed_total",
                             "Bytes installs wrote into this rank's live weights");
  below_min_gain_ = counter("eplb_rebalances_below_min_gain_total",
                            "Rebalances skipped because the MoE time they were predicted to save "
                            "over the next interval was below min_gain times their price");
  predicted_gain_ = gauge("eplb_rebalance_predicted_gain_seconds",
                          "The MoE time the last rebalance min_gain checked was predicted to "
                          "save over the next interval (negative: to lose)");
  price_ = gauge("eplb_rebalance_price_seconds",
                 "The price of the last rebalance min_gain checked: its bytes at the measured "
                 "pull bandwidth, plus the last rebalance's stall (0: not priced yet)");
  duration_steps_ = histogram("eplb_rebalance_duration_steps",
                              "Steps from a rebalance's trigger to its end",
                              exponential(1, 2, 11));
  duration_seconds_ = histogram("eplb_rebalance_duration_seconds",
                                "Seconds from a rebalance's trigger to its end on this rank",
                                exponential(0.001, 4, 9));
  stall_ = histogram("eplb_forward_stall_seconds",
                     "The forward thread's time in step_end, per step of a rebalance in flight",
                     exponential(1e-5, 4, 11));
  in_flight_ = gauge("eplb_rebalance_in_flight", "1 while a rebalance runs");
  age_steps_ = gauge("eplb_rebalance_age_steps", "Steps since the rebalance in flight began");
  age_seconds_ =
      gauge("eplb_rebalance_age_seconds", "Seconds since the rebalance in flight began");
  layer_ = gauge("eplb_rebalance_layer",
                 "The layer the rebalance in flight reads or waits for (-1: none)");
  since_progress_ = gauge("eplb_rebalance_seconds_since_progress",
                          "Seconds since the rebalance in flight last changed phase, read or "
                          "installed a layer");
  stalled_ = gauge("eplb_rebalance_stalled",
                   "1 while the rebalance in flight has made no progress for stall_warn");
  auto& phase = prometheus::BuildGauge()
                    .Name("eplb_rebalance_phase")
                    .Help("1 for the phase the rebalance in flight is in (idle when none)")
                    .Register(r);
  for (int p = 0; p < kNumPhases; ++p) {
    phase_.push_back(&add(phase, {{"phase", std::string(phase_name(static_cast<Phase>(p)))}}));
  }
  phase_[0]->Set(1);
  layer_->Set(-1);
  watchdog_warnings_ = counter("eplb_watchdog_warnings_total",
                               "Warnings of a rebalance making no progress for stall_warn");
  bytes_held_ = gauge("eplb_bytes_held", "Bytes eplb holds (arena or staging)");
  reconfigures_ = counter("eplb_reconfigures_total",
                          "reconfigure() calls: groups this rank joined after the first");
  members_ = gauge("eplb_group_members", "Ranks in the group now (the layout's ranks until a "
                                         "reconfigure)");
  unavailable_ = gauge("eplb_unavailable_experts",
                       "Experts of all layers with no replica any token can be routed to");
  bytes_restored_ = counter("eplb_bytes_restored_total",
                            "Bytes this rank restored from a backup copy or the loader");
}

RuntimeMetrics::~RuntimeMetrics() {
  // Out of the registry with the Rebalancer: an engine's registry outlives it, and a new
  // Rebalancer of the same labels (after a restart) must find the place free.
  for (auto it = removers_.rbegin(); it != removers_.rend(); ++it) (*it)();
}

template <typename T, typename... Args>
T& RuntimeMetrics::add(prometheus::Family<T>& family, const prometheus::Labels& extra,
                       Args&&... args) {
  prometheus::Labels labels = own_;
  labels.insert(extra.begin(), extra.end());
  T& metric = family.Add(labels, std::forward<Args>(args)...);
  removers_.push_back([&family, &metric] { family.Remove(&metric); });
  return metric;
}

prometheus::Gauge& RuntimeMetrics::balancedness(const std::string& source) {
  std::lock_guard<std::mutex> lock(balancedness_mu_);
  const auto it = balancedness_.find(source);
  if (it != balancedness_.end()) return *it->second;
  prometheus::Gauge& gauge = add(*balancedness_family_, {{"source", source}});
  balancedness_[source] = &gauge;
  return gauge;
}

void RuntimeMetrics::set_recorded_balancedness(double value) {
  balancedness("recorded").Set(value);
}

void RuntimeMetrics::on_layer_installed(const migration::LayerPlan& plan, const Layout& layout,
                                        int rank, int64_t expert_bytes) {
  layers_installed_->Increment();
  int64_t moved = 0, local = 0;
  for (const migration::SlotAction& a : plan.rank_actions(rank, layout)) {
    if (a.action == migration::Action::kUnchanged) continue;
    ++moved;
    if (a.action == migration::Action::kLocalCopy || a.action == migration::Action::kFreeRide) {
      ++local;
    }
  }
  int64_t intra = 0, inter = 0;
  for (const migration::RemoteRead& r : plan.reads) {
    if (r.dst_rank != rank) continue;
    (layout.node_of_rank(r.src_rank) == layout.node_of_rank(rank) ? intra : inter) += 1;
  }
  const auto bytes = [&](int64_t n) { return static_cast<double>(n * expert_bytes); };
  slots_moved_->Increment(static_cast<double>(moved));
  bytes_local_->Increment(bytes(local));
  bytes_intra_->Increment(bytes(intra));
  bytes_inter_->Increment(bytes(inter));
}

void RuntimeMetrics::on_record(const RebalanceRecord& record) {
  rebalances_.at(record.outcome)->Increment();
  duration_steps_->Observe(static_cast<double>(record.steps));
  duration_seconds_->Observe(record.seconds);
  bytes_installed_->Increment(static_cast<double>(record.bytes_installed));
  bytes_restored_->Increment(static_cast<double>(record.bytes_restored));
  if (record.gain_checked) {
    if (record.below_min_gain) below_min_gain_->Increment();
    predicted_gain_->Set(record.gain_us / 1e6);
    price_->Set(record.price_us / 1e6);
  }
  if (record.balancedness_before > 0) {
    balancedness("predicted_before").Set(record.balancedness_before);
  }
  if (record.balancedness_after > 0) {
    balancedness("predicted_after").Set(record.balancedness_after);
  }
}

void RuntimeMetrics::set_in_flight(const InFlight& f) {
  in_flight_->Set(f.active ? 1 : 0);
  if (!f.active) {
    age_steps_->Set(0);
    age_seconds_->Set(0);
    since_progress_->Set(0);
  } else {
    age_seconds_->Set(f.age_seconds);
    since_progress_->Set(f.since_progress_seconds);
  }
  layer_->Set(static_cast<double>(f.active ? f.layer : -1));
  stalled_->Set(f.active && f.stalled ? 1 : 0);
  for (int p = 0; p < kNumPhases; ++p) {
    phase_[static_cast<size_t>(p)]->Set(static_cast<int>(f.active ? f.phase : Phase::kIdle) == p
                                            ? 1
                                            : 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Families between processes.

std::string metrics_text(const std::vector<prometheus::MetricFamily>& families) {
  return prometheus::TextSerializer().Serialize(families);
}

std::string families_to_json(const std::vector<prometheus::MetricFamily>& families) {
  nlohmann::json out = nlohmann::json::array();
  for (const prometheus::MetricFamily& f : families) {
    nlohmann::json metrics = nlohmann::json::array();
    for (const prometheus::ClientMetric& m : f.metric) {
      nlohmann::json labels = nlohmann::json::array();  // in order, as the exposition has them
      for (const auto& l : m.label) labels.push_back({l.name, l.value});
      nlohmann::json one = {{"labels", labels}};
      switch (f.type) {
        case prometheus::MetricType::Counter: one["value"] = m.counter.value; break;
        case prometheus::MetricType::Gauge: one["value"] = m.gauge.value; break;
        case prometheus::MetricType::Untyped: one["value"] = m.untyped.value; break;
        case prometheus::MetricType::Histogram: {
          nlohmann::json buckets = nlohmann::json::array();
          for (const auto& b : m.histogram.bucket) {
            buckets.push_back({b.upper_bound, b.cumulative_count});
          }
          one["count"] = m.histogram.sample_count;
          one["sum"] = m.histogram.sample_sum;
          one["buckets"] = buckets;
          break;
        }
        case prometheus::MetricType::Summary: {
          nlohmann::json quantiles = nlohmann::json::array();
          for (const auto& q : m.summary.quantile) quantiles.push_back({q.quantile, q.value});
          one["count"] = m.summary.sample_count;
          one["sum"] = m.summary.sample_sum;
          one["quantiles"] = quantiles;
          break;
        }
      }
      metrics.push_back(std::move(one));
    }
    out.push_back({{"name", f.name},
                   {"help", f.help},
                   {"type", type_name(f.type)},
                   {"metrics", std::move(metrics)}});
  }
  return out.dump();
}

std::vector<prometheus::MetricFamily> families_from_json(std::string_view text) {
  std::vector<prometheus::MetricFamily> out;
  try {
    const nlohmann::json doc = nlohmann::json::parse(text);
    for (const nlohmann::json& f : doc) {
      prometheus::MetricFamily family;
      family.name = f.at("name").get<std::string>();
      family.help = f.at("help").get<std::string>();
      family.type = type_of(f.at("type").get<std::string>());
      for (const nlohmann::json& m : f.at("metrics")) {
        prometheus::ClientMetric metric;
        for (const nlohmann::json& l : m.at("labels")) {
          metric.label.push_back({l.at(0).get<std::string>(), l.at(1).get<std::string>()});
        }
        switch (family.type) {
          case prometheus::MetricType::Counter: metric.counter.value = m.at("value"); break;
          case prometheus::MetricType::Gauge: metric.gauge.value = m.at("value"); break;
          case prometheus::MetricType::Untyped: metric.untyped.value = m.at("value"); break;
          case prometheus::MetricType::Histogram:
            metric.histogram.sample_count = m.at("count");
            metric.histogram.sample_sum = m.at("sum");
            for (const nlohmann::json& b : m.at("buckets")) {
              // The last bucket's bound is +Inf, which JSON writes as null.
              metric.histogram.bucket.push_back(
                  {.cumulative_count = b.at(1),
                   .upper_bound = b.at(0).is_null() ? std::numeric_limits<double>::infinity()
                                                    : b.at(0).get<double>()});
            }
            break;
          case prometheus::MetricType::Summary:
            metric.summary.sample_count = m.at("count");
            metric.summary.sample_sum = m.at("sum");
            for (const nlohmann::json& q : m.at("quantiles")) {
              metric.summary.quantile.push_back({.quantile = q.at(0), .value = q.at(1)});
            }
            break;
        }
        family.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(family));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("metric families: malformed JSON (", e.what(), ")");
  }
  return out;
}

std::vector<prometheus::MetricFamily> merge_families(
    const std::vector<std::vector<prometheus::MetricFamily>>& sets) {
  std::vector<prometheus::MetricFamily> out;
  std::map<std::string, size_t> index;
  for (const auto& set : sets) {
    for (const prometheus::MetricFamily& f : set) {
      const auto [it, fresh] = index.emplace(f.name, out.size());
      if (fresh) {
        out.push_back(f);
        continue;
      }
      prometheus::MetricFamily& into = out[it->second];
      if (into.type != f.type) {
        fail("metric family ", f.name, " is a ", type_name(f.type), " in one set and a ",
             type_name(into.type), " in another");
      }
      into.metric.insert(into.metric.end(), f.metric.begin(), f.metric.end());
    }
  }
  return out;
}

}  // namespace eplb::runtime
