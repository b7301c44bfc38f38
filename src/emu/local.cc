// `eplb run`'s rank processes: forked on this machine (run_local), or one per process under a
// launcher (run_from_env); Ctrl-C stops every rank at the same step.

#include "emu/emulator.h"
#include <fmt/core.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <sstream>
#include "emu/live_metrics.h"
#include "emu/serve.h"
#include "eplb/control/communicator.h"
#include "eplb/control/elastic.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "eplb/core/hash.h"
#include "eplb/core/memory.h"
#include "eplb/core/types.h"
#include "eplb/placement/policy.h"
#include "eplb/routing/dispatch.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"
#include "eplb/stats/recorder.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"
#include "emu/serve.h"

namespace eplb::emu {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

std::atomic<int>* g_stop = nullptr;  // shared with the ranks (MAP_SHARED), set by the handler

// A Ctrl-C at a terminal reaches the launcher and every rank at once: each process takes its
// first signal as "stop at the next step" (the flag is shared), and only a second one to the
// same process as "stop now" (forked ranks die with the launcher).
volatile sig_atomic_t g_stop_signals = 0;  // this process's

void on_stop_signal(int signal) {
  if (g_stop == nullptr) return;
  const int seen = g_stop_signals;
  g_stop_signals = seen + 1;
  if (seen > 0) {
    ::signal(signal, SIG_DFL);
    ::raise(signal);
    return;
  }
  g_stop->store(1);
}

std::string describe_failures(const std::vector<control::RankExit>& exits) {
  // The ranks that died or stopped on their own first, then those that failed with an error
  // (each distinct message once), then the ones that ended because of them.
  std::string died, others;
  std::vector<std::pair<std::string, std::vector<int>>> errors;  // message, ranks
  for (const control::RankExit& e : exits) {
    if (e.ok()) continue;
    const bool own = e.stopped || (!e.killed_by_launcher && e.signal != 0 && e.signal != SIGINT);
    if (!own && !e.error.empty()) {
      auto same = std::find_if(errors.begin(), errors.end(),
                               [&](const auto& m) { return m.first == e.error; });
      if (same == errors.end()) {
        errors.push_back({e.error, {e.rank}});
      } else {
        same->second.push_back(e.rank);
      }
      continue;
    }
    (own ? died : others) += ((own ? died : others).empty() ? "" : "; ") + e.describe();
  }
  std::string failed;
  for (const auto& [message, ranks] : errors) {
    std::string who = ranks.size() == 1 ? fmt::format("rank {}", ranks[0]) : "ranks ";
    for (size_t i = 0; ranks.size() > 1 && i < ranks.size(); ++i) {
      if (i == 3 && ranks.size() > 4) {
        who += fmt::format(" and {} more", ranks.size() - 3);
        break;
      }
      who += fmt::format("{}{}", i == 0 ? "" : ", ", ranks[i]);
    }
    failed += fmt::format("{}{} failed: {}", failed.empty() ? "" : "; ", who, message);
  }
  if (!died.empty()) {
    std::string then = failed;
    if (!others.empty()) then += (then.empty() ? "" : "; ") + others;
    const bool stopped = died.find("stopped (") != std::string::npos;
    return fmt::format("{}{}; the run stopped{}", died, stopped ? "" : " died",
                       then.empty() ? "" : " (then: " + then + ")");
  }
  if (!failed.empty()) return failed + (others.empty() ? "" : " (then: " + others + ")");
  return "ranks failed: " + others;
}

}  // namespace

