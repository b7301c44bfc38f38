#pragma once
// Staging one layer on this rank, the other half sync and async modes share: local copies and
// one-sided reads of peers' live weights into the staging buffer, before the layer is
// installed. Called on the worker thread (the forward thread in sync mode).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "eplb/migration/migration.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/rebalancer.h"
#include "runtime/testing.h"
#include "runtime/arena.h"
#include "runtime/backup.h"
#include "runtime/monitor.h"

namespace eplb::transport {
class Transport;
}

namespace eplb::runtime {

struct StageContext {
  transport::Transport* transport = nullptr;
  const ArenaLayout* arena = nullptr;
  std::byte* base = nullptr;  // the arena region's local address
  const std::vector<int>* peer_region = nullptr;  // [ranks] the arena's region id on each seat
  const std::vector<int>* peer_of_seat = nullptr;  // [ranks] each seat's transport rank
  const Layout* layout = nullptr;
  int rank = 0;       // this rank's seat
  int self_peer = 0;  // this rank in the transport
  // Restores: this rank's backup copy (its local address), the layout of every seat's copy,
  // each seat's backup region id, and the loader (null or empty: none).
  std::byte* backup_base = nullptr;
  const BackupLayout* backup = nullptr;
  const std::vector<int>* peer_backup_region = nullptr;
  const std::function<void(int64_t, int64_t, int32_t, std::span<std::byte>)>* loader = nullptr;
  std::chrono::milliseconds timeout{0};
  const std::function<void(DelayPoint)>* delay_hook = nullptr;
  const std::atomic<bool>* cancel = nullptr;  // null: never cancelled
  Installer* installer = nullptr;  // null: nothing queued reads the staging buffer
  bool device_memory = false;      // the arena is device memory: copies go through transport
  int own_region = 0;              // this rank's arena region (for local copies)
  // The engine's own tensors hold the live weights (null: the arena's layer buffers do); the
  // arena is then the staging layer alone.
  const EngineTensors* engine = nullptr;
  PhaseTracker* progress = nullptr;  // told of each round of reads (null: nobody watches)
  int64_t rebalance = 0;         // the index the progress is told of
};

// Builds layer `layer`'s new content for this rank in the staging buffer of `map`: unchanged
// slots (arena only: with the engine's tensors they stay where they are) and local copies from
// the live weights, reads from peers' live weights round by round, then free rides within the
// staging buffer. First waits for the installer's last mark, so
// nothing the engine may still read is overwritten. Local copies are memcpy on host memory and
// reads of this rank's own region (the transport's copy engine) on device memory. Restores of
// lost experts (a backup copy, read or copied, or the loader) come first of all. Nothing live
// changes on any rank. Returns false
// when cancelled (the staging buffer is then garbage); throws on a failed or late read.
bool stage_layer(const StageContext& context, const BufferMap& map, int64_t layer,
                 const migration::LayerMigration& migration);

// The bytes seat `seat` reads from peers in `migration` (its remote reads; restores apart).
inline int64_t bytes_read_by(const migration::LayerMigration& migration, int seat) {
  const std::vector<int64_t>& in = migration.plan.rank_bytes_in;
  return seat >= 0 && static_cast<size_t>(seat) < in.size() ? in[static_cast<size_t>(seat)] : 0;
}

}  // namespace eplb::runtime
