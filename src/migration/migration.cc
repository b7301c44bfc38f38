#include "eplb/migration/migration.h"

#include <algorithm>
#include <limits>

#include "eplb/core/error.h"

namespace eplb::migration {

MigrationPlan plan_migration(const Placement& from, const Placement& to, const Layout& layout,
                             const MigrationOptions& options) {
  if (from.layers != to.layers) {
    fail("old placement has ", from.layers, " layers and new placement ", to.layers,
         " (both must describe the same model)");
  }
  if (from.physical != to.physical) {
    fail("old placement has ", from.physical, " physical slots per layer and new placement ",
         to.physical, " (both must describe the same deployment)");
  }
  if (from.physical != layout.physical) {
    fail("placements have ", from.physical, " physical slots per layer, layout has ",
         layout.physical);
  }
  if (options.expert_bytes <= 0) {
    fail("expert bytes ", options.expert_bytes, " must be at least 1");
  }
  // Every byte count of the plan is at most every slot of every layer moved: bounded so, no
  // sum of them can overflow.
  if (from.layers > 0 && from.physical > 0 &&
      options.expert_bytes > std::numeric_limits<int64_t>::max() / from.layers / from.physical) {
    fail("expert bytes ", options.expert_bytes, " x ", from.physical, " slots x ", from.layers,
         " layers does not fit a 64-bit byte count (at most ",
         std::numeric_limits<int64_t>::max() / from.layers / from.physical,
         " bytes per expert for this shape)");
  }
  if (options.schedule.peers_per_round < 1) {
    fail("peers per round ", options.schedule.peers_per_round, " must be at least 1");
  }

  MigrationPlan result;
  result.layers.reserve(static_cast<size_t>(from.layers));
  std::vector<int64_t> rank_in(static_cast<size_t>(std::max<int64_t>(layout.ranks, 0)), 0);
  std::vector<int64_t> rank_out(rank_in.size(), 0);
  MigrationTotals& t = result.totals;
  for (int64_t l = 0; l < from.layers; ++l) {
    LayerMigration layer;
    try {
      layer.plan =
          plan_layer(from.layer_phy2log(l), to.layer_phy2log(l), layout, options.expert_bytes);
    } catch (const InvalidArgument& e) {
      fail("layer ", l, ": ", e.what());
    }
    layer.schedule = schedule_reads(layer.plan.reads, layout.ranks, options.schedule);

    const LayerPlan& p = layer.plan;
    for (int a = 0; a < kNumActions; ++a) t.slots[a] += p.slots[a];
    t.bytes_total += p.bytes_total;
    t.bytes_intra_node += p.bytes_intra_node;
    t.bytes_inter_node += p.bytes_inter_node;
    t.bytes_local_copy += p.bytes_local_copy;
    t.max_layer_rank_bytes_in = std::max(t.max_layer_rank_bytes_in, p.max_rank_bytes_in);
    t.max_layer_rank_bytes_out = std::max(t.max_layer_rank_bytes_out, p.max_rank_bytes_out);
    t.reads += static_cast<int64_t>(p.reads.size());
    t.rounds += layer.schedule.rounds;
    t.rounds_lower_bound += layer.schedule.lower_bound;
    t.max_layer_rounds = std::max(t.max_layer_rounds, layer.schedule.rounds);
    t.staging_slots = std::max(t.staging_slots, p.staging_slots);
    for (size_t g = 0; g < rank_in.size(); ++g) {
      rank_in[g] += p.rank_bytes_in[g];
      rank_out[g] += p.rank_bytes_out[g];
    }
    result.layers.push_back(std::move(layer));
  }
  if (!rank_in.empty()) {
    t.max_rank_bytes_in = *std::max_element(rank_in.begin(), rank_in.end());
    t.max_rank_bytes_out = *std::max_element(rank_out.begin(), rank_out.end());
  }
  return result;
}

}  // namespace eplb::migration
