// `eplb plan`: loads in, placement out.

#include <chrono>
#include <optional>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/layout_options.h"
#include "cli/migration_summary.h"
#include "eplb/core/error.h"
#include "eplb/migration/migration.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/placement_file.h"

namespace eplb::cli {
namespace {

struct PlanArgs {
  std::string load_path;
  std::string format = "auto";
  int64_t experts = 0;
  int64_t ranks = 0;
  int64_t nodes = 1;
  int64_t groups = 1;
  std::optional<int64_t> physical;
  std::optional<int64_t> redundant;
  std::string policy;
  bool hierarchical = false;
  bool thorough = false;
  std::string previous_path;
  double tolerance = 0.01;
  int64_t expert_bytes = 1 << 20;
  int64_t peers_per_round = 1;
  std::string output_path;
  std::string write_format = "eplb";
  bool json = false;
};

void print_migration(const PlanArgs& args, const migration::MigrationTotals& t) {
  const auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  fmt::print("migration from the previous placement (expert {:.2f} MiB, {} peer{} per round): "
             "{} unchanged, {} local copies, {} free rides, {} reads on the same node, {} from "
             "other nodes; {:.1f} MiB read ({:.1f} MiB across nodes), at most {:.1f} MiB into "
             "and {:.1f} MiB out of one rank; {} rounds (lower bound {})\n",
             mib(args.expert_bytes), args.peers_per_round, args.peers_per_round == 1 ? "" : "s",
             t.count(migration::Action::kUnchanged), t.count(migration::Action::kLocalCopy),
             t.count(migration::Action::kFreeRide), t.count(migration::Action::kReadSameNode),
             t.count(migration::Action::kReadOtherNode), mib(t.bytes_total),
             mib(t.bytes_inter_node), mib(t.max_rank_bytes_in), mib(t.max_rank_bytes_out),
             t.rounds, t.rounds_lower_bound);
  if (t.count(migration::Action::kRestore) > 0) {  // only elastic plans restore
    fmt::print("and {} restores of experts no live slot holds ({:.1f} MiB)\n",
               t.count(migration::Action::kRestore), mib(t.bytes_restored));
  }
}

void print_table(const PlanArgs& args, const Layout& layout, const LoadMatrix& load,
                 const placement::PlacementMetrics& m, std::string_view policy, double ms) {
  fmt::print("eplb plan: policy {}, {} layers, {} experts -> {} slots on {} ranks ({} node{}), "
             "{:.3f} ms\n",
             policy, load.layers, layout.experts, layout.physical, layout.ranks, layout.nodes,
             layout.nodes == 1 ? "" : "s", ms);
  fmt::print("{:>6}  {:>12}  {:>11}  {:>6}\n", "layer", "balancedness", "lower bound", "moved");
  for (int64_t l = 0; l < load.layers; ++l) {
    const std::string moved =
        m.moved_per_layer.empty() ? "-" : std::to_string(m.moved_per_layer[l]);
    if (m.dense[l]) {
      fmt::print("{:>6}  {:>12}  {:>11}  {:>6}\n", l, "dense", "-", moved);
      continue;
    }
    fmt::print("{:>6}  {:>12.4f}  {:>11.4f}  {:>6}\n", l, m.balancedness[l],
               m.lower_bound_balancedness[l], moved);
  }
  const std::string over =
      m.moe_layers == load.layers
          ? std::string("mean over layers")
          : fmt::format("mean over the {} layers with load; {} dense", m.moe_layers,
                        load.layers - m.moe_layers);
  fmt::print("total: balancedness {:.4f} ({}), {:.4f} (step-weighted); lower bound {:.4f}",
             m.balancedness_mean, over, m.balancedness_step, m.lower_bound_mean);
  if (m.moved >= 0) {
    fmt::print("; moved {} of {} slots ({:.1f}%)", m.moved, load.layers * layout.physical,
               100.0 * static_cast<double>(m.moved) /
                   static_cast<double>(load.layers * layout.physical));
  }
  fmt::print("\n");
  if (!args.output_path.empty()) fmt::print("wrote {}\n", args.output_path);
}

void run_plan(const PlanArgs& args) {
  stats::LoadReadOptions read_options;
  read_options.format = stats::parse_load_format(args.format);
  if (args.experts < 0) fail("--experts ", args.experts, " must be positive");
  read_options.experts = args.experts;
  if (args.ranks <= 0) fail("--ranks ", args.ranks, " must be at least 1");
  if (args.write_format != "eplb" && args.write_format != "sglang") {
    fail("--write-format ", args.write_format, " is not a placement format (expected eplb or "
         "sglang)");
  }

  const LoadMatrix load = stats::read_load(args.load_path, read_options);

  Layout layout;
  layout.experts = load.experts;
  layout.ranks = args.ranks;
  layout.nodes = args.nodes;
  layout.groups = args.groups;
  layout.physical = physical_slots(load.experts, layout.ranks, args.physical, args.redundant);
  layout.validate();

  std::optional<stats::PlacementFile> previous;
  if (!args.previous_path.empty()) {
    previous = stats::read_placement(args.previous_path, layout.experts);
  }

  placement::PolicyOptions options;
  options.policy = args.policy.empty()
                       ? (previous ? placement::Policy::kSticky : placement::Policy::kBalanced)
                       : placement::parse_policy(args.policy);
  options.hierarchical = args.hierarchical;
  options.thorough = args.thorough;
  options.tolerance = args.tolerance;
  options.previous = previous ? &previous->placement : nullptr;

  const auto start = std::chrono::steady_clock::now();
  const Placement result = placement::place(load, layout, options);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  const placement::PlacementMetrics m =
      placement::evaluate(load, result, layout, options.previous);
  if (!args.output_path.empty()) {
    stats::write_placement(args.output_path, result, layout,
                           stats::parse_placement_format(args.write_format));
  }

  std::optional<migration::MigrationPlan> moves;
  if (previous) {
    if (args.expert_bytes < 1) fail("--expert-bytes ", args.expert_bytes, " must be at least 1");
    migration::MigrationOptions migration_options;
    migration_options.expert_bytes = args.expert_bytes;
    migration_options.schedule.peers_per_round = args.peers_per_round;
    moves = migration::plan_migration(previous->placement, result, layout, migration_options);
  }

  const std::string_view policy = placement::policy_name(options.policy);
  if (args.json) {
    nlohmann::json out = {
        {"policy", policy},
        {"layers", load.layers},
        {"experts", layout.experts},
        {"physical", layout.physical},
        {"ranks", layout.ranks},
        {"nodes", layout.nodes},
        {"groups", layout.groups},
        {"thorough", options.thorough},
        {"balancedness", m.balancedness_mean},
        {"balancedness_step", m.balancedness_step},
        {"lower_bound_balancedness", m.lower_bound_mean},
        {"moe_layers", m.moe_layers},
        {"dense_layers", load.layers - m.moe_layers},
        {"moved_slots", m.moved >= 0 ? nlohmann::json(m.moved) : nlohmann::json(nullptr)},
        {"compute_ms", ms},
    };
    if (moves) out["migration"] = migration_summary_json(moves->totals);
    fmt::print("{}\n", out.dump());
  } else {
    print_table(args, layout, load, m, policy, ms);
    if (moves) print_migration(args, moves->totals);
  }
}

}  // namespace

void add_plan(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Compute a placement of experts on ranks from per-expert loads");
  cmd->add_option("--load", args->load_path,
                   "Load file: eplb JSON, SGLang logical_count JSON, vLLM load_history JSON, CSV "
                   "matrix or routing trace CSV")
      ->required();
  cmd->add_option("--format", args->format, "Load format: auto, eplb, sglang, vllm, csv, trace")
      ->capture_default_str();
  cmd->add_option("--experts", args->experts,
                  "Logical experts per layer for a routing trace (default: largest id + 1)");
  cmd->add_option("--ranks", args->ranks, "Ranks (GPUs) G")->required();
  cmd->add_option("--nodes", args->nodes, "Nodes N (ranks are split evenly)")
      ->capture_default_str();
  cmd->add_option("--groups", args->groups, "Expert groups (DeepSeek group-limited routing)")
      ->capture_default_str();
  cmd->add_option("--physical", args->physical, "Physical slots per layer P (a multiple of G)");
  cmd->add_option("--redundant", args->redundant, "Redundant slots per layer R (P = E + R)");
  cmd->add_option("--policy", args->policy,
                  "deepseek, balanced or sticky (default: sticky with --previous, else balanced)");
  cmd->add_flag("--hierarchical", args->hierarchical,
                "balanced/sticky: pack groups to nodes first, like deepseek");
  cmd->add_flag("--thorough", args->thorough,
                "balanced/sticky at two slots per rank: also build the replica counts level by "
                "level (better balance at 256 ranks, slower; docs/placement.md)");
  cmd->add_option("--previous", args->previous_path,
                  "The placement in force now (eplb's or SGLang's physical_to_logical_map)");
  cmd->add_option("--tolerance", args->tolerance,
                  "sticky: balancedness it may give up against balanced")
      ->capture_default_str();
  cmd->add_option("--expert-bytes", args->expert_bytes,
                  "With --previous: bytes of one expert, for the migration figures")
      ->capture_default_str();
  cmd->add_option("--peers-per-round", args->peers_per_round,
                  "With --previous: peers a rank reads from (and serves) per round")
      ->capture_default_str();
  cmd->add_option("-o,--output", args->output_path, "Write the placement as JSON");
  cmd->add_option("--write-format", args->write_format,
                  "Placement file format: eplb, or sglang (physical_to_logical_map, what "
                  "SGLang's --init-expert-location reads)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of the table");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace eplb::cli
