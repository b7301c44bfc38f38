// The shm backend's waiting path with more ranks than cores: ranks that arrive early spin,
// yield, then sleep on the futex word until the last one publishes the round. Random delays
// longer than the spin and yield phases send most waits to the futex; the checks are on the
// results (every rank gets the same, right values), never on timings. A killed or stopped peer
// must still be found while the others sleep. The 64-rank version runs with
// EPLB_CONTROL_LONG=1; the default suite runs 16 ranks.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "control/checks.h"
#include "control/harness.h"
#include "eplb/core/error.h"

namespace eplb::control::testing {
namespace {

constexpr std::uint32_t kSeed = 20240611;

bool long_tests() {
  const char* value = std::getenv("EPLB_CONTROL_LONG");
  return value != nullptr && std::string(value) == "1";
}

// Sleeps 0 to 2 ms, chosen by (seed, rank, iteration): different on every rank, the same on
// every run.
void random_delay(std::mt19937& rng) {
  std::uniform_int_distribution<int> pick(0, 9);
  const int which = pick(rng);
  if (which < 5) return;  // half the calls go at once
  std::this_thread::sleep_for(std::chrono::microseconds(200 * (which - 4) * (which - 4)));
}

int many_collectives(Communicator& comm, int iterations) {
  std::mt19937 rng(kSeed + static_cast<std::uint32_t>(comm.rank()));
  const std::int64_t n = comm.size();
  for (int i = 0; i < iterations; ++i) {
    random_delay(rng);
    std::vector<std::int64_t> values = {comm.rank(), i, -comm.rank(), 1, comm.rank() * i};
    const ReduceOp op = static_cast<ReduceOp>(i % 3);
    comm.all_reduce(values, op);
    switch (op) {
      case ReduceOp::kMin:
        EPLB_REQUIRE(values[0] == 0 && values[2] == -(n - 1), "seed ", kSeed, " iteration ", i);
        break;
      case ReduceOp::kMax:
        EPLB_REQUIRE(values[0] == n - 1 && values[2] == 0, "seed ", kSeed, " iteration ", i);
        break;
      case ReduceOp::kSum:
        EPLB_REQUIRE(values[0] == n * (n - 1) / 2 && values[3] == n &&
                         values[4] == i * n * (n - 1) / 2,
                     "seed ", kSeed, " iteration ", i);
        break;
    }
    EPLB_REQUIRE(values[1] == (op == ReduceOp::kSum ? i * n : i), "seed ", kSeed, " iteration ",
                 i);
    if (i % 7 == 0) {
      Bytes data;
      const int root = i % comm.size();
      if (comm.rank() == root) data.assign(static_cast<std::size_t>(i % 5), std::byte{7});
      comm.broadcast(data, root);
      EPLB_REQUIRE(data.size() == static_cast<std::size_t>(i % 5), "iteration ", i);
    }
    if (i % 11 == 0) comm.barrier();
  }
  return 0;
}

void expect_all_ok(const std::vector<RankExit>& exits) {
  for (const auto& exit : exits) EXPECT_TRUE(exit.ok()) << "seed " << kSeed << "\n" << describe(exits);
}

TEST(ShmStress, ManyRanksRandomDelays) {
  expect_all_ok(run_group(Group("shm", 16), [](Communicator& comm) {
    return many_collectives(comm, 120);
  }));
}

TEST(ShmStress, SixtyFourRanksRandomDelays) {
  if (!long_tests()) GTEST_SKIP() << "set EPLB_CONTROL_LONG=1 to run 64 ranks";
  expect_all_ok(run_group(Group("shm", 64), [](Communicator& comm) {
    return many_collectives(comm, 300);
  }));
}

// Back-to-back all-reduces with no delay: the fast path, where waiters rarely sleep and the
// publisher skips the wake-up, must never lose one.
TEST(ShmStress, ManyRanksBackToBack) {
  const int size = long_tests() ? 64 : 16;
  expect_all_ok(run_group(Group("shm", size), [](Communicator& comm) {
    for (int i = 0; i < 2000; ++i) {
      std::vector<std::int64_t> values = {1, i};
      comm.all_reduce(values, ReduceOp::kSum);
      EPLB_REQUIRE(values[0] == comm.size() && values[1] == std::int64_t{i} * comm.size(),
                   "iteration ", i);
    }
    return 0;
  }));
}

// The others are asleep on the futex when the victim dies: each must wake and report it,
// well before the timeout.
TEST(ShmStress, PeerKilledWhileOthersSleep) {
  const int size = long_tests() ? 64 : 16;
  const int victim = size / 2;
  const auto exits = run_group(Group("shm", size, std::chrono::milliseconds(20'000)),
                               [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == victim) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      raise(SIGKILL);
    }
    std::vector<std::int64_t> values = {1};
    try {
      comm.all_reduce(values, ReduceOp::kSum);
    } catch (const IoError& e) {  // found by looking: the timeout would give Timeout
      const std::string what = e.what();
      const std::string named = "rank " + std::to_string(victim);
      EPLB_REQUIRE(what.find("all_reduce") != std::string::npos, what);
      EPLB_REQUIRE(what.find(named + " (") != std::string::npos ||
                       what.find(named + " died") != std::string::npos,
                   what);
      return 0;
    }
    return 2;
  });
  for (const auto& exit : exits) {
    if (exit.rank == victim) {
      EXPECT_EQ(exit.signal, SIGKILL) << describe(exits);
    } else {
      EXPECT_TRUE(exit.ok()) << describe(exits);
    }
  }
}

// A stopped peer: the sleepers time out, with a Timeout naming it.
TEST(ShmStress, PeerStoppedWhileOthersSleep) {
  const int size = long_tests() ? 64 : 16;
  const int victim = size - 1;
  // The group's own timeout (connect, the first barrier) stays long; only the collective the
  // victim stops in has a short one, so a slow start on a loaded machine is not mistaken for it.
  const auto exits = run_group(Group("shm", size), [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == victim) raise(SIGSTOP);
    std::vector<std::int64_t> values = {1};
    try {
      comm.all_reduce(values, ReduceOp::kMin, std::chrono::milliseconds(1'500));
    } catch (const Timeout& e) {
      const std::string what = e.what();
      EPLB_REQUIRE(what.find("all_reduce") != std::string::npos, what);
      EPLB_REQUIRE(what.find(std::to_string(victim) + " (stopped") != std::string::npos, what);
      return 0;
    }
    return 2;
  });
  for (const auto& exit : exits) {
    if (exit.rank == victim) {
      EXPECT_TRUE(exit.killed_by_launcher) << describe(exits);
    } else {
      EXPECT_TRUE(exit.ok()) << describe(exits);
    }
  }
}

}  // namespace
}  // namespace eplb::control::testing
