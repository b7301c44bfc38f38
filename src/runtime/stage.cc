// Staging one layer (stage.h).

#include "runtime/stage.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "eplb/core/error.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"
#include "eplb/transport/transport.h"

namespace eplb::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// Waits for a batch by polling, so that a cancelled rebalance lets go of it quickly. Never
// through Batch::wait: a wait that times out tells a backend the caller gave up on those peers
// (UCX then closes their endpoints when the batch is destroyed), which a slice of a longer wait
// is not.
bool wait_batch(transport::Batch& batch, const StageContext& context, Clock::time_point deadline) {
  constexpr std::chrono::microseconds kPause{100};
  for (;;) {
    if (batch.poll() == transport::Progress::kDone) return true;
    if (context.cancel && context.cancel->load(std::memory_order_acquire)) return false;
    if (Clock::now() >= deadline) {
      fail<Timeout>("runtime: reads of rank ", context.weights.seat(), " did not finish within ",
                    context.weights.config().timeout.count(), " ms");
    }
    std::this_thread::sleep_for(kPause);
  }
}

// Waits for the installer's last mark in short slices, so that a cancelled rebalance (or
// shutdown) does not wait for a stalled engine stream; Timeout after the context's timeout.
bool wait_installs(const StageContext& context) {
  constexpr std::chrono::milliseconds kSlice{2};
  const std::chrono::milliseconds timeout = context.weights.config().timeout;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    try {
      context.weights.config().installer->wait_marked(kSlice);
      return true;
    } catch (const Timeout&) {
    }
    if (context.cancel && context.cancel->load(std::memory_order_acquire)) return false;
    if (Clock::now() >= deadline) {
      fail<Timeout>("runtime: the engine's work queued before the last install did not finish "
                    "within ", timeout.count(), " ms (rank ", context.weights.seat(), ")");
    }
  }
}

}  // namespace

