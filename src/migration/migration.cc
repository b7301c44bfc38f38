#include "eplb/migration/migration.h"

#include <algorithm>
#include <limits>
#include <span>

#include "eplb/core/error.h"

namespace eplb::migration {

SourceChoice source_choice(const ScheduleOptions& schedule) {
  return schedule.half_duplex ? SourceChoice::kLowestPeakDegree : SourceChoice::kSpreadServed;
}

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
  if (!options.usable.empty() &&
      static_cast<int64_t>(options.usable.size()) != from.layers * from.physical) {
    fail("usable has ", options.usable.size(), " entries, expected layers x physical = ",
         from.layers, " x ", from.physical, " = ", from.layers * from.physical,
         " (one per slot, or none: all valid)");
  }
  if (!options.members.empty() && static_cast<int64_t>(options.members.size()) != layout.ranks) {
    fail("members has ", options.members.size(), " entries, expected ranks ", layout.ranks,
         " (one per rank, or none: all take part)");
  }
  for (size_t e = 0; e < options.backup_holders.size(); ++e) {
    for (const int32_t g : options.backup_holders[e]) {
      if (g < 0 || g >= layout.ranks) {
        fail("backup holders of expert ", e, ": rank ", g, " is outside ranks [0, ",
             layout.ranks, ")");
      }
    }
  }
  if (!options.backup_holders.empty() &&
      static_cast<int64_t>(options.backup_holders.size()) < to.experts) {
    fail("backup holders has ", options.backup_holders.size(),
         " entries, the new placement has ", to.experts,
         " experts (one entry per expert, or none: no backups)");
  }
  PlanSources sources;
  sources.members = options.members;
  sources.backup_holders = options.backup_holders;
  sources.loader = options.loader;

  MigrationPlan result;
  result.layers.reserve(static_cast<size_t>(from.layers));
  std::vector<int64_t> rank_in(static_cast<size_t>(std::max<int64_t>(layout.ranks, 0)), 0);
  std::vector<int64_t> rank_out(rank_in.size(), 0);
  MigrationTotals& t = result.totals;
  for (int64_t l = 0; l < from.layers; ++l) {
    LayerMigration layer;
    try {
      if (!options.usable.empty()) {
        sources.usable = std::span<const uint8_t>(options.usable)
                             .subspan(static_cast<size_t>(l * from.physical),
                                      static_cast<size_t>(from.physical));
      }
      layer.plan = plan_layer(from.layer_phy2log(l), to.layer_phy2log(l), layout,
                              options.expert_bytes, sources, source_choice(options.schedule));
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
    t.bytes_restored += p.bytes_restored;
    t.bytes_restored_remote += p.bytes_restored_remote;
    t.max_layer_rank_bytes_in = std::max(t.max_layer_rank_bytes_in, p.max_rank_bytes_in);
    t.max_layer_rank_bytes_out = std::max(t.max_layer_rank_bytes_out, p.max_rank_bytes_out);
    t.reads += static_cast<int64_t>(p.reads.size());
    t.rounds += layer.schedule.rounds;
    t.rounds_lower_bound += layer.schedule.lower_bound;
    t.max_layer_rounds = std::max(t.max_layer_rounds, layer.schedule.rounds);
    t.link_time += layer.schedule.link_time;
    t.link_time_lower_bound += layer.schedule.link_time_lower_bound;
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
