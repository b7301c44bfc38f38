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

// Installs moved layer k of `plan` on this rank: the staged buffer becomes live, the new
// tables and phy2log take effect. kSwap: O(1) in the weights' size; kCopy: one layer copied
// (or enqueued, by the installer).
void Rebalancer::Impl::install(RebalancePlan& plan, int64_t k) {
  const int64_t layer = plan.moved_layers[k];
  if (delay_hook_) delay_hook_(DelayPoint::kInstall);
  if (spec_.engine_weights()) {
    install_into_engine(plan, k);
  } else if (swaps()) {
    map_.install(layer);
  } else {
    std::byte* live = region_.data + arena_.offset(map_.buffer_of_layer[layer], 0, 0);
    const std::byte* staged = region_.data + arena_.offset(map_.staging, 0, 0);
    const auto bytes = static_cast<size_t>(arena_.layer_bytes());
    if (config_.installer) {
      installer_or_stop([&] { config_.installer->copy(live, staged, bytes); }, layer);
    } else {
      std::memcpy(live, staged, bytes);
    }
    records_.open->bytes_installed += static_cast<int64_t>(bytes);
  }
  if (config_.installer) installer_or_stop([&] { config_.installer->mark(); }, layer);
  std::swap(tables_[layer], plan.tables[k]);
  std::copy(plan.phy2log[k].begin(), plan.phy2log[k].end(),
            phy2log_.begin() + layer * config_.layout.physical);
  write_maps(layer);
  mark_installed(layer);
  for (const migration::Restore& r : plan.migrations[k].plan.restores) {
    if (r.dst_rank == seat_) records_.open->bytes_restored += spec_.expert_bytes();
  }
  ++installed_total_;
  ++records_.open->layers_installed;
  metrics_->on_layer_installed(plan.migrations[k].plan, config_.layout, seat_,
                               spec_.expert_bytes());
  progress_.touch(records_.open->index);
}

// Installs swap buffers only with the arena and Install::kSwap.
bool Rebalancer::Impl::swaps() const {
  return !spec_.engine_weights() && config_.install == Install::kSwap;
}

// The engine's tensors of layer k of `plan` get, slot by slot, the staged bytes of every
// slot whose expert changes; the others are not written.
void Rebalancer::Impl::install_into_engine(const RebalancePlan& plan, int64_t k) {
  const int64_t layer = plan.moved_layers[k];
  const auto actions = plan.migrations[k].plan.rank_actions(seat_, config_.layout);
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
      records_.open->bytes_installed += static_cast<int64_t>(bytes);
    }
  }
}

// An installer that fails mid-install (a CUDA error on the engine's stream) leaves this rank's
// weights, tables and buffer map no longer in step with each other or with the other ranks',
// and there is no consistent way back: the process stops, loudly, so that its peers see a dead
// rank and abandon the rebalance cleanly instead of serving wrong experts.
template <typename F>
void Rebalancer::Impl::installer_or_stop(F&& call, int64_t layer) {
  try {
    call();
  } catch (...) {
    spdlog::critical("eplb runtime rank {}: the installer failed installing layer {}: {}; "
                     "this rank's weights can no longer be trusted, stopping the process",
                     seat_, layer, Failure::current().message);
    spdlog::shutdown();
    std::abort();
  }
}

}  // namespace eplb::runtime
