#include "eplb/control/elastic.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <thread>

#include "control/child.h"
#include "eplb/core/error.h"

namespace eplb::control {

// In the shared mapping. Lock-free atomics of these sizes are address-free, so they work
// across processes.
struct MembershipBoard::Shared {
  // Writers (the launcher, members adding a seat) take `writing`; `seq` is odd while one
  // writes, so a reader retries a view taken across a change.
  std::atomic<int> writing{0};
  std::atomic<uint64_t> seq{0};
  std::atomic<int64_t> epoch{0};
  std::atomic<uint8_t> in_group[kMaxSeats];
  std::atomic<uint8_t> ready[kMaxSeats];
};

bool MembershipBoard::View::has(int32_t seat) const { return rank_of(seat) >= 0; }

int MembershipBoard::View::rank_of(int32_t seat) const {
  const auto it = std::lower_bound(seats.begin(), seats.end(), seat);
  return it != seats.end() && *it == seat ? static_cast<int>(it - seats.begin()) : -1;
}

MembershipBoard::MembershipBoard(int seats) : seats_(seats) {
  if (seats < 1 || seats > kMaxSeats) {
    fail("membership board: ", seats, " seats is outside [1, ", kMaxSeats, "]");
  }
  static_assert(std::atomic<int64_t>::is_always_lock_free);
  static_assert(std::atomic<uint8_t>::is_always_lock_free);
  void* at = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                  -1, 0);
  if (at == MAP_FAILED) {
    fail<IoError>("membership board: mmap of ", sizeof(Shared), " B failed: ",
                  std::strerror(errno));
  }
  shared_ = new (at) Shared();
  for (int s = 0; s < kMaxSeats; ++s) {
    shared_->in_group[s].store(s < seats ? 1 : 0);
    shared_->ready[s].store(0);
  }
}

MembershipBoard::~MembershipBoard() {
  if (shared_ != nullptr) munmap(shared_, sizeof(Shared));
}

