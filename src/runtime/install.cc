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

void Rebalancer::Impl::write_maps(int64_t layer) const {
  if (maps_.empty()) return;
  const int64_t P = config_.layout.physical;
  maps_.write(layer, {phy2log_.data() + layer * P, static_cast<size_t>(P)}, tables_[layer],
              rank_);
}

void Rebalancer::Impl::install(RebalancePlan& plan, int64_t k) {
  const int64_t layer = plan.moved_layers[k];
  if (delay_hook_) delay_hook_(DelayPoint::kInstall);
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
  write_maps(layer);
  mark_installed(layer);
  for (const migration::Restore& r : plan.migrations[k].plan.restores) {
    if (r.dst_rank == rank_) open_->bytes_restored += spec_.expert_bytes();
  }
  ++installed_total_;
  ++open_->layers_installed;
  metrics_->on_layer_installed(plan.migrations[k].plan, config_.layout, rank_,
                               spec_.expert_bytes());
  progress_.touch(open_->index);
}

bool Rebalancer::Impl::swaps() const {
  return !spec_.engine_weights() && config_.install == Install::kSwap;
}

void Rebalancer::Impl::install_into_engine(const RebalancePlan& plan, int64_t k) {
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

template <typename F>
void Rebalancer::Impl::installer_or_stop(F&& call, int64_t layer) {
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

}  // namespace eplb::runtime
