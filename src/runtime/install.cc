// Installing a staged layer, on the forward thread inside step_end(), at the step every rank
// installs it: the weights (a buffer swap, a copy, or the changed slots of the engine's
// tensors), the tables, phy2log and the engine's bound maps (Rebalancer::Impl).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "eplb/core/error.h"
#include "runtime/compute.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/impl.h"
#include "runtime/stage.h"

namespace eplb::runtime {

// Rows `layer` of the bound maps from phy2log_ and tables_ (after any change of either).
void Rebalancer::Impl::write_maps(int64_t layer) const {
  if (maps_.empty()) return;
  const int64_t P = config_.layout.physical;
  maps_.write(layer, {phy2log_.data() + layer * P, static_cast<size_t>(P)}, tables_[layer],
              seat_);
}

// Installs moved layer k of `plan` on this rank: the staged layer becomes live (the weight
// store's install), the new tables and phy2log take effect.
void Rebalancer::Impl::install(RebalancePlan& plan, int64_t k) {
  const int64_t layer = plan.moved_layers[k];
  if (delay_hook_) delay_hook_(DelayPoint::kInstall);
  records_.open->bytes_installed += weights_.install(plan.migrations[k], layer);
  std::swap(tables_[layer], plan.tables[k]);
  std::copy(plan.phy2log[k].begin(), plan.phy2log[k].end(),
            phy2log_.begin() + layer * config_.layout.physical);
  write_maps(layer);
  group_.mark_installed(layer, [&](int seat) { return weights_.member(seat); });
  if (group_.repair_pending()) metrics_->set_unavailable(unavailable_count());
  for (const migration::Restore& r : plan.migrations[k].plan.restores) {
    if (r.dst_rank == seat_) records_.open->bytes_restored += spec_.expert_bytes();
  }
  ++records_.open->layers_installed;
  metrics_->on_layer_installed(plan.migrations[k].plan, config_.layout, seat_,
                               spec_.expert_bytes());
  progress_.touch(records_.open->index);
}

}  // namespace eplb::runtime
