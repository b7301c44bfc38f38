// `eplb migrate-plan`: the weight moves from one placement to another, planned and scheduled;
// and `eplb bench migration`, the time to plan and schedule a whole rebalance.

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/migration_summary.h"
#include "cli/option_checks.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/migration/migration.h"
#include "eplb/stats/placement_file.h"

namespace eplb::cli {

nlohmann::json migration_summary_json(const migration::MigrationTotals& t) {
  nlohmann::json out = {
      {"slots_unchanged", t.count(migration::Action::kUnchanged)},
      {"slots_local_copy", t.count(migration::Action::kLocalCopy)},
      {"slots_free_ride", t.count(migration::Action::kFreeRide)},
      {"slots_read_same_node", t.count(migration::Action::kReadSameNode)},
      {"slots_read_other_node", t.count(migration::Action::kReadOtherNode)},
      {"reads", t.reads},
      {"bytes_total", t.bytes_total},
      {"bytes_intra_node", t.bytes_intra_node},
      {"bytes_inter_node", t.bytes_inter_node},
      {"bytes_local_copy", t.bytes_local_copy},
      {"max_rank_bytes_in", t.max_rank_bytes_in},
      {"max_rank_bytes_out", t.max_rank_bytes_out},
      {"max_layer_rank_bytes_in", t.max_layer_rank_bytes_in},
      {"max_layer_rank_bytes_out", t.max_layer_rank_bytes_out},
      {"rounds", t.rounds},
      {"rounds_lower_bound", t.rounds_lower_bound},
      {"max_layer_rounds", t.max_layer_rounds},
      {"link_time", t.link_time},
      {"link_time_lower_bound", t.link_time_lower_bound},
      {"staging_slots", t.staging_slots},
  };
  // Only elastic plans restore; a plain plan's figures stay as they always were.
  if (t.count(migration::Action::kRestore) > 0) {
    out["slots_restore"] = t.count(migration::Action::kRestore);
    out["bytes_restored"] = t.bytes_restored;
    out["bytes_restored_remote"] = t.bytes_restored_remote;
  }
  return out;
}

namespace {

using migration::Action;
using migration::MigrationPlan;
using migration::MigrationTotals;

struct MigratePlanArgs {
  std::string from_path;
  std::string to_path;
  int64_t expert_bytes = 0;
  std::optional<int64_t> nodes;
  std::optional<int64_t> ranks;
  int64_t peers_per_round = 1;
  bool half_duplex = false;
  std::string output_path;
  bool json = false;
};

// The value of a layout field: the option if given, else what the files say. A file that says
// something else than the option, or two files that disagree, are errors.
std::optional<int64_t> resolve(std::string_view name, std::optional<int64_t> option,
                               int64_t from_value, int64_t to_value, const MigratePlanArgs& args) {
  if (from_value > 0 && to_value > 0 && from_value != to_value) {
    fail("mismatched shapes: ", args.from_path, " has ", name, " ", from_value, " but ",
         args.to_path, " has ", name, " ", to_value);
  }
  const int64_t stated = from_value > 0 ? from_value : to_value;
  if (option) {
    if (*option < 1) fail("--", name, " ", *option, " must be at least 1");
    if (stated > 0 && stated != *option) {
      fail("--", name, " ", *option, " disagrees with the placement files, which say ", name, " ",
           stated);
    }
    return option;
  }
  if (stated > 0) return stated;
  return std::nullopt;
}

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

MigrationTotals layer_totals(const migration::LayerMigration& m) {
  MigrationTotals t;
  const migration::LayerPlan& p = m.plan;
  t.slots = p.slots;
  t.reads = static_cast<int64_t>(p.reads.size());
  t.bytes_total = p.bytes_total;
  t.bytes_intra_node = p.bytes_intra_node;
  t.bytes_inter_node = p.bytes_inter_node;
  t.bytes_local_copy = p.bytes_local_copy;
  t.bytes_restored = p.bytes_restored;
  t.bytes_restored_remote = p.bytes_restored_remote;
  t.max_rank_bytes_in = t.max_layer_rank_bytes_in = p.max_rank_bytes_in;
  t.max_rank_bytes_out = t.max_layer_rank_bytes_out = p.max_rank_bytes_out;
  t.rounds = t.max_layer_rounds = m.schedule.rounds;
  t.rounds_lower_bound = m.schedule.lower_bound;
  t.link_time = m.schedule.link_time;
  t.link_time_lower_bound = m.schedule.link_time_lower_bound;
  t.staging_slots = p.staging_slots;
  return t;
}

nlohmann::json full_plan_json(const MigrationPlan& plan, const nlohmann::json& header) {
  nlohmann::json out = header;
  nlohmann::json layers = nlohmann::json::array();
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    const migration::LayerMigration& m = plan.layers[l];
    nlohmann::json layer = migration_summary_json(layer_totals(m));
    layer["layer"] = l;
    layer["max_peers"] = m.schedule.max_peers;
    nlohmann::json action = nlohmann::json::array(), expert = nlohmann::json::array(),
                   src_rank = nlohmann::json::array(), src_slot = nlohmann::json::array();
    for (const migration::SlotAction& a : m.plan.actions) {
      action.push_back(migration::action_name(a.action));
      expert.push_back(a.expert);
      src_rank.push_back(a.src_rank);
      src_slot.push_back(a.src_slot);
    }
    layer["action"] = std::move(action);  // [physical], by destination slot
    layer["expert"] = std::move(expert);
    layer["src_rank"] = std::move(src_rank);
    layer["src_slot"] = std::move(src_slot);
    nlohmann::json reads = nlohmann::json::array();
    for (size_t i = 0; i < m.plan.reads.size(); ++i) {
      const migration::RemoteRead& r = m.plan.reads[i];
      reads.push_back({{"src_rank", r.src_rank},
                       {"src_slot", r.src_slot},
                       {"dst_rank", r.dst_rank},
                       {"dst_slot", r.dst_slot},
                       {"expert", r.expert},
                       {"round", m.schedule.round_of_read[i]}});
    }
    layer["remote_reads"] = std::move(reads);
    if (plan.totals.count(Action::kRestore) > 0) {
      nlohmann::json restores = nlohmann::json::array();
      for (const migration::Restore& r : m.plan.restores) {
        restores.push_back({{"src_rank", r.src_rank},
                            {"dst_rank", r.dst_rank},
                            {"dst_slot", r.dst_slot},
                            {"expert", r.expert}});
      }
      layer["restores"] = std::move(restores);  // src_rank -1: the loader
    }
    layers.push_back(std::move(layer));
  }
  out["per_layer"] = std::move(layers);
  return out;
}

// `restores`: a "restore" column after "other-node" (only elastic plans have one).
void print_row(const std::string& label, const MigrationTotals& t, bool restores) {
  fmt::print("{:>6} {:>9} {:>6} {:>5} {:>9} {:>10} ", label, t.count(Action::kUnchanged),
             t.count(Action::kLocalCopy), t.count(Action::kFreeRide),
             t.count(Action::kReadSameNode), t.count(Action::kReadOtherNode));
  if (restores) fmt::print("{:>7} ", t.count(Action::kRestore));
  fmt::print("{:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>6} {:>5}\n", mib(t.bytes_intra_node),
             mib(t.bytes_inter_node), mib(t.max_rank_bytes_in), mib(t.max_rank_bytes_out),
             t.rounds, t.rounds_lower_bound);
}

void print_table(const MigratePlanArgs& args, const Layout& layout, const MigrationPlan& plan,
                 double ms) {
  fmt::print(
      "eplb migrate-plan: {} layers, {} slots on {} ranks ({} node{}), expert {:.2f} MiB, "
      "{} peer{} per round, {}; planned in {:.3f} ms\n",
      plan.layers.size(), layout.physical, layout.ranks, layout.nodes, layout.nodes == 1 ? "" : "s",
      mib(args.expert_bytes), args.peers_per_round, args.peers_per_round == 1 ? "" : "s",
      args.half_duplex ? "half duplex" : "duplex", ms);
  const MigrationTotals& t = plan.totals;
  const bool restores = t.count(Action::kRestore) > 0;
  fmt::print("{:>6} {:>9} {:>6} {:>5} {:>9} {:>10} ", "layer", "unchanged", "local", "ride",
             "same-node", "other-node");
  if (restores) fmt::print("{:>7} ", "restore");
  fmt::print("{:>10} {:>10} {:>10} {:>10} {:>6} {:>5}\n", "intra MiB", "inter MiB", "max in MiB",
             "max out MiB", "rounds", "bound");
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    print_row(std::to_string(l), layer_totals(plan.layers[l]), restores);
  }
  print_row("total", t, restores);
  fmt::print(
      "moved {:.1f} MiB by {} reads ({:.1f} MiB across nodes), {:.1f} MiB by same-rank "
      "copies; per layer at most {:.1f} MiB into and {:.1f} MiB out of one rank, {} "
      "rounds, {} staging slots per rank\n",
      mib(t.bytes_total), t.reads, mib(t.bytes_inter_node), mib(t.bytes_local_copy),
      mib(t.max_layer_rank_bytes_in), mib(t.max_layer_rank_bytes_out), t.max_layer_rounds,
      t.staging_slots);
  if (restores) {
    fmt::print("restored {:.1f} MiB of experts no live slot holds ({:.1f} MiB from other ranks' "
               "host copies), before the reads\n",
               mib(t.bytes_restored), mib(t.bytes_restored_remote));
  }
  if (args.half_duplex && t.rounds > t.rounds_lower_bound) {
    fmt::print("half duplex: {} rounds against a lower bound of {} (best effort)\n", t.rounds,
               t.rounds_lower_bound);
  }
  fmt::print("link time {} against a lower bound of {} (expert moves: the sum over rounds of "
             "the largest flow between two ranks)\n",
             t.link_time, t.link_time_lower_bound);
  if (!args.output_path.empty()) fmt::print("wrote {}\n", args.output_path);
}

