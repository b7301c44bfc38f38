#pragma once
// The two halves of a rebalance that sync and async modes share: computing it (placement,
// plan, schedule, tables: pure, identical on every rank for the same window) and staging one
// layer on this rank (local copies and one-sided reads into the spare buffer).

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

// What a plan needs to know beyond the window after a reconfigure (elastic serving): who is in
// the group, which slots hold valid weights, where the backup copies are.
struct ElasticInputs {
  std::vector<int32_t> members;  // seats of the group, ascending; empty: every rank
  std::vector<uint8_t> usable;   // [layers][physical] nonzero: valid weights; empty: all
  std::vector<std::vector<int32_t>> backup_holders;  // [experts] members with a filled copy
  bool loader = false;           // every member can load an expert itself
  bool repair = false;           // fill lost slots: no min_gain, a uniform load if none

  bool any() const { return !members.empty() || !usable.empty(); }
};

struct RebalancePlan {
  bool skipped = false;
  std::string skip_reason;
  // The install order: layers with an unavailable expert first, then ascending.
  std::vector<int64_t> moved_layers;
  std::vector<migration::LayerMigration> migrations;  // [moved]
  std::vector<std::vector<int32_t>> phy2log;          // [moved][physical]
  std::vector<routing::DispatchTables> tables;        // [moved]
  // Figures for the record.
  double placement_ms = 0;
  double balancedness_before = 0;
  double balancedness_after = 0;
  int64_t slots_moved = 0;
  int64_t bytes_intra_node = 0;
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;
  int64_t rounds = 0;
  int64_t bytes_restored = 0;  // all ranks
};

// window: summed loads of all ranks [layers][experts]; current: phy2log in force [layers][physical].
RebalancePlan make_plan(std::span<const int64_t> window, std::span<const int32_t> current,
                        const Config& config, int64_t expert_bytes,
                        const ElasticInputs& elastic = {});

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
  Progress* progress = nullptr;  // told of each round of reads (null: nobody watches)
  int64_t rebalance = 0;         // the index the progress is told of
};

// Builds layer `layer`'s new content for this rank in the spare buffer of `map`: unchanged
// slots (arena only: with the engine's tensors they stay where they are) and local copies from
// the live weights, reads from peers' live weights round by round, then free rides within the
// spare buffer. First waits for the installer's last mark, so
// nothing the engine may still read is overwritten. Local copies are memcpy on host memory and
// reads of this rank's own region (the transport's copy engine) on device memory. Restores of
// lost experts (a backup copy, read or copied, or the loader) come first of all. Nothing live
// changes on any rank. Returns false
// when cancelled (the spare buffer is then garbage); throws on a failed or late read.
bool stage_layer(const StageContext& context, const BufferMap& map, int64_t layer,
                 const migration::LayerMigration& migration);

}  // namespace eplb::runtime
