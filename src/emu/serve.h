#pragma once
// The serving loop of one rank process (serve.cc) and the group it serves with (emulator.cc),
// shared with the elastic launcher (elastic.cc).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/control/elastic.h"
#include "emu/emulator.h"
#include "eplb/transport/transport.h"

namespace eplb::emu {

// The group a rank process serves with now: the runtime's communicator, the lockstep one (the
// all-to-alls' stand-in), the transport, and the seats of the members (ascending: member i is
// rank i of each). Owned here in elastic runs, where each new group replaces the last.
struct Group {
  control::Communicator* communicator = nullptr;
  control::Communicator* lockstep = nullptr;
  transport::Transport* transport = nullptr;
  std::vector<int32_t> seats;
  int64_t epoch = 0;  // the membership board's, elastic runs
  std::unique_ptr<control::Communicator> own_communicator, own_lockstep;
  std::unique_ptr<transport::Transport> own_transport;
};

// What an elastic rank process knows: the board, the launcher's rendezvous prefix, its seat,
// and whether it is a new process joining a running group.
struct ElasticContext {
  control::MembershipBoard* board = nullptr;
  std::string rendezvous;
  int seat = 0;
  bool joining = false;
  // Where this process leaves its report: the process --kill-rank ends, before it dies, and a
  // process that fails with an error, before it throws, so the steps they served still count.
  std::string report_path;
  // Testing (EPLB_RUN_TEST_KILL, docs/elastic.md): (seat, step) pairs at which a seat's first
  // process kills itself with SIGKILL without leaving a report, as a kill from outside eplb
  // does, at a step of the test's choosing (kKillAtStart: before the group connects).
  std::vector<std::pair<int, int64_t>> outside_kills;
};

// The step of an EPLB_RUN_TEST_KILL "SEAT:start": while the ranks start.
inline constexpr int64_t kKillAtStart = -1;

// Writes a rank process's report whole or not at all (a temporary file renamed into place): a
// process killed while it writes leaves no half report for the launcher to read.
void write_report(const std::string& path, const std::string& text);

// EPLB_RUN_TEST_KILL="SEAT:STEP[,SEAT:STEP...]" (STEP may be "start") read for `options`;
// empty when unset.
// InvalidArgument naming the variable for a malformed value or a seat or step out of the run.
std::vector<std::pair<int, int64_t>> test_kills_from_env(const RunOptions& options);

// The transport of rank `rank` of a group, for the process in `seat` (its emulated node).
std::unique_ptr<transport::Transport> make_transport(const RunOptions& options, int rank,
                                                     int seat);

// The group of `view` for the process in `seat`: shm communicators under a rendezvous named after
// the epoch, and a transport.
Group connect_group(const RunOptions& options, const std::string& rendezvous,
                    const control::MembershipBoard::View& view, int seat);

// The rank processes of an elastic run (--kill-rank): fork_elastic with a membership board, each
// process serving through serve() and leaving its report in `dir` (rank<seat>.json, or
// rank<seat>-joined.json for the process that took a seat back).
std::vector<control::RankExit> run_elastic_ranks(const RunOptions& options,
                                                 const Workload& workload,
                                                 const std::string& rendezvous,
                                                 const std::string& dir,
                                                 const std::atomic<int>* stop,
                                                 const control::ForkOptions& fork_options);

// One rank process's run (run_rank without elastic), phase by phase (serve.cc's RankServer);
// returns its report as JSON text.
std::string serve(const RunOptions& options, const Workload& workload, Group group,
                  const ElasticContext* elastic, const std::atomic<int>* stop);

}  // namespace eplb::emu