void run_migrate_plan(const MigratePlanArgs& args) {
  if (args.expert_bytes <= 0) {
    fail("--expert-bytes ", args.expert_bytes,
         " must be at least 1 (the bytes of one expert's weights in one layer)");
  }
  if (args.peers_per_round < 1) {
    fail("--peers-per-round ", args.peers_per_round, " must be at least 1");
  }
  const stats::PlacementFile from = stats::read_placement(args.from_path);
  const stats::PlacementFile to = stats::read_placement(args.to_path);
  const Placement& old_placement = from.placement;
  const Placement& new_placement = to.placement;
  if (old_placement.layers != new_placement.layers) {
    fail("mismatched shapes: ", args.from_path, " has ", old_placement.layers, " layers but ",
         args.to_path, " has ", new_placement.layers);
  }
  if (old_placement.physical != new_placement.physical) {
    fail("mismatched shapes: ", args.from_path, " has ", old_placement.physical,
         " physical slots per layer but ", args.to_path, " has ", new_placement.physical);
  }

  Layout layout;
  // The new placement may drop experts the old one had (never the reverse: the planner names an
  // expert that no old slot holds).
  layout.experts = std::max(old_placement.experts, new_placement.experts);
  layout.physical = old_placement.physical;
  const std::optional<int64_t> ranks = resolve("ranks", args.ranks, from.ranks, to.ranks, args);
  const std::optional<int64_t> nodes = resolve("nodes", args.nodes, from.nodes, to.nodes, args);
  // SGLang's files do not say how the slots are split over ranks. Without --ranks, every slot
  // is taken for its own rank: no slot is assumed to share a rank with another, so no local
  // copy or free ride is counted that the real layout might not allow (an upper bound on the
  // bytes that cross ranks).
  const bool ranks_assumed = !ranks;
  layout.ranks = ranks.value_or(layout.physical);
  layout.nodes = nodes.value_or(1);
  if (ranks_assumed) {
    fmt::print(stderr,
               "eplb migrate-plan: note: {} does not say how many ranks hold its {} slots; "
               "assuming one slot per rank ({} ranks). Pass --ranks G for the real layout.\n",
               args.from_path, layout.physical, layout.ranks);
  }
  if (layout.physical % layout.ranks != 0) {
    fail("physical ", layout.physical, " is not a multiple of ranks ", layout.ranks,
         " (every rank holds the same number of slots)");
  }
  if (layout.ranks % layout.nodes != 0) {
    fail("ranks ", layout.ranks, " is not a multiple of --nodes ", layout.nodes,
         " (every node holds the same number of ranks)");
  }

  migration::MigrationOptions options;
  options.expert_bytes = args.expert_bytes;
  options.schedule.peers_per_round = args.peers_per_round;
  options.schedule.half_duplex = args.half_duplex;
  const auto start = std::chrono::steady_clock::now();
  const MigrationPlan plan =
      migration::plan_migration(old_placement, new_placement, layout, options);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  nlohmann::json header = {
      {"version", 1},
      {"layers", old_placement.layers},
      {"experts", layout.experts},
      {"physical", layout.physical},
      {"ranks", layout.ranks},
      {"nodes", layout.nodes},
      {"ranks_assumed", ranks_assumed},
      {"expert_bytes", args.expert_bytes},
      {"peers_per_round", args.peers_per_round},
      {"half_duplex", args.half_duplex},
  };
  nlohmann::json summary = header;
  summary.update(migration_summary_json(plan.totals));
  if (!args.output_path.empty()) {
    std::ofstream out(args.output_path);
    if (!out) fail<IoError>("cannot write the plan to ", args.output_path);
    out << full_plan_json(plan, summary).dump() << "\n";
    if (!out.flush()) fail<IoError>("cannot write the plan to ", args.output_path);
  }
  if (args.json) {
    summary["compute_ms"] = ms;
    fmt::print("{}\n", summary.dump());
  } else {
    print_table(args, layout, plan, ms);
  }
}

