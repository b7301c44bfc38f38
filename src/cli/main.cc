// eplb: the command-line front end. Every verb lives in its own file (commands.h).

#include <algorithm>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "eplb/config.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"

namespace {

// The verbs given so far ("run", "bench placement"): the subcommands CLI11 had entered when
// parsing stopped.
std::vector<const CLI::App*> verb_chain(const CLI::App& app) {
  std::vector<const CLI::App*> chain;
  for (const CLI::App* at = &app; !at->get_subcommands().empty();) {
    at = at->get_subcommands().back();
    chain.push_back(at);
  }
  return chain;
}

// What an option holds, for "is not ..." (CLI11's type names: INT, UINT, FLOAT, TEXT).
std::string type_words(const std::string& type) {
  const std::string head = type.substr(0, type.find(':'));
  if (head == "INT") return "an integer";
  if (head == "UINT") return "a non-negative integer";
  if (head == "FLOAT") return "a number";
  return "a " + (head.empty() ? std::string("value") : head);
}

bool looks_integer(std::string_view text) {
  if (!text.empty() && (text.front() == '-' || text.front() == '+')) text.remove_prefix(1);
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
}

// CLI11's message, said the way the rest of the CLI says errors: the option, the value and
// what would be right. Messages CLI11 words well enough already ("input is required", a
// validator's) are kept; each ends with where the options are listed.
std::string parse_error_message(const CLI::App& app, const CLI::ParseError& e) {
  const std::vector<const CLI::App*> chain = verb_chain(app);
  std::string verbs = "eplb";
  for (const CLI::App* sub : chain) verbs += " " + sub->get_name();
  // The option by its name, looked up from the innermost verb out.
  const auto find_option = [&](const std::string& name) -> const CLI::Option* {
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      if (const CLI::Option* opt = (*it)->get_option_no_throw(name)) return opt;
    }
    return app.get_option_no_throw(name);
  };
  std::string what = e.what();
  // A validator's message that names its option itself ("--cost: --cost '' is empty ..."):
  // CLI11's prefix once is enough.
  if (const size_t colon = what.find(": "); colon != std::string::npos && colon > 0) {
    const std::string head = what.substr(0, colon);
    if (what.compare(colon + 2, head.size() + 1, head + " ") == 0) what.erase(0, colon + 2);
  }
  constexpr std::string_view kConvert = "Could not convert: ";
  constexpr std::string_view kExtra = "The following argument was not expected: ";
  constexpr std::string_view kExtras = "The following arguments were not expected: ";
  constexpr std::string_view kMissing = " required ";
  if (what.starts_with(kConvert) && what.find(" = ") != std::string::npos) {
    // "Could not convert: --steps = abc"
    const size_t eq = what.find(" = ");
    const std::string name = what.substr(kConvert.size(), eq - kConvert.size());
    const std::string value = what.substr(eq + 3);
    const CLI::Option* opt = find_option(name);
    const std::string type = opt != nullptr ? opt->get_type_name() : std::string();
    const bool integer = type.starts_with("INT") || type.starts_with("UINT");
    if (integer && looks_integer(value) && !(type.starts_with("UINT") && value[0] == '-')) {
      what = fmt::format("{} {} is out of the range of the integer the option holds", name,
                         value);
    } else {
      what = fmt::format("{} {} is not {}", name, value.empty() ? "''" : value,
                         opt != nullptr ? type_words(type) : "a valid value");
    }
  } else if (what.starts_with(kExtra) || what.starts_with(kExtras)) {
    // CLI11 lists them last first.
    const size_t from = what.starts_with(kExtra) ? kExtra.size() : kExtras.size();
    std::vector<std::string> args;
    for (size_t i = from; i < what.size();) {
      const size_t end = std::min(what.find(' ', i), what.size());
      args.push_back(what.substr(i, end - i));
      i = end + 1;
    }
    std::reverse(args.begin(), args.end());
    what = fmt::format("unexpected argument{} {} for '{}'", args.size() == 1 ? "" : "s",
                       fmt::join(args, " "), verbs);
  } else if (const size_t req = what.find(kMissing);
             req != std::string::npos && what.ends_with(" missing") && req > 2 &&
             what.compare(0, 2, "--") == 0) {
    // "--spread: 1 required FLOAT missing"
    const size_t colon = what.find(": ");
    if (colon != std::string::npos && colon < req) {
      const std::string name = what.substr(0, colon);
      const std::string count = what.substr(colon + 2, req - colon - 2);
      const std::string type =
          what.substr(req + kMissing.size(), what.size() - req - kMissing.size() - 8);
      what = count == "1" ? fmt::format("{} needs a value ({})", name, type_words(type))
                          : fmt::format("{} needs {} values ({})", name, count, type_words(type));
    }
  } else if (what == "A subcommand is required") {
    // "eplb", "eplb bench" or "eplb bench nope": the verbs that exist at that level.
    const CLI::App& at = chain.empty() ? app : *chain.back();
    std::string names;
    for (const CLI::App* sub : at.get_subcommands({})) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    const std::vector<std::string> rest = app.remaining(true);
    if (rest.empty()) {
      what = fmt::format("'{}' needs a command ({})", verbs, names);
    } else if (rest.front().starts_with("-")) {
      what = fmt::format("unexpected argument {} for '{}', which needs a command first ({})",
                         rest.front(), verbs, names);
    } else {
      what = fmt::format("unknown command '{}' (expected {})", rest.front(), names);
    }
  }
  return fmt::format("{}; see '{} --help'", what, verbs);
}

// An empty value ('') is never what an option of this CLI means: leaving the option out gives
// its default, which '' would otherwise give silently too (`simulate --cost ''` ran without a
// cost model, `run --trace ''` on the bundled loads). Every option that takes text refuses it.
void refuse_empty_values(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    if (option->get_expected_max() == 0 || !option->get_type_name().starts_with("TEXT")) continue;
    const std::string name = option->get_name();
    option->check(CLI::Validator(
        [name](const std::string& value) -> std::string {
          if (!value.empty()) return {};
          return name + " '' is empty: give a value, or leave the option out for its default";
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands({})) refuse_empty_values(*sub);
}

}  // namespace

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
  refuse_empty_values(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version: CLI11 prints them and exits 0. Any other parse error is a user
    // error like every other: "eplb: error:" and exit 2 (CLI11's own codes are 104-114).
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    fmt::print(stderr, "eplb: error: {}\n", parse_error_message(app, e));
    return 2;
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
