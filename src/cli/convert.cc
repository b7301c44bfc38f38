// `eplb convert`: a recorded load distribution from one engine's format to another's.

#include <string>

#include <fmt/core.h>

#include "cli/commands.h"
#include "eplb/core/error.h"
#include "eplb/stats/load_file.h"

namespace eplb::cli {
namespace {

struct ConvertArgs {
  std::string input_path;
  std::string from = "auto";
  std::string to;
  int64_t experts = 0;
  std::string output_path = "-";
};

void run_convert(const ConvertArgs& args) {
  stats::LoadReadOptions read_options;
  read_options.format = stats::parse_load_format(args.from, "--from");
  if (args.experts < 0) fail("--experts ", args.experts, " must be positive");
  read_options.experts = args.experts;
  const stats::LoadFormat to = stats::parse_load_format(args.to, "--to");
  if (to == stats::LoadFormat::kAuto || to == stats::LoadFormat::kTrace) {
    fail("--to ", args.to, " is not a format loads can be written in (expected eplb, sglang, "
         "vllm or csv)");
  }
  const stats::LoadHistory history = stats::read_load_history(args.input_path, read_options);
  const std::string text = stats::format_load(history, to);
  if (args.output_path == "-") {
    fmt::print("{}", text);
    return;
  }
  stats::write_file(args.output_path, text);
  const bool summed = to == stats::LoadFormat::kCsv && history.steps > 1;
  fmt::print("wrote {}: {} -> {}, {} step{}{} x {} layers x {} experts\n", args.output_path,
             stats::load_format_name(history.format), stats::load_format_name(to), history.steps,
             history.steps == 1 ? "" : "s", summed ? " (summed into one)" : "", history.layers,
             history.experts);
}

}  // namespace

void add_convert(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Convert a load file between the formats of eplb, SGLang, vLLM and CSV");
  cmd->add_option("input", args->input_path,
                  "Load file: eplb JSON, SGLang logical_count JSON, vLLM load_history JSON, CSV "
                  "matrix or routing trace CSV")
      ->required();
  cmd->add_option("--from", args->from, "Input format: auto, eplb, sglang, vllm, csv, trace")
      ->capture_default_str();
  cmd->add_option("--to", args->to, "Output format: eplb, sglang, vllm or csv (csv sums steps)")
      ->required();
  cmd->add_option("--experts", args->experts,
                  "Logical experts per layer (default: as the file says; a trace: largest id + 1)");
  cmd->add_option("-o,--output", args->output_path, "Output file ('-': standard output)")
      ->capture_default_str();
  cmd->callback([args] { run_convert(*args); });
}

}  // namespace eplb::cli
