// eplb: the command-line front end. Every verb lives in its own file (commands.h).

#include <cstdio>
#include <exception>
#include <new>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "eplb/config.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"

int main(int argc, char** argv) {
#if defined(__GLIBC__)
  // A placement's tables are a few MiB per call ([layers][experts][most replicas] int32:
  // 6 MiB at 61 x 384 experts on 64 ranks). Above glibc's mmap threshold each call mapped fresh
  // pages and faulted on every one of them (about 870 faults, 3 ms, per call there on a VM,
  // more than the placement itself) until glibc's own threshold had grown past them a few calls
  // later. Fixed thresholds keep such buffers in the heap, reused from one call (or one
  // rebalance) to the next; larger ones are still mapped and given back when freed.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  // Logs (the runtime's rebalances, the watchdog's warnings) go to standard error: standard
  // output is the commands' own (--json prints one object there, which a log line would break).
  spdlog::set_default_logger(spdlog::stderr_color_mt("eplb"));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  CLI::App app{"eplb: an expert-parallel load balancer for Mixture-of-Experts inference"};
  app.set_version_flag("--version", EPLB_VERSION);
  app.require_subcommand(1);
  eplb::cli::add_plan(app);
  eplb::cli::add_migrate_plan(app);
  eplb::cli::add_run(app);
  eplb::cli::add_simulate(app);
  eplb::cli::add_convert(app);
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
  } catch (const std::bad_alloc&) {
    // Inputs are checked against the memory they will need before anything large is sized;
    // this is what is left when a step past those checks still finds too little.
    fmt::print(stderr,
               "eplb: error: out of memory ({} available to this process): the inputs or "
               "options need more than that; give smaller ones or raise the limit (ulimit -v)\n",
               eplb::human_bytes(eplb::memory_available()));
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "eplb: internal error: {}\n", e.what());
    return 70;
  }
  return 0;
}
