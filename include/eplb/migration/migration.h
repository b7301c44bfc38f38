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
  int64_t max_rank_bytes_in = 0;
  int64_t max_rank_bytes_out = 0;
  int64_t max_layer_rank_bytes_in = 0;
  int64_t max_layer_rank_bytes_out = 0;
  int64_t reads = 0;
  int64_t rounds = 0;              // sum over layers
  int64_t rounds_lower_bound = 0;  // sum over layers
  int64_t max_layer_rounds = 0;
  int64_t staging_slots = 0;  // the most staged slots of one rank in one layer

  int64_t count(Action action) const { return slots[static_cast<size_t>(action)]; }
};

struct MigrationPlan {
  std::vector<LayerMigration> layers;  // [layers]
  MigrationTotals totals;
};

// Plans and schedules every layer of from -> to. Both placements must have the same layers
// and physical slots as each other and as the layout (whose ranks and nodes are used; their
// expert counts may differ). Throws InvalidArgument naming the mismatch or bad option.
MigrationPlan plan_migration(const Placement& from, const Placement& to, const Layout& layout,
                             const MigrationOptions& options);

}  // namespace eplb::migration
