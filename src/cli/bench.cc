// `eplb bench`: in-process benchmarks that print their figures (and ratios against a baseline
// measured in the same run, where there is one).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "eplb/core/error.h"
#include "eplb/placement/metrics.h"
#include "eplb/placement/policy.h"
#include "eplb/stats/load_file.h"

namespace eplb::cli {
namespace {

struct BenchPlacementArgs {
  int64_t layers = 58;
  int64_t experts = 256;
  int64_t physical = 288;
  int64_t ranks = 32;
  int64_t nodes = 4;
  int64_t groups = 8;
  std::string shape;
  std::string policy = "deepseek";
  bool hierarchical = false;
  bool thorough = false;
  double tolerance = 0.01;  // sticky's
  uint64_t seed = 0;
  int repeat = 20;
  std::string load_path;
  // sticky's previous placement: balanced's placement of these loads instead of a lognormal(0,
  // 0.2) drift of the placed ones (two real workloads in a row).
  std::string previous_load_path;
  bool json = false;
};

// The production shapes `--shape` names: DeepSeek-V3's prefill (32 ranks, 9 slots each) and
// decode (144-320 ranks, one or two slots each), and 384-expert models.
struct Shape {
  const char* name;
  int64_t layers, experts, physical, ranks, nodes, groups;
};
constexpr Shape kShapes[] = {
    {"v3-ep32", 58, 256, 288, 32, 4, 8},    {"v3-ep144", 58, 256, 288, 144, 18, 8},
    {"v3-ep256", 58, 256, 512, 256, 32, 8}, {"v3-ep320", 58, 256, 320, 320, 40, 8},
    {"k2-ep64", 61, 384, 448, 64, 8, 8},    {"v4-ep32", 40, 384, 416, 32, 8, 8},
};

std::string shape_names() {
  std::string out;
  for (const Shape& s : kShapes) out += std::string(out.empty() ? "" : ", ") + s.name;
  return out + " or all";
}

LoadMatrix lognormal_load(int64_t layers, int64_t experts, double sigma, std::mt19937_64& rng) {
  LoadMatrix load(layers, experts);
  std::lognormal_distribution<double> dist(0.0, sigma);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  return load;
}

// One policy timed on one shape.
struct PlacementRow {
  std::string shape, policy;
  int64_t layers = 0, experts = 0, physical = 0, ranks = 0;
  std::vector<double> ms;  // ascending
  placement::PlacementMetrics metrics;
  bool identical = true;  // every repeat gave the same placement
  bool thorough = false;
  double tolerance = 0;  // sticky's
};

// `load` comes from `rng` (seeded), which then draws sticky's drift; with `previous_load`,
// sticky starts from balanced's placement of those loads instead. `bound_of` (metrics of
// another row on the same loads and layout) gives the lower bound instead of computing it
// again: at two slots per rank it costs more than the placements.
PlacementRow measure_placement(const BenchPlacementArgs& args, const Layout& layout,
                               const LoadMatrix& load, std::mt19937_64& rng,
                               const std::string& policy,
                               const LoadMatrix* previous_load = nullptr,
                               const placement::PlacementMetrics* bound_of = nullptr) {
  placement::PolicyOptions options;
  options.policy = placement::parse_policy(policy);
  options.hierarchical = args.hierarchical;
  options.thorough = args.thorough;
  options.tolerance = args.tolerance;
  // sticky starts from the balanced placement of a drifted load (or of the previous workload),
  // as a rebalance would.
  Placement previous;
  if (options.policy == placement::Policy::kSticky) {
    LoadMatrix before = previous_load != nullptr ? *previous_load : load;
    if (previous_load == nullptr) {
      std::lognormal_distribution<double> drift(0.0, 0.2);
      for (double& v : before.values) v = std::round(v * drift(rng));
    }
    placement::PolicyOptions first;
    first.policy = placement::Policy::kBalanced;
    first.hierarchical = args.hierarchical;
    first.thorough = args.thorough;
    previous = placement::place(before, layout, first);
    options.previous = &previous;
  }

  PlacementRow row;
  row.shape = args.shape;
  row.policy = policy;
  row.thorough = options.thorough;
  row.tolerance = options.tolerance;
  row.layers = load.layers;
  row.experts = load.experts;
  row.physical = layout.physical;
  row.ranks = layout.ranks;
  Placement result;
  for (int i = 0; i < args.repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Placement out = placement::place(load, layout, options);
    row.ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
    if (i > 0 && out.phy2log != result.phy2log) row.identical = false;
    result = std::move(out);
  }
  std::sort(row.ms.begin(), row.ms.end());
  row.metrics = placement::evaluate(load, result, layout, options.previous, bound_of == nullptr);
  if (bound_of != nullptr) {
    row.metrics.lower_bound_balancedness = bound_of->lower_bound_balancedness;
    row.metrics.lower_bound_mean = bound_of->lower_bound_mean;
  }
  return row;
}

nlohmann::json row_json(const PlacementRow& row) {
  const placement::PlacementMetrics& m = row.metrics;
  nlohmann::json out = {{"policy", row.policy},
                        {"layers", row.layers},
                        {"experts", row.experts},
                        {"physical", row.physical},
                        {"ranks", row.ranks},
                        {"ms_per_call", row.ms[row.ms.size() / 2]},
                        {"ms_min", row.ms.front()},
                        {"balancedness", m.balancedness_mean},
                        {"lower_bound_balancedness", m.lower_bound_mean},
                        {"gap_to_bound", m.lower_bound_mean - m.balancedness_mean},
                        {"identical_repeats", row.identical}};
  if (!row.shape.empty()) out["shape"] = row.shape;
  if (row.policy != "deepseek") out["thorough"] = row.thorough;
  if (m.moved >= 0) {
    out["tolerance"] = row.tolerance;
    out["moved_slots"] = m.moved;
    // Of the slots of the layers with load: a dense layer's (real loads) never move.
    out["moved_fraction"] = m.moe_layers > 0 ? static_cast<double>(m.moved) /
                                                   static_cast<double>(m.moe_layers * row.physical)
                                             : 0.0;
  }
  return out;
}

// --previous-load: the workload before --load's, of the same layers and experts.
std::optional<LoadMatrix> read_previous_load(const BenchPlacementArgs& args,
                                             const LoadMatrix& load) {
  if (args.previous_load_path.empty()) return std::nullopt;
  LoadMatrix previous = stats::read_load(args.previous_load_path);
  if (previous.layers != load.layers || previous.experts != load.experts) {
    fail("--previous-load ", args.previous_load_path, " has ", previous.layers, " layers x ",
         previous.experts, " experts; --load ", args.load_path, " has ", load.layers, " x ",
         load.experts, " (the two workloads must be of one model)");
  }
  return previous;
}

// --shape all: every preset with every policy, one row each, and each policy's time against
// deepseek's on the same loads: lognormal ones, or with --load the file's on every preset of
// its expert count (DeepSeek-V3's real loads on the four 256-expert shapes, say).
void run_all_shapes(BenchPlacementArgs args) {
  std::optional<LoadMatrix> file_load;
  std::vector<std::string> skipped;
  if (!args.load_path.empty()) {
    file_load = stats::read_load(args.load_path);
    std::vector<int64_t> counts;
    for (const Shape& s : kShapes) {
      if (s.experts != file_load->experts) skipped.emplace_back(s.name);
      if (std::find(counts.begin(), counts.end(), s.experts) == counts.end()) {
        counts.push_back(s.experts);
      }
    }
    if (skipped.size() == std::size(kShapes)) {
      fail("--load ", args.load_path, " has ", file_load->experts,
           " experts per layer; the shapes have ", fmt::format("{}", fmt::join(counts, " or ")),
           " (use --layers/--experts/--physical/--ranks for another model)");
    }
  }
  const std::optional<LoadMatrix> previous_load =
      file_load ? read_previous_load(args, *file_load) : std::nullopt;
  nlohmann::json rows = nlohmann::json::array();
  if (!args.json) {
    fmt::print("{:<9} {:<9} {:>9} {:>8} {:>12} {:>8} {:>8} {:>7}\n", "shape", "policy", "ms",
               "vs ds", "balancedness", "bound", "gap", "moved");
  }
  for (const Shape& s : kShapes) {
    if (file_load && s.experts != file_load->experts) continue;
    args.shape = s.name;
    const Layout layout{.experts = s.experts, .physical = s.physical, .ranks = s.ranks,
                        .nodes = s.nodes, .groups = s.groups};
    double deepseek_ms = 0;
    std::optional<placement::PlacementMetrics> first;  // the loads are the same for each policy
    for (const char* policy : {"deepseek", "balanced", "sticky"}) {
      std::mt19937_64 rng(args.seed);
      const LoadMatrix load =
          file_load ? *file_load : lognormal_load(s.layers, s.experts, 1.0, rng);
      // --thorough is balanced's and sticky's; deepseek is measured beside them as it is.
      BenchPlacementArgs policy_args = args;
      policy_args.thorough = args.thorough && std::string_view(policy) != "deepseek";
      const PlacementRow row =
          measure_placement(policy_args, layout, load, rng, policy,
                            previous_load ? &*previous_load : nullptr, first ? &*first : nullptr);
      if (!first) first = row.metrics;
      if (deepseek_ms == 0) deepseek_ms = row.ms.front();
      nlohmann::json j = row_json(row);
      j["ms_min_vs_deepseek"] = row.ms.front() / deepseek_ms;
      const placement::PlacementMetrics& m = row.metrics;
      if (!args.json) {
        fmt::print("{:<9} {:<9} {:>9.3f} {:>7.1f}x {:>12.4f} {:>8.4f} {:>8.4f} {:>7}{}\n", s.name,
                   policy, row.ms.front(), row.ms.front() / deepseek_ms, m.balancedness_mean,
                   m.lower_bound_mean, m.lower_bound_mean - m.balancedness_mean,
                   m.moved >= 0 ? fmt::format("{:.1f}%", 100.0 * j["moved_fraction"].get<double>())
                                : std::string("-"),
                   row.identical ? "" : "  (repeats differ!)");
      }
      rows.push_back(std::move(j));
    }
  }
  if (args.json) {
    nlohmann::json out = {{"shapes", rows}};
    if (file_load) out["skipped"] = skipped;
    fmt::print("{}\n", out.dump());
  } else if (!skipped.empty()) {
    fmt::print("skipped (not {} experts): {}\n", file_load->experts, fmt::join(skipped, ", "));
  }
}

void run_bench_placement(BenchPlacementArgs args) {
  if (args.repeat < 1) fail("--repeat ", args.repeat, " must be at least 1");
  if (!(args.tolerance >= 0 && args.tolerance < 1)) {
    fail("--tolerance ", args.tolerance,
         " must be in [0, 1) (the balancedness sticky may give up against balanced)");
  }
  if (!args.previous_load_path.empty() && args.load_path.empty()) {
    fail("--previous-load ", args.previous_load_path,
         " needs --load (the workload placed after it)");
  }
  if (args.shape == "all") return run_all_shapes(args);
  if (!args.shape.empty()) {
    const Shape* found = nullptr;
    for (const Shape& s : kShapes) {
      if (args.shape == s.name) found = &s;
    }
    if (found == nullptr) fail("unknown --shape '", args.shape, "' (expected ", shape_names(), ")");
    args.layers = found->layers;
    args.experts = found->experts;
    args.physical = found->physical;
    args.ranks = found->ranks;
    args.nodes = found->nodes;
    args.groups = found->groups;
  }
  // The shape is checked before lognormal loads are sized by it (a file's loads are already
  // bounded by the file).
  if (args.load_path.empty()) {
    if (args.layers < 1 || args.layers > kMaxLayers) {
      fail("--layers ", args.layers, " is outside [1, ", kMaxLayers, "] (MoE layers)");
    }
    const Layout given{.experts = args.experts, .physical = args.physical, .ranks = args.ranks,
                       .nodes = args.nodes, .groups = args.groups};
    given.validate();
  }
  std::mt19937_64 rng(args.seed);
  // Real loads (say SGLang's statistics of DeepSeek-V3, dense layers included) or lognormal ones.
  const LoadMatrix load = args.load_path.empty()
                              ? lognormal_load(args.layers, args.experts, 1.0, rng)
                              : stats::read_load(args.load_path);
  // The loads' own checks (a layer's sum among them) before sticky derives a drifted copy, so
  // that a bad file is named as such.
  load.validate();
  const Layout layout{.experts = load.experts, .physical = args.physical, .ranks = args.ranks,
                      .nodes = args.nodes, .groups = args.groups};
  layout.validate();
  const std::optional<LoadMatrix> previous_load = read_previous_load(args, load);
  const PlacementRow row = measure_placement(args, layout, load, rng, args.policy,
                                             previous_load ? &*previous_load : nullptr);
  const placement::PlacementMetrics& m = row.metrics;
  if (args.json) {
    fmt::print("{}\n", row_json(row).dump());
  } else {
    fmt::print("placement {} {}x{}->{} on {} ranks: {:.3f} ms per call (median of {}, min {:.3f}), "
               "balancedness {:.4f}, lower bound {:.4f}{}\n",
               args.policy, row.layers, row.experts, args.physical, args.ranks,
               row.ms[row.ms.size() / 2], args.repeat, row.ms.front(), m.balancedness_mean,
               m.lower_bound_mean,
               m.moved >= 0 ? fmt::format(", {} slots moved", m.moved) : std::string());
  }
}

}  // namespace

void add_bench_placement(CLI::App& bench) {
  auto args = std::make_shared<BenchPlacementArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "placement", "Time the placement of all layers on lognormal(0, 1) loads, in-process");
  cmd->add_option("--layers", args->layers)->capture_default_str();
  cmd->add_option("--experts", args->experts)->capture_default_str();
  cmd->add_option("--physical", args->physical)->capture_default_str();
  cmd->add_option("--ranks", args->ranks)->capture_default_str();
  cmd->add_option("--nodes", args->nodes)->capture_default_str();
  cmd->add_option("--groups", args->groups)->capture_default_str();
  cmd->add_option("--shape", args->shape,
                  "A production shape, setting layers to groups: " + shape_names() +
                      " (every shape with every policy, one row each)");
  cmd->add_option("--policy", args->policy, "deepseek, balanced or sticky")
      ->capture_default_str();
  cmd->add_flag("--hierarchical", args->hierarchical);
  cmd->add_flag("--thorough", args->thorough,
                "balanced/sticky at two slots per rank: also build the replica counts level by "
                "level (better balance at 256 ranks, slower; docs/placement.md)");
  cmd->add_option("--tolerance", args->tolerance,
                  "sticky: balancedness it may give up against balanced (fewer moved slots)")
      ->capture_default_str();
  add_seed_option(cmd, args->seed, "Seed of the synthetic loads");
  cmd->add_option("--load", args->load_path,
                  "Place these loads (any `eplb plan --load` format; sets layers and experts) "
                  "instead of lognormal(0, 1) ones; with --shape all, on every shape of their "
                  "expert count");
  cmd->add_option("--previous-load", args->previous_load_path,
                  "sticky: start from balanced's placement of these loads (the workload before "
                  "--load's) instead of a lognormal(0, 0.2) drift of --load's");
  cmd->add_option("--repeat", args->repeat, "Calls timed; the median is reported")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run_bench_placement(*args); });
}

void add_bench(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that print their figures");
  bench->require_subcommand(1);
  add_bench_placement(*bench);
  add_bench_migration(*bench);
  add_bench_transport(*bench);
  add_bench_control(*bench);
  add_bench_runtime(*bench);
}

}  // namespace eplb::cli