// `eplb bench migration`: plan and schedule every layer of a synthetic rebalance.
struct BenchMigrationArgs {
  int64_t layers = 58;
  int64_t experts = 256;
  int64_t physical = 288;
  int64_t ranks = 32;
  int64_t nodes = 4;
  int64_t expert_bytes = 44 << 20;
  int64_t peers_per_round = 1;
  double changed = 1.0;
  uint64_t seed = 0;
  int repeat = 20;
  bool json = false;
};

Placement random_placement(int64_t layers, int64_t experts, int64_t physical,
                           std::mt19937_64& rng) {
  Placement p(layers, experts, physical);
  std::uniform_int_distribution<int64_t> pick(0, experts - 1);
  for (int64_t l = 0; l < layers; ++l) {
    auto row = p.layer_phy2log(l);
    for (int64_t s = 0; s < physical; ++s) {
      row[s] = static_cast<int32_t>(s < experts ? s : pick(rng));
    }
    std::shuffle(row.begin(), row.end(), rng);
  }
  p.derive_from_phy2log();
  return p;
}

void run_bench_migration(const BenchMigrationArgs& args) {
  if (args.repeat < 1) fail("--repeat ", args.repeat, " must be at least 1");
  check_range("--layers", args.layers, 1, kMaxLayers, "MoE layers");
  check_number("--changed", args.changed, 0, 1,
               "slot swaps per layer, as a fraction of the slots");
  const Layout layout{.experts = args.experts,
                      .physical = args.physical,
                      .ranks = args.ranks,
                      .nodes = args.nodes,
                      .groups = 1};
  layout.validate();
  // The two placements and the plan, per slot of every layer, before any is sized: phy2log
  // twice (4 B each), the plan's action and its read (under 64 B together), and the same again
  // while the next repeat replaces the plan.
  check_fits_in_memory(
      checked_mul(checked_mul(args.layers, args.physical, "--layers x --physical"), 8 + 2 * 64,
                  "the bytes of the placements and plans"),
      fmt::format("--layers {} x --physical {} (two placements and a migration plan)",
                  args.layers, args.physical),
      "lower --layers or --physical");
  std::mt19937_64 rng(args.seed);
  const Placement from = random_placement(args.layers, args.experts, args.physical, rng);
  // The new placement: a random one, of which a fraction `changed` of the slot swaps is kept.
  Placement to = from;
  std::uniform_int_distribution<int64_t> slot(0, args.physical - 1);
  const auto swaps = static_cast<int64_t>(args.changed * static_cast<double>(args.physical));
  for (int64_t l = 0; l < args.layers; ++l) {
    auto row = to.layer_phy2log(l);
    for (int64_t i = 0; i < swaps; ++i) std::swap(row[slot(rng)], row[slot(rng)]);
  }
  to.derive_from_phy2log();

  migration::MigrationOptions options;
  options.expert_bytes = args.expert_bytes;
  options.schedule.peers_per_round = args.peers_per_round;
  std::vector<double> ms;
  MigrationPlan plan;
  for (int i = 0; i < args.repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    plan = migration::plan_migration(from, to, layout, options);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  int64_t changed_slots = 0;
  for (size_t i = 0; i < from.phy2log.size(); ++i) {
    changed_slots += from.phy2log[i] != to.phy2log[i];
  }
  // The baseline: every changed slot read from a peer, as an engine without a planner does.
  const double naive_bytes =
      static_cast<double>(changed_slots) * static_cast<double>(args.expert_bytes);
  const double bytes_ratio =
      naive_bytes > 0 ? static_cast<double>(plan.totals.bytes_total) / naive_bytes : 0.0;
  if (args.json) {
    nlohmann::json out = {{"layers", args.layers},
                          {"median_ms", ms[ms.size() / 2]},
                          {"min_ms", ms.front()},
                          {"rounds", plan.totals.rounds},
                          {"rounds_lower_bound", plan.totals.rounds_lower_bound},
                          {"bytes_total", plan.totals.bytes_total},
                          {"bytes_vs_naive", bytes_ratio}};
    fmt::print("{}\n", out.dump());
    return;
  }
  fmt::print("eplb bench migration: {} layers, {}, {} slot swaps per layer\n", args.layers,
             layout.describe(), swaps);
  fmt::print(
      "plan + schedule: median {:.3f} ms, min {:.3f} ms over {} runs (target: 2 ms for "
      "58 layers of 288 slots on 32 ranks)\n",
      ms[ms.size() / 2], ms.front(), args.repeat);
  fmt::print(
      "rounds {} (lower bound {}); bytes moved {:.1f} GiB = {:.3f} x reading every "
      "changed slot\n",
      plan.totals.rounds, plan.totals.rounds_lower_bound,
      static_cast<double>(plan.totals.bytes_total) / (1 << 30), bytes_ratio);
}

}  // namespace

