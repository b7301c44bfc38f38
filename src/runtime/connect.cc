// Rebalancer::Impl's start-up: connect() (the first agreement, the regions, the threads), the
// engine's tensors registered with the transport, and the checks made before any of it. The
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
void Rebalancer::Impl::check_engine_slots_apart() const {
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

int64_t Rebalancer::Impl::connect() {
  EPLB_CHECK(!joining_, "a joining Rebalancer enters through reconfigure(), not connect()");
  EPLB_CHECK(!connected_, "connect() was already called");
  const std::chrono::milliseconds timeout = config_.timeout;
  if (transport_->capabilities().device_memory && !config_.installer) {
    fail("the ", transport_->backend(), " transport keeps the weights in device memory: set "
         "Config::installer (eplb::cuda::StreamInstaller on the engine's stream) so that "
         "installs are ordered with the engine's queued work");
  }
  // Step 1: the arena, staging included, as one region; or the staging layer alone and the
  // engine's tensors registered, one region each; then the backup copy.
  const bool engine = spec_.engine_weights();
  allocate_regions();
  // Step 2: exchange (fingerprint, region id, descriptor) with every peer.
  const std::vector<std::byte> descriptor = transport_->export_descriptor();
  const uint64_t fingerprint = config_fingerprint(config_, spec_);
  constexpr size_t kHead = sizeof(uint64_t) + 2 * sizeof(int32_t);
  std::vector<std::byte> mine(kHead + descriptor.size());
  const int32_t region_id = region_.id;
  const int32_t backup_id = backup_region_.bytes > 0 ? backup_region_.id : -1;
  std::memcpy(mine.data(), &fingerprint, sizeof fingerprint);
  std::memcpy(mine.data() + sizeof fingerprint, &region_id, sizeof region_id);
  std::memcpy(mine.data() + sizeof fingerprint + sizeof region_id, &backup_id, sizeof backup_id);
  std::memcpy(mine.data() + kHead, descriptor.data(), descriptor.size());
  const std::vector<control::Bytes> all = comm_->all_gather(mine, timeout);
  peer_region_.assign(all.size(), 0);
  peer_backup_region_.assign(all.size(), -1);
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
    std::memcpy(&peer_region_[g], b.data() + sizeof theirs, sizeof(int32_t));
    std::memcpy(&peer_backup_region_[g], b.data() + sizeof theirs + sizeof(int32_t),
                sizeof(int32_t));
    // The engine's tensors follow the staging region in the same order on every rank, so
    // their region ids are the same everywhere when the staging regions' are.
    if (engine && peer_region_[g] != region_id) {
      fail("runtime: rank ", g, " registered its regions in another order than rank ", seat_,
           " (staging region ", peer_region_[g], " against ", region_id,
           "): create the transport for the Rebalancer alone, or register the same regions "
           "before connect() on every rank");
    }
    if (static_cast<int>(g) != seat_) {
      transport_->import_descriptor(
          static_cast<int>(g),
          std::span<const std::byte>(b).subspan(kHead));
    }
  }
  // Step 3: one small read from every peer proves every connection now, not at the first
  // rebalance.
  constexpr size_t kProbe = 8;
  std::vector<std::byte> probe(kProbe * all.size());
  std::vector<transport::Read> reads;
  for (int g = 0; g < static_cast<int>(all.size()); ++g) {
    if (g == seat_) continue;
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
    std::unique_ptr<transport::Batch> batch = transport_->post(reads);
    batch->wait(timeout);
  }
  comm_->barrier(timeout);
  // Step 4: the threads. From here on only the control thread calls the communicator.
  start_control_thread();
  start_worker_thread();
  connected_ = true;
  bytes_held_.store(static_cast<int64_t>(region_.bytes), std::memory_order_release);
  metrics_->set_bytes_held(static_cast<int64_t>(region_.bytes));
  if (engine) {
    spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                 "of staging beside the engine's {} layers x {} tensors, mode {}",
                 seat_, all.size() - 1, transport_->backend(), comm_->backend(), region_.bytes,
                 layers_, arena_.tensors(), mode_name(config_.mode));
  } else {
    spdlog::info("eplb runtime rank {}: connected to {} peers over {} ({}), holding {} bytes "
                 "({} layers + 1 staging of {} bytes), mode {}",
                 seat_, all.size() - 1, transport_->backend(), comm_->backend(), region_.bytes,
                 layers_, arena_.layer_bytes(), mode_name(config_.mode));
  }
  return static_cast<int64_t>(region_.bytes);
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

// Allocates the arena or staging, registers the engine's tensors and allocates the backup, in
// that order (the same region ids on every rank), in transport_.
void Rebalancer::Impl::allocate_regions() {
  const bool engine = spec_.engine_weights();
  const bool device = transport_->capabilities().device_memory;
  if (device && (config_.backup.copies > 0 || config_.backup.loader)) {
    fail<NotSupported>("Config::backup: the ", transport_->backend(), " transport keeps the "
                       "weights in device memory, and the backup copies and loader are host "
                       "memory only; use a host transport or no backup");
  }
  region_ = transport_->allocate(
      static_cast<size_t>(engine ? arena_.layer_bytes() : arena_.total_bytes()));
  if (engine) register_engine_tensors();
  const int64_t backup_bytes = backup_.bytes(seat_);
  backup_region_ = backup_bytes > 0 ? transport_->allocate(static_cast<size_t>(backup_bytes))
                                    : transport::Region{};
}

// The engine's tensors, one transport region each, right after the staging region.
void Rebalancer::Impl::register_engine_tensors() {
  if (!transport_->capabilities().register_memory) {
    fail<NotSupported>("the ", transport_->backend(), " transport cannot serve reads from "
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
      const transport::Region r = transport_->register_memory(m.base, static_cast<size_t>(bytes));
      EPLB_CHECK_EQ(r.id, region_.id + 1 + static_cast<int>(engine_.at.size()),
                    "the engine's regions follow the staging region");
      engine_.at.push_back({r.id, static_cast<std::byte*>(m.base), stride});
    }
  }
}

}  // namespace eplb::runtime