bool stage_layer(const StageContext& context, const BufferMap& map, int64_t layer,
                 const migration::LayerMigration& migration) {
  const WeightStore& store = context.weights;
  const ArenaLayout& arena = store.arena();
  const Layout& layout = store.layout();
  const int rank = store.seat();
  const WeightStore::Regions& regions = store.regions();
  transport::Transport& transport = store.transport();
  std::byte* const base = regions.arena.data;  // the arena region's local address
  const int own = regions.arena.id;  // for local copies on device memory
  const bool on_device = store.device_memory();
  const std::chrono::milliseconds timeout = store.config().timeout;
  const auto& loader = store.config().backup.loader;
  const int64_t spr = layout.slots_per_rank();
  const int64_t first = rank * spr;
  // The engine's own tensors hold the live weights (null: the arena's layer buffers do); the
  // arena is then the staging layer alone.
  const EngineTensors* tensors = store.engine();
  // The arena's live buffer of the layer (none with the engine's tensors: live_at says where).
  const int64_t live = tensors != nullptr ? -1 : map.buffer_of_layer[layer];
  const int64_t staging = map.staging;
  const auto cancelled = [&] {
    return context.cancel && context.cancel->load(std::memory_order_acquire);
  };
  // Step 0: the engine may still read the staging buffer (the old live buffer of the last
  // install, or the source of its copy) in work queued before that install.
  if (store.config().installer && !wait_installs(context)) return false;
  const auto deadline = Clock::now() + timeout;
  // Where slot `slot` (local index) of tensor t of this layer lives on `peer`: the engine's
  // tensor (same region and stride on every rank), or the live layer buffer of the arena.
  const auto live_at = [&](int peer, int64_t t, int64_t slot) -> std::pair<int, uint64_t> {
    if (tensors != nullptr) {
      const EngineTensors::Tensor& e = tensors->of(layer, t);
      return {e.region, static_cast<uint64_t>(slot * e.stride)};
    }
    const int region = peer == rank ? own : regions.peer_region[peer];
    return {region, static_cast<uint64_t>(arena.offset(live, t, slot))};
  };
  // Local copies: memcpy on host memory; on device memory, reads of this rank's own regions,
  // gathered and done as one batch by flush_local(). From the live weights (from_live) or
  // within the staging buffer.
  std::vector<transport::Read> local_reads;
  const auto copy_slot = [&](bool from_live, int64_t src_slot, int64_t dst_slot) {
    for (int64_t t = 0; t < arena.tensors(); ++t) {
      std::byte* dst = base + arena.offset(staging, t, dst_slot);
      const auto bytes = static_cast<size_t>(arena.tensor_bytes(t));
      std::pair<int, uint64_t> src{own,
                                   static_cast<uint64_t>(arena.offset(staging, t, src_slot))};
      if (from_live) src = live_at(rank, t, src_slot);
      if (on_device) {
        local_reads.push_back({.peer = transport.rank(), .region = src.first, .offset = src.second,
                               .dst = dst, .bytes = bytes});
      } else if (from_live && tensors != nullptr) {
        std::memcpy(dst, tensors->of(layer, t).base + src.second, bytes);
      } else {
        std::memcpy(dst, base + src.second, bytes);
      }
    }
  };
  const auto flush_local = [&] {
    if (local_reads.empty()) return true;
    std::unique_ptr<transport::Batch> batch = transport.post(local_reads);
    local_reads.clear();
    return wait_batch(*batch, context, deadline);
  };
  const auto actions = migration.plan.rank_actions(rank, layout);
  const auto peer_of = [&](int seat) { return store.peer_of(seat); };

  // Step 1a: the lost experts first: restored from this rank's backup copy (memcpy), a peer's
  // (one batch of reads) or the loader, into the staging slots.
  std::vector<transport::Read> restore_reads;
  for (const migration::Restore& r : migration.plan.restores) {
    if (r.dst_rank != rank) continue;
    if (cancelled()) return false;
    for (int64_t t = 0; t < arena.tensors(); ++t) {
      std::byte* dst = base + arena.offset(staging, t, r.dst_slot - first);
      const auto bytes = static_cast<size_t>(arena.tensor_bytes(t));
      if (r.src_rank < 0) {
        EPLB_CHECK(static_cast<bool>(loader),
                   "runtime: a restore from the loader, but no Backup::loader is set");
        loader(layer, t, r.expert, std::span<std::byte>(dst, bytes));
      } else if (r.src_rank == rank) {
        std::memcpy(dst,
                    regions.backup.data + store.backup().offset(r.src_rank, layer, r.expert, t),
                    bytes);
      } else {
        restore_reads.push_back(
            {.peer = peer_of(r.src_rank),
             .region = regions.peer_backup_region[static_cast<size_t>(r.src_rank)],
             .offset = static_cast<uint64_t>(store.backup().offset(r.src_rank, layer, r.expert,
                                                                    t)),
             .dst = dst,
             .bytes = bytes});
      }
    }
  }
  if (!restore_reads.empty()) {
    if (cancelled()) return false;
    std::unique_ptr<transport::Batch> batch = transport.post(restore_reads);
    if (!wait_batch(*batch, context, deadline)) return false;
  }

  // Step 1b: what this rank already holds: unchanged slots (the arena's staging buffer becomes
  // the whole live layer; the engine's tensors keep theirs in place) and local copies.
  for (int64_t j = 0; j < spr; ++j) {
    const migration::SlotAction& a = actions[j];
    if (a.action == migration::Action::kUnchanged && tensors == nullptr) copy_slot(true, j, j);
    if (a.action == migration::Action::kLocalCopy) copy_slot(true, a.src_slot - first, j);
  }
  if (!flush_local()) return false;

  // Step 2: reads from peers' live buffers, one batch per round of the schedule.
  const auto& reads = migration.plan.reads;
  const auto& round_of_read = migration.schedule.round_of_read;
  std::vector<transport::Read> batch_reads;
  for (int64_t round = 0; round < migration.schedule.rounds; ++round) {
    batch_reads.clear();
    for (size_t i = 0; i < reads.size(); ++i) {
      const migration::RemoteRead& r = reads[i];
      if (r.dst_rank != rank || round_of_read[i] != round) continue;
      const int64_t src_local = r.src_slot - static_cast<int64_t>(r.src_rank) * spr;
      for (int64_t t = 0; t < arena.tensors(); ++t) {
        transport::Read read;
        read.peer = peer_of(r.src_rank);
        std::tie(read.region, read.offset) = live_at(r.src_rank, t, src_local);
        read.dst = base + arena.offset(staging, t, r.dst_slot - first);
        read.bytes = static_cast<size_t>(arena.tensor_bytes(t));
        batch_reads.push_back(read);
      }
    }
    if (batch_reads.empty()) continue;
    if (cancelled()) return false;
    if (context.progress != nullptr) {
      std::vector<int> peers;
      for (size_t i = 0; i < reads.size(); ++i) {  // seats, as the watchdog names ranks
        if (reads[i].dst_rank == rank && round_of_read[i] == round) {
          peers.push_back(reads[i].src_rank);
        }
      }
      std::sort(peers.begin(), peers.end());
      peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
      context.progress->note(context.rebalance, Phase::kReading, layer, std::move(peers));
    }
    if (context.delay_hook && *context.delay_hook) (*context.delay_hook)(DelayPoint::kRead);
    std::unique_ptr<transport::Batch> batch = transport.post(batch_reads);
    if (!wait_batch(*batch, context, deadline)) return false;
    if (context.progress != nullptr) context.progress->touch(context.rebalance);
  }

  // Step 3: free rides, in slot order, from slots read above.
  for (int64_t j = 0; j < spr; ++j) {
    const migration::SlotAction& a = actions[j];
    if (a.action == migration::Action::kFreeRide) copy_slot(false, a.src_slot - first, j);
  }
  if (!flush_local()) return false;
  return !cancelled();
}

}  // namespace eplb::runtime
