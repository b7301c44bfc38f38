// `eplb bench`: in-process benchmarks that print their figures (and ratios against a baseline
// measured in the same run, where there is one).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
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
  std::string policy = "deepseek";
  bool hierarchical = false;
  uint64_t seed = 0;
  int repeat = 20;
  std::string load_path;
  bool json = false;
};

LoadMatrix lognormal_load(int64_t layers, int64_t experts, double sigma, std::mt19937_64& rng) {
  LoadMatrix load(layers, experts);
  std::lognormal_distribution<double> dist(0.0, sigma);
  for (double& v : load.values) v = std::round(dist(rng) * 1000.0);
  return load;
}

void run_bench_placement(const BenchPlacementArgs& args) {
  if (args.repeat < 1) fail("--repeat ", args.repeat, " must be at least 1");
  if (args.layers < 1) fail("--layers ", args.layers, " must be at least 1");
  std::mt19937_64 rng(args.seed);
  // Real loads (say SGLang's statistics of DeepSeek-V3, dense layers included) or lognormal ones.
  const LoadMatrix load = args.load_path.empty()
                              ? lognormal_load(args.layers, args.experts, 1.0, rng)
                              : stats::read_load(args.load_path);
  const Layout layout{.experts = load.experts, .physical = args.physical, .ranks = args.ranks,
                      .nodes = args.nodes, .groups = args.groups};
  layout.validate();

  placement::PolicyOptions options;
  options.policy = placement::parse_policy(args.policy);
  options.hierarchical = args.hierarchical;
  // sticky starts from the balanced placement of a drifted load, as a rebalance would.
  Placement previous;
  if (options.policy == placement::Policy::kSticky) {
    LoadMatrix before = load;
    std::lognormal_distribution<double> drift(0.0, 0.2);
    for (double& v : before.values) v = std::round(v * drift(rng));
    placement::PolicyOptions first;
    first.policy = placement::Policy::kBalanced;
    first.hierarchical = args.hierarchical;
    previous = placement::place(before, layout, first);
    options.previous = &previous;
  }

  std::vector<double> ms;
  Placement result;
  for (int i = 0; i < args.repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    result = placement::place(load, layout, options);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                           start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const placement::PlacementMetrics m = placement::evaluate(load, result, layout, options.previous);
  if (args.json) {
    nlohmann::json out = {{"policy", args.policy},
                          {"layers", load.layers},
                          {"experts", load.experts},
                          {"physical", args.physical},
                          {"ranks", args.ranks},
                          {"ms_per_call", median},
                          {"ms_min", ms.front()},
                          {"balancedness", m.balancedness_mean},
                          {"lower_bound_balancedness", m.lower_bound_mean}};
    if (m.moved >= 0) out["moved_slots"] = m.moved;
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("placement {} {}x{}->{} on {} ranks: {:.3f} ms per call (median of {}, min {:.3f}), "
               "balancedness {:.4f}, lower bound {:.4f}\n",
               args.policy, load.layers, load.experts, args.physical, args.ranks, median,
               args.repeat, ms.front(), m.balancedness_mean, m.lower_bound_mean);
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
  cmd->add_option("--policy", args->policy, "deepseek, balanced or sticky")
      ->capture_default_str();
  cmd->add_flag("--hierarchical", args->hierarchical);
  cmd->add_option("--seed", args->seed)->capture_default_str();
  cmd->add_option("--load", args->load_path,
                  "Place these loads (any `eplb plan --load` format; sets layers and experts) "
                  "instead of lognormal(0, 1) ones");
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
