#pragma once
// Elastic forked ranks (docs/elastic.md): what `eplb run --kill-rank` and the kill tests use to
// lose a rank process and go on, and to start a new process for a lost seat later.
//
// A seat is a rank of the layout; a group is the seats that serve now. The launcher keeps a
// MembershipBoard in memory shared with the processes it forks: an epoch, bumped at every change
// of the group, and the seats of the group at that epoch. After a failure the survivors wait for
// the epoch that drops the lost seat (the launcher bumps it when it sees the process die), then
// build their new communicators and transport under a rendezvous named after the epoch, and call
// Rebalancer::reconfigure with the board's seats. A replacement process waits for the epoch that
// lists its seat; the members add it (add()) at a step they agree on.
//
// The board lives in an anonymous shared mapping made before the forks: every method may be
// called from any process and thread. Writers (the launcher removing a seat, members adding
// one) take a spin lock and make a sequence counter odd while they change the seats and the
// epoch; a reader retries a view taken while it was odd or across a change, so it never sees
// a half-made change.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "eplb/control/launch.h"

namespace eplb::control {

class MembershipBoard {
 public:
  static constexpr int kMaxSeats = 4096;

  struct View {
    int64_t epoch = 0;
    std::vector<int32_t> seats;  // the group, ascending
    bool has(int32_t seat) const;
    int rank_of(int32_t seat) const;  // its rank in the group, -1 if absent
  };

  // `seats` seats, all in the group at epoch 0. InvalidArgument beyond kMaxSeats.
  explicit MembershipBoard(int seats);
  ~MembershipBoard();
  MembershipBoard(const MembershipBoard&) = delete;
  MembershipBoard& operator=(const MembershipBoard&) = delete;

  int seats() const { return seats_; }
  View view() const;
  // Waits for an epoch after `seen` and returns its view; Timeout naming what it waited for.
  View wait_newer(int64_t seen, std::chrono::milliseconds timeout) const;

  // The launcher: `seat` left the group (its process died); the epoch moves on.
  void remove(int32_t seat);
  // A member: `seat` joins the group, if the epoch is still `expected` (every member of the
  // group may call it for the same change: one of them makes it; if the group changed
  // meanwhile nothing is added). Returns the epoch now.
  int64_t add(int32_t seat, int64_t expected);

  // A replacement process says it is up and waiting to join; members wait for that.
  void set_ready(int32_t seat, bool ready);
  bool ready(int32_t seat) const;
  void wait_ready(int32_t seat, std::chrono::milliseconds timeout) const;

 private:
  struct Shared;
  int seats_ = 0;
  Shared* shared_ = nullptr;
};

// The one rule of elastic runs for a process that dies: ended by a signal the launcher did not
// send (is_lost), it is lost, whoever sent the signal (the run's own --kill-rank, an operator's
// kill -9, the kernel's OOM killer): the group goes on without it. Anything else that is not a
// clean exit (an exit code, or a kill by the launcher) is a failure.
bool is_lost(const RankExit& exit);

// Forks one process per seat, body(seat, false), like fork_ranks; but a process that is lost
// (is_lost) does not end the run: the launcher removes its seat from `board` and, if
// respawn(seat) says so, forks a replacement at once, body(seat, true). A process that exits
// with an error still ends the run (its peers get `grace`, then are killed), as do the timeout
// and a launcher that dies. A replacement still waiting to join when no process of the group
// runs any more (the board lists none of the running processes' seats) is killed
// (killed_by_launcher): nothing is left to add it. Returns one RankExit per process ever
// started, in order of start (RankExit::rank is the seat), once every process has ended.
std::vector<RankExit> fork_elastic(int seats, const std::function<int(int seat, bool joining)>& body,
                                   MembershipBoard& board,
                                   const std::function<bool(int seat)>& respawn,
                                   const ForkOptions& options = {});

}  // namespace eplb::control
