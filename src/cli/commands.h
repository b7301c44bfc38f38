#pragma once
// The verbs of the `eplb` command. Each adds its subcommand, options and callback to the app;
// a callback throws eplb::Error subclasses for failures, and main() turns them into messages
// and exit codes (2: invalid input, 1: runtime failure).

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace eplb::cli {

// --seed of every verb: the digits of an unsigned 64-bit integer. Without the check CLI11 reads
// "-1" as 2^64 - 1 and "010" as 8, and the run goes on with a seed the user never chose.
inline CLI::Option* add_seed_option(CLI::App* cmd, uint64_t& seed, const std::string& help) {
  return cmd->add_option("--seed", seed, help)
      ->check(CLI::Validator(
          [](const std::string& text) -> std::string {
            const std::string most = "18446744073709551615";
            // Digits only, no leading zero (CLI11 would read "010" as octal 8).
            const bool digits = !text.empty() &&
                                text.find_first_not_of("0123456789") == std::string::npos &&
                                (text == "0" || text[0] != '0');
            if (!digits || text.size() > most.size() ||
                (text.size() == most.size() && text > most)) {
              return text + " is not a seed (expected an integer from 0 to 18446744073709551615)";
            }
            return {};
          },
          "SEED"))
      ->capture_default_str();
}

void add_plan(CLI::App& app);          // plan.cc
void add_migrate_plan(CLI::App& app);  // migrate_plan.cc
void add_simulate(CLI::App& app);  // simulate.cc
void add_bench(CLI::App& app);         // bench.cc: the `bench` verb, calls the add_bench_* below
void add_run(CLI::App& app);  // run.cc
void add_convert(CLI::App& app);  // convert.cc

void add_bench_placement(CLI::App& bench);  // bench.cc
void add_bench_migration(CLI::App& bench);  // migrate_plan.cc
void add_bench_transport(CLI::App& bench);  // bench_transport.cc
void add_bench_control(CLI::App& bench);    // bench_control.cc
void add_bench_runtime(CLI::App& bench);    // bench_runtime.cc

}  // namespace eplb::cli
