// eplb: the command-line front end. Every verb lives in its own file (commands.h).

#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cli/commands.h"
#include "eplb/config.h"
#include "eplb/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"eplb: an expert-parallel load balancer for Mixture-of-Experts inference"};
  app.set_version_flag("--version", EPLB_VERSION);
  app.require_subcommand(1);
  eplb::cli::add_plan(app);
  eplb::cli::add_migrate_plan(app);
  eplb::cli::add_run(app);
  eplb::cli::add_simulate(app);
  eplb::cli::add_bench(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const eplb::InvalidArgument& e) {
    fmt::print(stderr, "eplb: error: {}\n", e.what());
    return 2;
  } catch (const eplb::Error& e) {
    fmt::print(stderr, "eplb: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "eplb: internal error: {}\n", e.what());
    return 70;
  }
  return 0;
}
