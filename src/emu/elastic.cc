// The elastic side of `eplb run` (--kill-rank, --rejoin-at-step; docs/elastic.md): the rank
// processes under fork_elastic, and the group each new membership builds.

#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu/serve.h"
#include "eplb/control/communicator.h"
#include "eplb/control/elastic.h"
#include "eplb/core/error.h"

namespace eplb::emu {

Group connect_group(const RunOptions& options, const std::string& rendezvous,
                    const control::MembershipBoard::View& view, int seat) {
  const int rank = view.rank_of(seat);
  EPLB_CHECK(rank >= 0, "seat ", seat, " is not in the group of epoch ", view.epoch);
  control::Options o;
  o.rank = rank;
  o.size = static_cast<int>(view.seats.size());
  o.rendezvous = fmt::format("{}-e{}", rendezvous, view.epoch);
  o.timeout = std::chrono::milliseconds(options.timeout_ms);
  Group g;
  g.own_communicator = control::connect("shm", o);
  o.rendezvous += "-lockstep";
  o.group = "lockstep";
  g.own_lockstep = control::connect("shm", o);
  g.own_transport = make_transport(options, rank, seat);
  g.communicator = g.own_communicator.get();
  g.lockstep = g.own_lockstep.get();
  g.transport = g.own_transport.get();
  g.seats = view.seats;
  g.epoch = view.epoch;
  return g;
}

void write_report(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".part";
  {
    std::ofstream out(temporary);
    out << text;
    if (!out.flush()) fail<IoError>("cannot write the rank's report to ", temporary);
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) fail<IoError>("cannot rename ", temporary, " to ", path, ": ", ec.message());
}

std::vector<std::pair<int, int64_t>> test_kills_from_env(const RunOptions& options) {
  std::vector<std::pair<int, int64_t>> kills;
  const char* value = std::getenv("EPLB_RUN_TEST_KILL");
  if (value == nullptr || *value == '\0') return kills;
  const auto bad = [&] {
    fail("EPLB_RUN_TEST_KILL='", value, "' is not SEAT:STEP[,SEAT:STEP...] with a seat in [0, ",
         options.ranks, ") and a step in [1, ", options.steps, ") or 'start' (a test's kill from "
         "outside; start: while the ranks start, before the group connects)");
  };
  std::stringstream list(value);
  std::string item;
  while (std::getline(list, item, ',')) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) bad();
    try {
      size_t used_seat = 0, used_step = 0;
      const int seat = std::stoi(item.substr(0, colon), &used_seat);
      const bool start = item.substr(colon + 1) == "start";
      const int64_t step = start ? kKillAtStart : std::stoll(item.substr(colon + 1), &used_step);
      if (used_seat != colon || (!start && used_step != item.size() - colon - 1)) bad();
      if (seat < 0 || seat >= options.ranks || (!start && (step < 1 || step >= options.steps))) {
        bad();
      }
      kills.emplace_back(seat, step);
    } catch (const std::logic_error&) {  // stoi's invalid_argument and out_of_range
      bad();
    }
  }
  if (kills.empty()) bad();
  return kills;
}

std::vector<control::RankExit> run_elastic_ranks(const RunOptions& options,
                                                 const Workload& workload,
                                                 const std::string& rendezvous,
                                                 const std::string& dir,
                                                 const std::atomic<int>* stop,
                                                 const control::ForkOptions& fork_options) {
  // Parsed here, in the launcher, so that a bad value fails the run before any fork.
  const std::vector<std::pair<int, int64_t>> outside_kills = test_kills_from_env(options);
  control::MembershipBoard board(options.ranks);
  bool respawned = false;
  const auto respawn = [&](int seat) {
    if (seat != options.kill_rank || options.rejoin_at_step < 0 || respawned) return false;
    respawned = true;
    return true;
  };
  return control::fork_elastic(
      options.ranks,
      [&](int seat, bool joining) {
        const std::string report =
            fmt::format("{}/rank{}{}.json", dir, seat, joining ? "-joined" : "");
        ElasticContext elastic{.board = &board, .rendezvous = rendezvous, .seat = seat,
                               .joining = joining, .report_path = report,
                               .outside_kills = outside_kills};
        // EPLB_RUN_TEST_KILL=SEAT:start: killed as from outside while the ranks start.
        if (!joining && std::find(outside_kills.begin(), outside_kills.end(),
                                  std::pair<int, int64_t>{seat, kKillAtStart}) !=
                            outside_kills.end()) {
          ::kill(::getpid(), SIGKILL);
        }
        Group group;
        if (!joining) group = connect_group(options, rendezvous, board.view(), seat);
        write_report(report, serve(options, workload, std::move(group), &elastic, stop));
        return 0;
      },
      board, respawn, fork_options);
}

}  // namespace eplb::emu
