// Rebalancer::Impl's start-up: connect() (the first agreement, the regions of the weight store,
// the threads). The
// rest of the class is in rebalancer.cc (construction, forward thread), the files of a
// rebalance's steps (trigger.cc, agree.cc, install.cc, records.cc), elastic.cc and sync.cc.

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "eplb/control/communicator.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/config.h"
#include "runtime/control_thread.h"
#include "runtime/failure.h"
#include "runtime/impl.h"
#include "runtime/compute.h"
#include "runtime/cpu_wait.h"
#include "runtime/stage.h"

namespace eplb::runtime {

// ---------------------------------------------------------------- start-up
int64_t Rebalancer::Impl::connect() {
  EPLB_CHECK(lifecycle_ != Lifecycle::kJoining,
             "a joining Rebalancer enters through reconfigure(), not connect()");
  EPLB_CHECK(lifecycle_ != Lifecycle::kConnected, "connect() was already called");
  const std::chrono::milliseconds timeout = config_.timeout;
  transport::Transport& transport = weights_.transport();
  if (transport.capabilities().device_memory && !config_.installer) {
    fail("the ", transport.backend(), " transport keeps the weights in device memory: set "
         "Config::installer (eplb::cuda::StreamInstaller on the engine's stream) so that "
         "installs are ordered with the engine's queued work");
  }
  // Step 1: the arena, staging included, as one region; or the staging layer alone and the
  // engine's tensors registered, one region each; then the backup copy.
  const bool engine = spec_.engine_weights();
  weights_.allocate(transport);
  const WeightStore::Regions& regions = weights_.regions();
  // Step 2: exchange (fingerprint, region id, descriptor) with every peer.
  const std::vector<std::byte> descriptor = transport.export_descriptor();
  const uint64_t fingerprint = config_fingerprint(config_, spec_);
  constexpr size_t kHead = sizeof(uint64_t) + 2 * sizeof(int32_t);
  std::vector<std::byte> mine(kHead + descriptor.size());
  const int32_t region_id = regions.arena.id;
  const int32_t backup_id = regions.backup.bytes > 0 ? regions.backup.id : -1;
  std::memcpy(mine.data(), &fingerprint, sizeof fingerprint);
  std::memcpy(mine.data() + sizeof fingerprint, &region_id, sizeof region_id);
  std::memcpy(mine.data() + sizeof fingerprint + sizeof region_id, &backup_id, sizeof backup_id);
  std::memcpy(mine.data() + kHead, descriptor.data(), descriptor.size());
  const std::vector<control::Bytes> all = comm_->all_gather(mine, timeout);
  weights_.clear_peers();
  for (size_t g = 0; g < all.size(); ++g) {
    const control::Bytes& b = all[g];
    uint64_t theirs = 0;
    EPLB_CHECK_GE(b.size(), kHead, "runtime: short descriptor");
    std::memcpy(&theirs, b.data(), sizeof theirs);
    if (theirs != fingerprint) {
      fail("runtime: rank ", g, " has a different configuration or weight spec than rank ",
           seat_, " (layout, interval, window, policy, lag, mode, peers_per_round and tensor "
           "sizes must be the same on every rank)");
    }
    int32_t region = 0;
    int32_t backup = -1;
    std::memcpy(&region, b.data() + sizeof theirs, sizeof(int32_t));
    std::memcpy(&backup, b.data() + sizeof theirs + sizeof(int32_t), sizeof(int32_t));
    weights_.set_peer(static_cast<int>(g), static_cast<int>(g), region, backup);
    // The engine's tensors follow the staging region in the same order on every rank, so
    // their region ids are the same everywhere when the staging regions' are.
    if (engine && region != region_id) {
      fail("runtime: rank ", g, " registered its regions in another order than rank ", seat_,
           " (staging region ", region, " against ", region_id,
           "): create the transport for the Rebalancer alone, or register the same regions "
           "before connect() on every rank");
    }
    if (static_cast<int>(g) != seat_) {
      transport.import_descriptor(
          static_cast<int>(g),
          std::span<const std::byte>(b).subspan(kHead));
    }
  }
  // Step 3: one small read from every peer proves every connection now, not at the first
  // rebalance.
  weights_.probe_peers(timeout);
  comm_->barrier(timeout);
  // Step 4: the threads. From here on only the control thread calls the communicator.
  start_control_thread();
  start_worker_thread();
  lifecycle_ = Lifecycle::kConnected;
  const int64_t held = weights_.publish_bytes_held();
  metrics_->set_bytes_held(held);
  if (engine) {
    spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                 "of staging beside the engine's {} layers x {} tensors, mode {}",
                 seat_, all.size() - 1, transport.backend(), comm_->backend(), held,
                 spec_.layers, weights_.arena().tensors(), mode_name(config_.mode));
  } else {
    spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                 "({} layers + 1 staging of {} bytes), mode {}",
                 seat_, all.size() - 1, transport.backend(), comm_->backend(), held,
                 spec_.layers, weights_.arena().layer_bytes(), mode_name(config_.mode));
  }
  return held;
}

// The control thread on comm_ (connect(), reconfigure()), and the worker thread.
void Rebalancer::Impl::start_control_thread() {
  control_ = std::make_unique<ControlThread>(
      *comm_, [this] { if (delay_hook_) delay_hook_(DelayPoint::kControl); },
      make_background_thread);
}

void Rebalancer::Impl::start_worker_thread() {
  worker_.start([this](Active& job) { run_job(job); });
}

}  // namespace eplb::runtime
