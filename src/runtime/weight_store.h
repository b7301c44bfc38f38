#pragma once
// The weight store: where this rank's expert weights live, and where every peer's can be read.
// It holds the arena (layers + 1 layer buffers in one transport region, arena.h; or the staging
// layer alone beside the engine's own tensors, registered one region each), the buffer map
// (which buffer holds which layer), this rank's share of the backup copies (backup.h) and
// whether it was filled, and for every seat its transport rank and region ids. Staging
// (stage.h) reads peers' weights through it; an install makes a staged layer live through it.
//
// Threads. The forward thread owns the store and is the only one that writes it: allocate(),
// clear_peers()/set_peer() and restore() at connect() and reconfigure() (no rebalance in
// flight, the worker idle, no control thread running), install() inside step_end(), and
// fill_backup(). The worker reads the regions, the peers and the backup tables while it stages
// a layer, never the buffer map (it stages against its own copy, in_flight.h): none of what it
// reads changes while a rebalance is in flight. bytes_held() and backup_filled() are atomic:
// any thread.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "eplb/migration/migration.h"
#include "eplb/runtime/config.h"
#include "eplb/transport/transport.h"
#include "runtime/arena.h"
#include "runtime/backup.h"

namespace eplb::runtime {

class WeightStore {
 public:
  // Where the regions are: one transport's, with every seat's ids. A value, so that
  // reconfigure() can put back the old ones when the new group's exchange fails.
  struct Regions {
    transport::Transport* transport = nullptr;
    transport::Region arena;              // the arena, or the staging layer alone
    transport::Region backup;             // this rank's share of the copies (none: bytes 0)
    EngineTensors engine;                 // the engine's tensors as registered (else empty)
    std::vector<int> peer_region;         // [ranks] the arena's region id on each seat
    std::vector<int> peer_backup_region;  // [ranks] each seat's backup region id, -1: unusable
    std::vector<int> peer_of_seat;        // [ranks] each seat's transport rank, -1: no member
  };

  // `config` and `spec` must outlive the store (Rebalancer::Impl owns all three). Every seat a
  // member at its own transport rank in `transport` (null: a joining rank, none yet); nothing
  // allocated yet. InvalidArgument when two slots of the engine's tensors overlap.
  WeightStore(const Config& config, const WeightSpec& spec, int seat,
              transport::Transport* transport);

  // ---- Regions (forward thread, while nothing else runs).
  // Allocates in `transport`, in this order on every rank (so the region ids agree): the arena
  // (or the staging layer, then the engine's tensors, registered), then the backup share.
  // Replaces the regions in use; restore() puts back what regions() returned before.
  void allocate(transport::Transport& transport);
  const Regions& regions() const { return regions_; }
  void restore(Regions regions) { regions_ = std::move(regions); }
  // Publishes the bytes held (the arena or the staging layer) once connect() or reconfigure()
  // succeeded, and returns them.
  int64_t publish_bytes_held();
  // Every seat: no member, no region.
  void clear_peers();
  void set_peer(int seat, int peer, int region, int backup_region);
  // One small read from every other member proves each connection now, not at the first
  // rebalance: from the arena's last buffer (never written by reconfigure's moves) or the
  // first engine tensor. Throws on a failed or late read.
  void probe_peers(std::chrono::milliseconds timeout) const;
  // After allocate() in a new transport: the live layers of `old` copied into the new arena,
  // in layer order (the buffer map the identity again), after the engine's queued work that
  // may still write them; then the backup share, when its size did not change.
  void move_from(const Regions& old);

  // ---- Weights (forward thread; the spans stay valid until the next install or reconfigure).
  bool allocated() const { return regions_.transport != nullptr && regions_.arena.bytes > 0; }
  // [slots_per_rank][expert_bytes of the tensor] (the engine's stride between slots).
  std::span<std::byte> weights(int64_t layer, int64_t tensor) const;
  std::span<std::byte> slot_weights(int64_t layer, int64_t tensor, int64_t slot) const;
  // Makes the staged layer `layer` (migration `migration` of the plan) live: a buffer swap, a
  // copy of the layer, or the changed slots into the engine's tensors; then the installer's
  // mark. Returns the bytes copied. An installer that fails stops the process (weight_store.cc).
  int64_t install(const migration::LayerMigration& migration, int64_t layer);
  // Installs swap buffers (the arena and Install::kSwap): the buffer map changes.
  bool swaps() const { return !spec_.engine_weights() && config_.install == Install::kSwap; }
  const BufferMap& map() const { return map_; }

  // ---- Backup copies.
  std::vector<int32_t> backup_experts() const;
  std::span<std::byte> backup_weights(int64_t layer, int64_t tensor, int32_t expert) const;
  int64_t backup_bytes() const { return static_cast<int64_t>(regions_.backup.bytes); }
  void fill_backup(
      const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>& fill);
  bool backup_filled() const { return backup_filled_.load(std::memory_order_acquire); }
  // [experts] the members whose filled copy a restore may read.
  std::vector<std::vector<int32_t>> backup_holders() const;

  // ---- For staging (stage.h) and the rest of the runtime.
  const Config& config() const { return config_; }
  const Layout& layout() const { return config_.layout; }
  const ArenaLayout& arena() const { return arena_; }
  const BackupLayout& backup() const { return backup_; }
  int seat() const { return seat_; }
  transport::Transport& transport() const { return *regions_.transport; }
  bool device_memory() const;
  // The engine's tensors hold the live weights (null: the arena's layer buffers do).
  const EngineTensors* engine() const {
    return spec_.engine_weights() ? &regions_.engine : nullptr;
  }
  int peer_of(int seat) const { return regions_.peer_of_seat[static_cast<size_t>(seat)]; }
  bool member(int seat) const { return peer_of(seat) >= 0; }
  int64_t bytes_held() const { return bytes_held_.load(std::memory_order_acquire); }

 private:
  void check_engine_slots_apart() const;
  void register_engine_tensors();
  template <typename F>
  void installer_or_stop(F&& call, int64_t layer) const;

  const Config& config_;
  const WeightSpec& spec_;
  const int seat_;
  const ArenaLayout arena_;
  const BackupLayout backup_;
  Regions regions_;
  BufferMap map_;
  std::atomic<bool> backup_filled_{false};
  std::atomic<int64_t> bytes_held_{0};
};

}  // namespace eplb::runtime