void add_migrate_plan(CLI::App& app) {
  auto args = std::make_shared<MigratePlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "migrate-plan", "Plan and schedule the weight moves from one placement to another");
  cmd->add_option("--from", args->from_path,
                  "The placement in force now (eplb's or SGLang's physical_to_logical_map)")
      ->required();
  cmd->add_option("--to", args->to_path, "The new placement (same formats)")->required();
  cmd->add_option("--expert-bytes", args->expert_bytes,
                  "Bytes of one expert's weights in one layer")
      ->required();
  cmd->add_option("--nodes", args->nodes, "Nodes N (default: the files' value, else 1)");
  cmd->add_option("--ranks", args->ranks,
                  "Ranks G (default: the files' value; SGLang's files have none: one slot per "
                  "rank is assumed)");
  cmd->add_option("--peers-per-round", args->peers_per_round,
                  "Peers a rank reads from (and serves) per round")
      ->capture_default_str();
  cmd->add_flag("--half-duplex", args->half_duplex,
                "A rank talks to at most k peers per round in both directions together");
  cmd->add_option("-o,--output", args->output_path,
                  "Write the full plan (actions, reads and rounds per layer) as JSON");
  cmd->add_flag("--json", args->json, "Print one JSON object instead of the table");
  cmd->callback([args] { run_migrate_plan(*args); });
}

void add_bench_migration(CLI::App& bench) {
  auto args = std::make_shared<BenchMigrationArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "migration", "Time planning and scheduling the moves of a whole rebalance");
  cmd->add_option("--layers", args->layers, "MoE layers")->capture_default_str();
  cmd->add_option("--experts", args->experts, "Logical experts E")->capture_default_str();
  cmd->add_option("--physical", args->physical, "Physical slots P")->capture_default_str();
  cmd->add_option("--ranks", args->ranks, "Ranks G")->capture_default_str();
  cmd->add_option("--nodes", args->nodes, "Nodes N")->capture_default_str();
  cmd->add_option("--expert-bytes", args->expert_bytes, "Bytes of one expert")
      ->capture_default_str();
  cmd->add_option("--peers-per-round", args->peers_per_round, "Peers per round k")
      ->capture_default_str();
  cmd->add_option("--changed", args->changed,
                  "Slot swaps per layer, as a fraction of the slots (1: a full reshuffle)")
      ->capture_default_str();
  add_seed_option(cmd, args->seed, "Random seed");
  cmd->add_option("--repeat", args->repeat, "Runs to time")->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run_bench_migration(*args); });
}

}  // namespace eplb::cli
