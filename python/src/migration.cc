// Bindings of the migration layer: plan_migration() of every layer, as numpy arrays and dicts.

#include "eplb/migration/migration.h"

#include <algorithm>
#include <string>
#include <vector>

#include "bindings.h"
#include "eplb/core/error.h"

namespace eplb::python {
namespace {

// The migration layer does not need the expert count: take the largest expert held, plus one.
Placement to_any_placement(const IndexArray& phy2log, const std::string& what) {
  const int64_t* data = phy2log.data();
  const int64_t most = phy2log.size() > 0 ? *std::max_element(data, data + phy2log.size()) : 0;
  if (most >= kMaxExperts) {
    fail(what, " holds expert ", most, ", outside [0, ", kMaxExperts,
         ") (eplb supports at most ", kMaxExperts, " experts per layer)");
  }
  return to_placement(phy2log, std::max<int64_t>(most + 1, 1), what, false);
}

py::array_t<int64_t> int64s(const std::vector<int64_t>& v) {
  return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
}

py::dict slot_counts(const std::array<int64_t, migration::kNumActions>& slots) {
  py::dict out;
  for (int a = 0; a < migration::kNumActions; ++a) {
    out[py::str(std::string(migration::action_name(static_cast<migration::Action>(a))))] =
        slots[static_cast<size_t>(a)];
  }
  return out;
}

py::dict layer_dict(const migration::LayerMigration& layer) {
  const migration::LayerPlan& plan = layer.plan;
  const auto physical = static_cast<py::ssize_t>(plan.actions.size());
  py::array_t<uint8_t> action(physical);
  py::array_t<int64_t> expert(physical), src_rank(physical), src_slot(physical);
  for (py::ssize_t p = 0; p < physical; ++p) {
    const migration::SlotAction& a = plan.actions[static_cast<size_t>(p)];
    action.mutable_at(p) = static_cast<uint8_t>(a.action);
    expert.mutable_at(p) = a.expert;
    src_rank.mutable_at(p) = a.src_rank;
    src_slot.mutable_at(p) = a.src_slot;
  }
  const auto n = static_cast<py::ssize_t>(plan.reads.size());
  py::array_t<int64_t> r_src_rank(n), r_src_slot(n), r_dst_rank(n), r_dst_slot(n), r_expert(n),
      r_round(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    const migration::RemoteRead& r = plan.reads[static_cast<size_t>(i)];
    r_src_rank.mutable_at(i) = r.src_rank;
    r_src_slot.mutable_at(i) = r.src_slot;
    r_dst_rank.mutable_at(i) = r.dst_rank;
    r_dst_slot.mutable_at(i) = r.dst_slot;
    r_expert.mutable_at(i) = r.expert;
    r_round.mutable_at(i) = layer.schedule.round_of_read[static_cast<size_t>(i)];
  }
  py::dict reads;
  reads["src_rank"] = r_src_rank;
  reads["src_slot"] = r_src_slot;
  reads["dst_rank"] = r_dst_rank;
  reads["dst_slot"] = r_dst_slot;
  reads["expert"] = r_expert;
  reads["round"] = r_round;

  py::dict out;
  out["action"] = action;
  out["expert"] = expert;
  out["src_rank"] = src_rank;
  out["src_slot"] = src_slot;
  out["reads"] = reads;
  out["slots"] = slot_counts(plan.slots);
  out["rank_bytes_in"] = int64s(plan.rank_bytes_in);
  out["rank_bytes_out"] = int64s(plan.rank_bytes_out);
  out["bytes_total"] = plan.bytes_total;
  out["bytes_intra_node"] = plan.bytes_intra_node;
  out["bytes_inter_node"] = plan.bytes_inter_node;
  out["bytes_local_copy"] = plan.bytes_local_copy;
  out["max_rank_bytes_in"] = plan.max_rank_bytes_in;
  out["max_rank_bytes_out"] = plan.max_rank_bytes_out;
  out["staging_slots"] = plan.staging_slots;
  out["rounds"] = layer.schedule.rounds;
  out["rounds_lower_bound"] = layer.schedule.lower_bound;
  out["max_peers"] = layer.schedule.max_peers;
  out["link_time"] = layer.schedule.link_time;
  out["link_time_lower_bound"] = layer.schedule.link_time_lower_bound;
  return out;
}

py::dict totals_dict(const migration::MigrationTotals& t) {
  py::dict out;
  out["slots"] = slot_counts(t.slots);
  out["bytes_total"] = t.bytes_total;
  out["bytes_intra_node"] = t.bytes_intra_node;
  out["bytes_inter_node"] = t.bytes_inter_node;
  out["bytes_local_copy"] = t.bytes_local_copy;
  out["max_rank_bytes_in"] = t.max_rank_bytes_in;
  out["max_rank_bytes_out"] = t.max_rank_bytes_out;
  out["max_layer_rank_bytes_in"] = t.max_layer_rank_bytes_in;
  out["max_layer_rank_bytes_out"] = t.max_layer_rank_bytes_out;
  out["reads"] = t.reads;
  out["rounds"] = t.rounds;
  out["rounds_lower_bound"] = t.rounds_lower_bound;
  out["max_layer_rounds"] = t.max_layer_rounds;
  out["link_time"] = t.link_time;
  out["link_time_lower_bound"] = t.link_time_lower_bound;
  out["staging_slots"] = t.staging_slots;
  return out;
}

// -> {"layers": [per-layer dict], "totals": dict}.
py::dict plan_migration(const IndexArray& old_phy2log, const IndexArray& new_phy2log, int64_t ranks,
                        int64_t nodes, int64_t expert_bytes, int64_t peers_per_round,
                        bool half_duplex) {
  const Placement from = to_any_placement(old_phy2log, "old_phy2log");
  const Placement to = to_any_placement(new_phy2log, "new_phy2log");
  // The planner uses the layout's physical slots, ranks and nodes only.
  const Layout layout{
      .experts = 1, .physical = from.physical, .ranks = ranks, .nodes = nodes, .groups = 1};
  migration::MigrationOptions options;
  options.expert_bytes = expert_bytes;
  options.schedule.peers_per_round = peers_per_round;
  options.schedule.half_duplex = half_duplex;
  migration::MigrationPlan plan;
  {
    py::gil_scoped_release release;
    layout.validate();
    plan = migration::plan_migration(from, to, layout, options);
  }
  py::list layers;
  for (const migration::LayerMigration& layer : plan.layers) layers.append(layer_dict(layer));
  py::dict out;
  out["layers"] = layers;
  out["totals"] = totals_dict(plan.totals);
  return out;
}

}  // namespace

void bind_migration(py::module_& m) {
  py::tuple actions(migration::kNumActions);
  for (int a = 0; a < migration::kNumActions; ++a) {
    actions[static_cast<size_t>(a)] =
        py::str(std::string(migration::action_name(static_cast<migration::Action>(a))));
  }
  m.attr("ACTIONS") = actions;
  m.def("plan_migration", &plan_migration, py::arg("old_phy2log"), py::arg("new_phy2log"),
        py::arg("ranks"), py::arg("nodes"), py::arg("expert_bytes"), py::arg("peers_per_round"),
        py::arg("half_duplex"), "migration::plan_migration() as dicts of numpy arrays.");
}

}  // namespace eplb::python