RunResult run_local(const RunOptions& options, const Workload& workload) {
  options.validate(workload);
  if (options.ranks > control::max_local_ranks()) {
    fail("--ranks ", options.ranks, " is more rank processes than this machine takes: at most ",
         control::max_local_ranks(), " (", control::kMaxLocalRanks,
         ", fewer where the memory available or the process limit, ulimit -u, leave less room)");
  }
  options.check_resources(workload, options.ranks);
  const control::ScratchFolder scratch("eplb-run");
  const std::string& dir = scratch.path();

  // --metrics-port: the ranks write their families into the scratch folder, a server process
  // of its own serves them merged (live_metrics.h). Listening before the ranks fork (and
  // before the signal handlers): a port in use fails the run at once.
  RunOptions rank_options = options;
  std::unique_ptr<MetricsServerProcess> server;
  if (options.metrics_port > 0) {
    rank_options.live_metrics_dir = dir;
    server = std::make_unique<MetricsServerProcess>(options.metrics_port, dir, options.ranks);
  }

  // The stop flag lives in shared memory: a signal to the launcher or to any rank reaches all.
  void* shared = ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) fail<IoError>("mmap of the stop flag failed: ", std::strerror(errno));
  auto* stop = new (shared) std::atomic<int>(0);
  g_stop = stop;
  g_stop_signals = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);

  const std::string rendezvous = fmt::format("eplb-run-{}-{}-{}", ::getpid(), options.mode,
                                             Clock::now().time_since_epoch().count() % 1000000);
  control::ForkOptions fork_options;
  fork_options.timeout = std::chrono::hours(24);  // collectives time out on their own
  fork_options.grace = std::chrono::milliseconds(options.timeout_ms) + std::chrono::seconds(5);
  const auto start = Clock::now();
  std::vector<control::RankExit> exits;
  try {
    if (options.elastic()) {
      exits = run_elastic_ranks(rank_options, workload, rendezvous, dir, stop, fork_options);
    } else {
      exits = control::fork_ranks(
          options.ranks,
          [&](int rank) {
            control::Options o;
            o.rank = rank;
            o.size = options.ranks;
            o.rendezvous = rendezvous;
            o.timeout = std::chrono::milliseconds(options.timeout_ms);
            auto communicator = control::connect("shm", o);
            o.rendezvous = rendezvous + "-lockstep";
            o.group = "lockstep";
            auto lockstep = control::connect("shm", o);
            auto transport = make_transport(options, rank, rank);
            const std::string report =
                run_rank(rank_options, workload, *communicator, *lockstep, *transport, stop);
            std::ofstream(fmt::format("{}/rank{}.json", dir, rank)) << report;
            return 0;
          },
          fork_options);
    }
  } catch (...) {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    g_stop = nullptr;
    throw;
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_stop = nullptr;
  const bool stopped = stop->load() != 0;
  ::munmap(shared, sizeof(std::atomic<int>));

  // Elastic runs: one rule for a process that dies, fork_elastic's (control::is_lost): killed by
  // a signal the launcher did not send, it is lost, whether --kill-rank or someone outside eplb
  // killed it. A replacement the launcher ended because no group was left to add it never
  // joined: no failure of its own.
  std::vector<control::RankExit> lost, failed, never_joined;
  std::vector<bool> planned;
  for (size_t i = 0; i < exits.size(); ++i) {
    const control::RankExit& e = exits[i];
    const bool replacement = options.elastic() && i >= static_cast<size_t>(options.ranks);
    if (options.elastic() && control::is_lost(e)) {
      lost.push_back(e);
      // The process --kill-rank ends leaves its report before it dies; one killed from outside
      // has no time to.
      planned.push_back(!replacement && e.rank == options.kill_rank &&
                        std::filesystem::exists(fmt::format("{}/rank{}.json", dir, e.rank)));
    } else if (replacement && e.killed_by_launcher) {
      never_joined.push_back(e);
    } else if (!e.ok()) {
      failed.push_back(e);
    }
  }
  if (!failed.empty()) failed.insert(failed.end(), never_joined.begin(), never_joined.end());
  const std::string failure =
      failed.empty() ? std::string()
                     : describe_failures(failed) + (stopped ? " (after an interrupt)" : "");
  std::vector<std::string> reports;
  for (int rank = 0; rank < options.ranks; ++rank) {
    for (const char* suffix : {"", "-joined"}) {
      const std::string path = fmt::format("{}/rank{}{}.json", dir, rank, suffix);
      if (std::filesystem::exists(path)) reports.push_back(stats::read_file(path));
    }
  }
  // A run without --kill-rank stops at its first failure with no figures (docs/run.md); an
  // elastic one reports the steps its ranks served before saying why it stopped.
  // With no figures to print, the message names the ranks lost as well: a loss while the ranks
  // start (before any step) is what their failures follow from.
  const auto fail_without_figures = [&] {
    std::vector<control::RankExit> all = lost;
    all.insert(all.end(), failed.begin(), failed.end());
    fail<IoError>(describe_failures(all), stopped ? " (after an interrupt)" : "");
  };
  // An elastic run whose ranks served no step (a rank lost or failed while they started: in
  // connect(), filling the weights or the backup) still has a summary, like any elastic run
  // that stops: no step, the ranks lost named, and why.
  const auto nothing_served = [&] {
    RunResult r;
    r.mode = options.mode;
    for (const control::RankExit& e : lost) {
      r.lost.push_back({.rank = e.rank, .step = 0, .planned = false, .how = e.describe()});
    }
    r.kills = static_cast<int64_t>(r.lost.size());
    std::vector<control::RankExit> all = lost;
    all.insert(all.end(), failed.begin(), failed.end());
    r.stopped = describe_failures(all) + (stopped ? " (after an interrupt)" : "") +
                ", while the ranks were starting: no step was served (an elastic run survives "
                "only the ranks lost while serving)";
    r.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
    return r;
  };
  const bool lost_or_failed = !lost.empty() || !failed.empty();
  if (!failure.empty() && !options.elastic()) fail<IoError>(failure);
  if (reports.empty()) {
    if (options.elastic() && lost_or_failed) return nothing_served();
    if (!failure.empty()) fail_without_figures();
    fail<IoError>("eplb run: no rank left a report");
  }
  RunResult result;
  try {
    result = merge_reports(options, workload, reports);
  } catch (const Error&) {
    // No rank served from the first step on.
    if (options.elastic() && lost_or_failed) return nothing_served();
    if (!failure.empty()) fail_without_figures();
    throw;
  }
  // Name each lost process at the step its group went on without it (the reference's record,
  // in the order the seats were lost; a replacement lost before joining was seen by nobody).
  std::vector<LostRank> seen = std::move(result.lost);
  result.lost.clear();
  for (size_t i = 0; i < lost.size(); ++i) {
    LostRank l{.rank = lost[i].rank, .planned = planned[i], .how = lost[i].describe()};
    const auto at = std::find_if(seen.begin(), seen.end(),
                                 [&](const LostRank& s) { return s.rank == l.rank; });
    if (at != seen.end()) {
      l.step = at->step;
      seen.erase(at);
    }
    result.lost.push_back(std::move(l));
  }
  const auto order = [](const LostRank& l) { return l.step < 0 ? INT64_MAX : l.step; };
  std::stable_sort(result.lost.begin(), result.lost.end(),
                   [&](const LostRank& a, const LostRank& b) { return order(a) < order(b); });
  result.kills = static_cast<int64_t>(result.lost.size());
  if (!failure.empty()) result.stopped = failure;
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

RunResult run_from_env(RunOptions options, const Workload& workload) {
  const std::optional<control::LaunchInfo> info = control::launch_info_from_env();
  if (!info) {
    fail(
        "no launcher environment: set RANK and WORLD_SIZE (and EPLB_RENDEZVOUS), or start "
        "under mpirun");
  }
  options.ranks = info->size;
  if (info->local_size >= 1 && info->size % info->local_size == 0) {
    options.nodes = info->size / info->local_size;
  }
  options.progress = options.progress && info->rank == 0;
  if (options.elastic()) {
    fail("--kill-rank runs its ranks itself (eplb run without a launcher environment): under "
         "a launcher, the launcher's own elastic agent replaces ranks");
  }
  options.validate(workload);
  // --metrics-port: this rank serves its own registry, listening before the group forms, so
  // a port in use fails this rank before its peers wait for it.
  std::unique_ptr<MetricsServer> server;
  if (options.metrics_port > 0) {
    const int port = options.metrics_port + info->local_rank;
    if (port > 65535) {
      fail("--metrics-port ", options.metrics_port, " + local rank ", info->local_rank, " is ",
           port, ", past the last port 65535 (each rank serves on PORT + its local rank)");
    }
    options.registry = std::make_shared<prometheus::Registry>();
    server = std::make_unique<MetricsServer>(port, options.registry);
  }
  control::Options o;
  o.rank = info->rank;
  o.size = info->size;
  o.rendezvous = info->rendezvous;
  o.timeout = info->timeout;
  const auto start = Clock::now();
  auto communicator = control::connect(info->backend, o);
  o.group = "lockstep";
  auto lockstep = control::connect(info->backend, o);
  // One process per rank across machines: shared memory with the ranks of this machine, UCX
  // with the others.
  options.transport = options.transport_backend(/*launched=*/true);
  auto transport = transport::create(options.transport, transport::Options{.rank = info->rank});
  const std::string report =
      run_rank(options, workload, *communicator, *lockstep, *transport, nullptr);
  const auto bytes = std::as_bytes(std::span(report.data(), report.size()));
  const std::vector<control::Bytes> all = lockstep->all_gather(bytes);
  std::vector<std::string> reports;
  for (const control::Bytes& b : all) {
    reports.emplace_back(reinterpret_cast<const char*>(b.data()), b.size());
  }
  RunResult result = merge_reports(options, workload, reports);
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace eplb::emu
