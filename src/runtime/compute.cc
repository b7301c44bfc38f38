// Computing a rebalance (compute.h).

#include "runtime/compute.h"

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
#include "runtime/monitor.h"

namespace eplb::runtime {
namespace {

using Clock = std::chrono::steady_clock;

Placement placement_of(std::span<const int32_t> phy2log, const Layout& layout, int64_t layers) {
  Placement p(layers, layout.experts, layout.physical);
  std::copy(phy2log.begin(), phy2log.end(), p.phy2log.begin());
  p.derive_from_phy2log();
  return p;
}

// The balancedness of `p` on `load` over the slots that serve (placement::served_metrics); 0
// when some expert has no usable member slot (the placement cannot serve every token).
double served_balancedness(const LoadMatrix& load, const Placement& p, const Layout& layout,
                           std::span<const int32_t> members, std::span<const uint8_t> usable) {
  const std::optional<placement::PlacementMetrics> m =
      placement::served_metrics(load, p, layout, members, usable);
  return m ? m->balancedness_mean : 0;
}

}  // namespace

RebalancePlan make_plan(std::span<const int64_t> window, std::span<const int32_t> current,
                        const Config& config, int64_t expert_bytes,
                        const ElasticInputs& elastic, const GainFigures& gain_figures,
                        const Placement* proposed) {
  const Layout& layout = config.layout;
  const int64_t layers = static_cast<int64_t>(current.size()) / layout.physical;
  const int64_t spr = layout.slots_per_rank();
  const auto start = Clock::now();
  RebalancePlan plan;

  // Step 1: the window's load, and the placement in force. A repair with no load recorded yet
  // (a group that lost a rank before its first window) places a uniform load.
  LoadMatrix load(layers, layout.experts);
  double total = 0;
  for (size_t i = 0; i < window.size(); ++i) {
    load.values[i] = static_cast<double>(window[i]);
    total += load.values[i];
  }
  const Placement before = placement_of(current, layout, layers);
  if (total <= 0 && (elastic.repair || proposed != nullptr)) {
    std::fill(load.values.begin(), load.values.end(), 1.0);
    total = static_cast<double>(load.values.size());
  }
  if (total <= 0) {
    plan.skipped = true;
    plan.skip_reason = "no load recorded in the window";
    return plan;
  }
  // Members as a mask over the seats, and the slots that hold valid weights now.
  std::vector<uint8_t> member(static_cast<size_t>(layout.ranks), elastic.members.empty() ? 1 : 0);
  for (const int32_t g : elastic.members) member[static_cast<size_t>(g)] = 1;
  const auto usable = [&](int64_t l, int64_t p) {
    return elastic.usable.empty() || elastic.usable[static_cast<size_t>(l * layout.physical + p)];
  };

  // Step 2: the new placement over the members' seats, and the predicted gain.
  // A repair moves as few slots as it can (sticky against what the members hold), so that lost
  // experts come back sooner; the configured policy takes over at the next interval. A
  // placement proposed from outside takes the policy's place.
  placement::PolicyOptions options = config.placement;
  if (elastic.repair) options.policy = placement::Policy::kSticky;
  options.previous = &before;
  if (static_cast<int64_t>(elastic.members.size()) < layout.ranks) {
    options.live_ranks = elastic.members;
  }
  const Placement after = proposed != nullptr ? *proposed : placement::place(load, layout, options);
  // Over the slots that serve: the members', and before the move only the usable ones.
  plan.balancedness_before =
      served_balancedness(load, before, layout, elastic.members, elastic.usable);
  plan.balancedness_after = served_balancedness(load, after, layout, elastic.members, {});
  const double gain = plan.balancedness_after - plan.balancedness_before;
  if (gain < config.min_balancedness_gain && !elastic.repair && proposed == nullptr) {
    plan.skipped = true;
    plan.skip_reason = detail::concat("predicted balancedness gain ", gain, " (",
                                      plan.balancedness_before, " -> ", plan.balancedness_after,
                                      ") is below min_balancedness_gain ",
                                      config.min_balancedness_gain);
  }

  // Step 3: plan and schedule every layer whose slots change or that has a member slot without
  // valid weights; layers with an expert no slot serves now go first.
  if (!plan.skipped) {
    migration::MigrationOptions migration_options;
    migration_options.expert_bytes = expert_bytes;
    migration_options.schedule.peers_per_round = config.peers_per_round;
    if (elastic.any()) {
      migration_options.usable = elastic.usable;
      migration_options.members = member;
      migration_options.backup_holders = elastic.backup_holders;
      migration_options.loader = elastic.loader;
    }
    migration::MigrationPlan migration = plan_migration(before, after, layout, migration_options);
    std::vector<int64_t> urgent, rest;
    for (int64_t l = 0; l < layers; ++l) {
      const auto old_row = before.layer_phy2log(l);
      const auto new_row = after.layer_phy2log(l);
      bool refill = false;
      std::vector<uint8_t> served(static_cast<size_t>(layout.experts), 0);
      for (int64_t p = 0; p < layout.physical; ++p) {
        if (!member[static_cast<size_t>(p / spr)]) continue;
        if (usable(l, p)) {
          served[static_cast<size_t>(old_row[p])] = 1;
        } else {
          refill = true;
        }
      }
      if (!refill && std::equal(old_row.begin(), old_row.end(), new_row.begin())) continue;
      const bool unavailable = std::find(served.begin(), served.end(), 0) != served.end();
      (unavailable ? urgent : rest).push_back(l);
    }
    plan.moved_layers = std::move(urgent);
    plan.moved_layers.insert(plan.moved_layers.end(), rest.begin(), rest.end());
    std::vector<uint8_t> usable_after;
    if (elastic.any()) {
      usable_after.resize(static_cast<size_t>(layout.physical));
      for (int64_t p = 0; p < layout.physical; ++p) usable_after[p] = member[p / spr];
    }
    // Step 4: does it pay (Config::min_gain, gain.h)? A repair, or a proposed placement, always
    // goes ahead.
    if (!elastic.repair && proposed == nullptr && !plan.moved_layers.empty()) {
      int64_t bytes = 0;
      for (const int64_t l : plan.moved_layers) bytes += migration.layers[l].plan.bytes_total;
      std::vector<uint8_t> serves_before, serves_after;  // [layers][physical]; empty: all
      if (elastic.any()) {
        serves_before.resize(static_cast<size_t>(layers * layout.physical));
        serves_after.resize(serves_before.size());
        for (int64_t l = 0; l < layers; ++l) {
          for (int64_t p = 0; p < layout.physical; ++p) {
            const auto i = static_cast<size_t>(l * layout.physical + p);
            serves_after[i] = member[static_cast<size_t>(p / spr)];
            serves_before[i] = serves_after[i] != 0 && usable(l, p) ? 1 : 0;
          }
        }
      }
      plan.gain = check_gain(load, before, after, serves_before, serves_after, bytes, gain_figures,
                             config);
      if (plan.gain && !plan.gain->rebalance) {
        plan.skipped = true;
        plan.skip_reason = plan.gain->reason;
        plan.moved_layers.clear();
      }
    }
    for (const int64_t l : plan.moved_layers) {
      const auto new_row = after.layer_phy2log(l);
      plan.phy2log.emplace_back(new_row.begin(), new_row.end());
      plan.tables.push_back(routing::build_dispatch_tables(after, l, layout, {}, usable_after));
      const migration::LayerPlan& lp = migration.layers[l].plan;
      plan.slots_moved += static_cast<int64_t>(lp.actions.size()) -
                          lp.count(migration::Action::kUnchanged);
      plan.bytes_intra_node += lp.bytes_intra_node;
      plan.bytes_inter_node += lp.bytes_inter_node;
      plan.bytes_local_copy += lp.bytes_local_copy;
      plan.bytes_restored += lp.bytes_restored;
      plan.rounds += migration.layers[l].schedule.rounds;
      plan.migrations.push_back(std::move(migration.layers[l]));
    }
    if (plan.moved_layers.empty() && !plan.skipped) {
      plan.skipped = true;
      plan.skip_reason = proposed != nullptr ? "the proposed placement equals the one in force"
                                             : "the new placement equals the current one";
    }
  }
  plan.placement_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return plan;
}

}  // namespace eplb::runtime
