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
#include "runtime/arena.h"
#include "runtime/monitor.h"

namespace eplb::transport {
class Transport;
}

namespace eplb::runtime {

struct RebalancePlan {
  bool skipped = false;
  std::string skip_reason;
  std::vector<int64_t> moved_layers;                  // ascending: the install order
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
};

// window: summed loads of all ranks [layers][experts]; current: phy2log in force [layers][physical].
RebalancePlan make_plan(std::span<const int64_t> window, std::span<const int32_t> current,
                        const Config& config, int64_t expert_bytes);

struct StageContext {
  transport::Transport* transport = nullptr;
  const ArenaLayout* arena = nullptr;
  std::byte* base = nullptr;  // the arena region's local address
  const std::vector<int>* peer_region = nullptr;  // [ranks] the arena's region id on each rank
  const Layout* layout = nullptr;
  int rank = 0;
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
// reads of this rank's own region (the transport's copy engine) on device memory. Nothing live changes on any rank. Returns false
// when cancelled (the spare buffer is then garbage); throws on a failed or late read.
bool stage_layer(const StageContext& context, const BufferMap& map, int64_t layer,
                 const migration::LayerMigration& migration);

}  // namespace eplb::runtime