namespace {

// The board's writers' lock: held for a few stores, by the launcher or a member (never by the
// process a run kills, which does not write the board).
class WriterLock {
 public:
  explicit WriterLock(std::atomic<int>& flag) : flag_(flag) {
    int expected = 0;
    while (!flag_.compare_exchange_weak(expected, 1, std::memory_order_acquire)) {
      expected = 0;
      std::this_thread::yield();
    }
  }
  ~WriterLock() { flag_.store(0, std::memory_order_release); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  std::atomic<int>& flag_;
};

}  // namespace

MembershipBoard::View MembershipBoard::view() const {
  for (;;) {
    const uint64_t before = shared_->seq.load(std::memory_order_acquire);
    if (before % 2 != 0) {
      std::this_thread::yield();
      continue;
    }
    View v;
    v.epoch = shared_->epoch.load(std::memory_order_acquire);
    for (int s = 0; s < seats_; ++s) {
      if (shared_->in_group[s].load(std::memory_order_acquire)) v.seats.push_back(s);
    }
    if (shared_->seq.load(std::memory_order_acquire) == before) return v;
  }
}

MembershipBoard::View MembershipBoard::wait_newer(int64_t seen,
                                                  std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto nap = std::chrono::microseconds(50);
  for (;;) {
    if (shared_->epoch.load(std::memory_order_acquire) > seen) return view();
    if (std::chrono::steady_clock::now() >= deadline) {
      fail<Timeout>("membership board: no new group after epoch ", seen, " within ",
                    timeout.count(), " ms (the launcher did not see a rank end)");
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(2000));
  }
}

void MembershipBoard::remove(int32_t seat) {
  EPLB_CHECK(seat >= 0 && seat < seats_, "membership board: seat ", seat, " is outside [0, ",
             seats_, ")");
  const WriterLock lock(shared_->writing);
  shared_->seq.fetch_add(1, std::memory_order_acq_rel);
  shared_->in_group[seat].store(0, std::memory_order_release);
  shared_->epoch.fetch_add(1, std::memory_order_acq_rel);
  shared_->seq.fetch_add(1, std::memory_order_acq_rel);
}

int64_t MembershipBoard::add(int32_t seat, int64_t expected) {
  EPLB_CHECK(seat >= 0 && seat < seats_, "membership board: seat ", seat, " is outside [0, ",
             seats_, ")");
  const WriterLock lock(shared_->writing);
  // Only the epoch it was asked of changes: another member made the change already, or the
  // group changed meanwhile (a seat lost), and then the members see that epoch first.
  if (shared_->epoch.load(std::memory_order_acquire) == expected) {
    shared_->seq.fetch_add(1, std::memory_order_acq_rel);
    shared_->in_group[seat].store(1, std::memory_order_release);
    shared_->epoch.fetch_add(1, std::memory_order_acq_rel);
    shared_->seq.fetch_add(1, std::memory_order_acq_rel);
  }
  return shared_->epoch.load(std::memory_order_acquire);
}

void MembershipBoard::set_ready(int32_t seat, bool ready) {
  EPLB_CHECK(seat >= 0 && seat < seats_, "membership board: seat ", seat, " is outside [0, ",
             seats_, ")");
  shared_->ready[seat].store(ready ? 1 : 0, std::memory_order_release);
}

bool MembershipBoard::ready(int32_t seat) const {
  return seat >= 0 && seat < seats_ && shared_->ready[seat].load(std::memory_order_acquire) != 0;
}

void MembershipBoard::wait_ready(int32_t seat, std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ready(seat)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      fail<Timeout>("membership board: the process for seat ", seat, " was not ready to join "
                    "within ", timeout.count(), " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

bool is_lost(const RankExit& exit) { return exit.signal != 0 && !exit.killed_by_launcher; }

std::vector<RankExit> fork_elastic(int seats,
                                   const std::function<int(int seat, bool joining)>& body,
                                   MembershipBoard& board,
                                   const std::function<bool(int seat)>& respawn,
                                   const ForkOptions& options) {
  EPLB_CHECK(seats >= 1 && seats == board.seats(), "fork_elastic: ", seats,
             " seats but the board has ", board.seats());
  if (seats > max_local_ranks()) {
    fail("ranks ", seats, " is more rank processes than this machine takes: at most ",
         max_local_ranks());
  }
  // Room for every seat's first process and as many replacements.
  const size_t slots = 2 * static_cast<size_t>(seats);
  const size_t error_bytes = slots * child::kErrorBytes;
  void* shared = mmap(nullptr, error_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                      -1, 0);
  if (shared == MAP_FAILED) {
    fail<IoError>("fork_elastic: mmap of ", error_bytes, " B failed: ", std::strerror(errno));
  }
  auto* errors = static_cast<char*>(shared);
  struct Unmap {
    void* at;
    size_t bytes;
    ~Unmap() { munmap(at, bytes); }
  } unmap{shared, error_bytes};
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  std::vector<RankExit> exits;
  std::vector<bool> running;

  const auto start_one = [&](int seat, bool joining) {
    const size_t i = exits.size();
    EPLB_CHECK(i < slots, "fork_elastic: more than ", slots, " processes started");
    RankExit e;
    e.rank = seat;
    const pid_t pid = fork();
    if (pid == 0) {
      child::run_child(seat, parent, [&] { return body(seat, joining); },
                        errors + i * child::kErrorBytes);
    }
    if (pid < 0) fail<IoError>("fork_elastic: fork of seat ", seat, " failed: ",
                               std::strerror(errno));
    e.pid = pid;
    exits.push_back(e);
    running.push_back(true);
  };
  const auto kill_running = [&] {
    for (size_t i = 0; i < exits.size(); ++i) {
      if (!running[i]) continue;
      kill(exits[i].pid, SIGKILL);
      int status = 0;
      while (waitpid(exits[i].pid, &status, 0) < 0 && errno == EINTR) {
      }
      running[i] = false;
      exits[i].killed_by_launcher = true;
      exits[i].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      exits[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
  };
  try {
    for (int s = 0; s < seats; ++s) start_one(s, false);
  } catch (...) {
    kill_running();
    throw;
  }

  const auto started = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> first_failure;
  auto nap = std::chrono::microseconds(50);
  for (;;) {
    bool any_running = false;
    for (size_t i = 0; i < exits.size(); ++i) {
      if (!running[i]) continue;
      int status = 0;
      const pid_t got = waitpid(exits[i].pid, &status, WNOHANG);
      if (got != exits[i].pid || !(WIFEXITED(status) || WIFSIGNALED(status))) {
        any_running = true;
        continue;
      }
      running[i] = false;
      exits[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      exits[i].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      nap = std::chrono::microseconds(50);
      board.set_ready(exits[i].rank, false);  // no process of that seat waits to join now
      if (is_lost(exits[i])) {
        // Lost: the group goes on without it, and maybe with a new process in its seat.
        board.remove(exits[i].rank);
        if (respawn && respawn(exits[i].rank)) {
          try {
            start_one(exits[i].rank, true);
            any_running = true;
          } catch (...) {
            kill_running();
            throw;
          }
        }
      } else if (exits[i].exit_code != 0 && !first_failure) {
        first_failure = std::chrono::steady_clock::now();
      }
    }
    if (!any_running) break;
    // Only replacements waiting to join are left (the group they wait for ended, say because it
    // stopped): nobody can add them any more.
    bool member_running = false;
    const MembershipBoard::View group = board.view();
    for (size_t i = 0; i < exits.size() && !member_running; ++i) {
      member_running = running[i] && group.has(exits[i].rank);
    }
    const auto now = std::chrono::steady_clock::now();
    if (!member_running || now - started >= options.timeout ||
        (first_failure && now - *first_failure >= options.grace)) {
      kill_running();
      break;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(2000));
  }
  for (size_t i = 0; i < exits.size(); ++i) {
    const char* slot = errors + i * child::kErrorBytes;
    exits[i].error.assign(slot, strnlen(slot, child::kErrorBytes));
  }
  return exits;
}

}  // namespace eplb::control
