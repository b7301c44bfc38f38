#pragma once
// The serving loop of one rank process and the group it serves with (emulator.cc), shared with
// the elastic launcher (elastic.cc).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/control/elastic.h"
#include "eplb/emu/emulator.h"
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
  std::string report_path;  // where the process --kill-rank ends leaves its report first
};

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

// One rank process's run (run_rank without elastic); returns its report as JSON text.
std::string serve(const RunOptions& options, const Workload& workload, Group group,
                  const ElasticContext* elastic, const std::atomic<int>* stop);

}  // namespace eplb::emu
