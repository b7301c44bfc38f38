#pragma once
// A whole rebalance: the plan and the schedule of every layer, computed once, up front, from
// the old and new placements. This is the entry the runtime, the CLI (`eplb migrate-plan`) and
// `eplb plan --previous` use. Pure and deterministic: every rank computes the same result.

#include <array>
#include <cstdint>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/migration/planner.h"
#include "eplb/migration/scheduler.h"

namespace eplb::migration {

struct MigrationOptions {
  int64_t expert_bytes = 0;  // bytes of one expert's weights in one layer, >= 1
  ScheduleOptions schedule;

  // Elastic serving (planner.h's PlanSources, for every layer); all empty: a plain rebalance.
  // Slots whose weights are valid now, [layers][physical] flattened (nonzero: valid); empty:
  // all. Only a valid slot is a source (local copy, read) or stays kUnchanged.
  std::vector<uint8_t> usable{};
  // Ranks that take part, [ranks] (nonzero); empty: all. A rank that does not gets no action
  // (its slots are kUnchanged whatever the new placement says, and it is never a source).
  std::vector<uint8_t> members{};
  // Backup copies: for each expert (the same in every layer), the ranks that hold a host copy
  // of it and are members (a rank that is not is never used); empty: no copies. And whether
  // every member can load any expert itself (a loader callback).
  std::vector<std::vector<int32_t>> backup_holders{};  // [experts]
  bool loader = false;
};

struct LayerMigration {
  LayerPlan plan;
  Schedule schedule;
};

// Sums over the layers. The per-rank maxima are of the rank's bytes summed over all layers;
// max_layer_* are the largest per-layer figures (what bounds one layer's transfer time).
struct MigrationTotals {
  std::array<int64_t, kNumActions> slots{};  // by Action
  int64_t bytes_total = 0;
  int64_t bytes_intra_node = 0;
  int64_t bytes_inter_node = 0;
  int64_t bytes_local_copy = 0;
  int64_t bytes_restored = 0;         // all restores (not in bytes_total nor the rank maxima)
  int64_t bytes_restored_remote = 0;  // restores from another rank's host copy
  int64_t max_rank_bytes_in = 0;
  int64_t max_rank_bytes_out = 0;
  int64_t max_layer_rank_bytes_in = 0;
  int64_t max_layer_rank_bytes_out = 0;
  int64_t reads = 0;
  int64_t rounds = 0;              // sum over layers
  int64_t rounds_lower_bound = 0;  // sum over layers
  int64_t max_layer_rounds = 0;
  int64_t link_time = 0;              // sum over layers (Schedule::link_time)
  int64_t link_time_lower_bound = 0;  // sum over layers
  int64_t staging_slots = 0;  // the most staged slots of one rank in one layer

  int64_t count(Action action) const { return slots[static_cast<size_t>(action)]; }
};

struct MigrationPlan {
  std::vector<LayerMigration> layers;  // [layers]
  MigrationTotals totals;
};

// The planner's rule for the holder of each read under these links: kLowestPeakDegree in half
// duplex (a rank's reads in and out share its link, so the busiest rank's reads in plus out
// bound the schedule), kSpreadServed otherwise.
SourceChoice source_choice(const ScheduleOptions& schedule);

// Plans and schedules every layer of from -> to, the sources of reads chosen by
// source_choice(options.schedule). Both placements must have the same layers
// and physical slots as each other and as the layout (whose ranks and nodes are used; their
// expert counts may differ). Throws InvalidArgument naming the mismatch or bad option, or
// "layer L: expert E has no replica on a live rank and no backup (...)" when a member slot
// needs an expert that nothing can provide. Restores (LayerPlan::restores) are not scheduled:
// Schedule covers the reads alone.
MigrationPlan plan_migration(const Placement& from, const Placement& to, const Layout& layout,
                             const MigrationOptions& options);

}  // namespace eplb::migration
