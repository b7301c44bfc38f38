#pragma once
// The verbs of the `eplb` command. Each adds its subcommand, options and callback to the app;
// a callback throws eplb::Error subclasses for failures, and main() turns them into messages
// and exit codes (2: invalid input, 1: runtime failure).

#include <CLI/CLI.hpp>

namespace eplb::cli {

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
