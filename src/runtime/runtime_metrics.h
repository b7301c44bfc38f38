#pragma once
// The Rebalancer's metrics (docs/runtime.md, "Metrics"): prometheus-cpp families registered in
// the engine's registry or one of the Rebalancer's own. prometheus-cpp's metrics are atomic, so
// every method here may be called from any thread; the Rebalancer calls the record and install
// ones on the forward thread, the in-flight ones on the monitor thread and in collect().

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "eplb/core/types.h"
#include "eplb/migration/planner.h"
#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime {

// The phases of a rebalance in flight, as the watchdog and the phase metric name them.
enum class Phase {
  kIdle,       // none in flight
  kWindow,     // the window all-reduce (every rank's loads) on the control thread
  kPlacement,  // the worker computes the placement, the plan and the tables
  kReading,    // staging a layer: local copies and reads from peers
  kAgreeing,   // waiting for every rank (the plan, or a staged layer) before installing
};
inline constexpr int kNumPhases = 5;
std::string_view phase_name(Phase phase);

class RuntimeMetrics {
 public:
  // Registers the families in `registry` (a new one when null), every metric labelled
  // rank="<rank>" and with `labels`.
  // InvalidArgument when `registry` already holds the metrics of a Rebalancer with the same
  // rank and labels. The destructor takes them out again.
  RuntimeMetrics(std::shared_ptr<prometheus::Registry> registry, int rank,
                 const std::map<std::string, std::string>& labels);
  ~RuntimeMetrics();
  RuntimeMetrics(const RuntimeMetrics&) = delete;
  RuntimeMetrics& operator=(const RuntimeMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  void on_step() { steps_->Increment(); }
  // The forward thread's time in one step_end of a rebalance in flight.
  void on_stall(double seconds) { stall_->Observe(seconds); }
  // One layer of a rebalance installed on this rank: the slots and bytes it moved here.
  void on_layer_installed(const migration::LayerPlan& plan, const Layout& layout, int rank,
                          int64_t expert_bytes);
  void on_record(const RebalanceRecord& record);
  void set_bytes_held(int64_t bytes) { bytes_held_->Set(static_cast<double>(bytes)); }
  // The measured balancedness of the recorded window under the placement in force.
  void set_recorded_balancedness(double value);

  // The rebalance in flight (or none): age in steps and seconds, the phase, the layer, the
  // seconds since its last progress, and whether the watchdog calls it stalled.
  struct InFlight {
    bool active = false;
    int64_t age_steps = 0;
    double age_seconds = 0;
    Phase phase = Phase::kIdle;
    int64_t layer = -1;
    double since_progress_seconds = 0;
    bool stalled = false;
  };
  void set_in_flight(const InFlight& in_flight);
  void set_age_steps(int64_t steps) { age_steps_->Set(static_cast<double>(steps)); }
  void on_watchdog_warning() { watchdog_warnings_->Increment(); }
  // Elastic serving: after a reconfigure, the members and unavailable experts now (all layers);
  // the latter again after each install.
  void on_reconfigure(int64_t members) {
    reconfigures_->Increment();
    set_members(members);
  }
  void set_members(int64_t members) { members_->Set(static_cast<double>(members)); }
  void set_unavailable(int64_t experts) { unavailable_->Set(static_cast<double>(experts)); }

 private:
  // Balancedness gauges appear once they have a value: a 0 would read as "as bad as it gets".
  prometheus::Gauge& balancedness(const std::string& source);

  // Adds this Rebalancer's metric (its labels and `extra`) to `family`, to be removed again.
  template <typename T, typename... Args>
  T& add(prometheus::Family<T>& family, const prometheus::Labels& extra = {}, Args&&... args);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Labels own_;  // rank and the config's metric_labels
  std::vector<std::function<void()>> removers_;
  prometheus::Family<prometheus::Gauge>* balancedness_family_ = nullptr;
  std::mutex balancedness_mu_;  // guards the lazy adds of balancedness gauges
  std::map<std::string, prometheus::Gauge*> balancedness_;  // by source; guarded by it
  std::map<Outcome, prometheus::Counter*> rebalances_;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* layers_installed_ = nullptr;
  prometheus::Counter* slots_moved_ = nullptr;
  prometheus::Counter* bytes_intra_ = nullptr;
  prometheus::Counter* bytes_inter_ = nullptr;
  prometheus::Counter* bytes_local_ = nullptr;
  prometheus::Counter* bytes_installed_ = nullptr;
  prometheus::Histogram* duration_steps_ = nullptr;
  prometheus::Histogram* duration_seconds_ = nullptr;
  prometheus::Histogram* stall_ = nullptr;
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Gauge* age_steps_ = nullptr;
  prometheus::Gauge* age_seconds_ = nullptr;
  prometheus::Gauge* layer_ = nullptr;
  prometheus::Gauge* since_progress_ = nullptr;
  prometheus::Gauge* stalled_ = nullptr;
  std::vector<prometheus::Gauge*> phase_;  // [kNumPhases]
  prometheus::Counter* watchdog_warnings_ = nullptr;
  prometheus::Gauge* bytes_held_ = nullptr;
  prometheus::Counter* reconfigures_ = nullptr;
  prometheus::Gauge* members_ = nullptr;
  prometheus::Gauge* unavailable_ = nullptr;
  prometheus::Counter* bytes_restored_ = nullptr;
  prometheus::Counter* below_min_gain_ = nullptr;
  prometheus::Gauge* predicted_gain_ = nullptr;
  prometheus::Gauge* price_ = nullptr;
};

}  // namespace eplb::runtime
