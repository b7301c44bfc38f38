// The elastic side of `eplb run` (--kill-rank, --rejoin-at-step; docs/elastic.md): the rank
// processes under fork_elastic, and the group each new membership builds.

#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <fstream>
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

std::vector<control::RankExit> run_elastic_ranks(const RunOptions& options,
                                                 const Workload& workload,
                                                 const std::string& rendezvous,
                                                 const std::string& dir,
                                                 const std::atomic<int>* stop,
                                                 const control::ForkOptions& fork_options) {
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
                               .joining = joining, .report_path = report};
        Group group;
        if (!joining) group = connect_group(options, rendezvous, board.view(), seat);
        std::ofstream(report) << serve(options, workload, std::move(group), &elastic, stop);
        return 0;
      },
      board, respawn, fork_options);
}

}  // namespace eplb::emu
