#pragma once
// Computing a rebalance, the half that sync and async modes share before any byte moves: the
// placement, the migration plan and its schedule, and the new tables, from the window's summed
// loads. Pure and identical on every rank for the same window. Called on the worker thread
// (the forward thread in sync mode).

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eplb/migration/migration.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/config.h"
#include "eplb/placement/gain.h"
#include "runtime/gain.h"

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
  // Config::min_gain's check, where it was made (min_gain > 0, not a repair, slots to move); a
  // plan it skips keeps its figures and moves nothing.
  std::optional<placement::GainDecision> gain;
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

// window: summed loads of all ranks [layers][experts]; current: phy2log in force [layers][physical];
// gain: what the window all-reduce's tail says for Config::min_gain's check (gain.h).
// proposed: a placement computed elsewhere (Rebalancer::propose), planned instead of placing
// with the configured policy; it is never skipped for either gain check (the engine's policy
// decided).
RebalancePlan make_plan(std::span<const int64_t> window, std::span<const int32_t> current,
                        const Config& config, int64_t expert_bytes,
                        const ElasticInputs& elastic = {}, const GainFigures& gain = {},
                        const Placement* proposed = nullptr);

}  // namespace eplb::runtime
