// One conformance suite for every built control backend x world sizes 1, 2, 3, 4, 8:
// inproc ranks are threads, the others forked processes. mpi runs under mpirun (mpi_test.cc).

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <tuple>

#include "control/checks.h"
#include "control/harness.h"
#include "eplb/core/error.h"

namespace eplb::control::testing {
namespace {

using Param = std::tuple<std::string, int>;

std::vector<std::string> forkable_backends() {
  std::vector<std::string> out;
  for (const auto& name : backend_names()) {
    if (name != "mpi") out.push_back(name);
  }
  return out;
}

class ControlConformance : public ::testing::TestWithParam<Param> {
 protected:
  const std::string& backend() const { return std::get<0>(GetParam()); }
  int size() const { return std::get<1>(GetParam()); }

  void expect_all_ok(const std::function<int(Communicator&)>& body) {
    const auto exits = run_group(Group(backend(), size()), body);
    for (const auto& exit : exits) EXPECT_TRUE(exit.ok()) << describe(exits);
  }
};

TEST_P(ControlConformance, Identity) {
  expect_all_ok([&](Communicator& comm) {
    check_identity(comm, backend(), size());
    return 0;
  });
}

TEST_P(ControlConformance, Barrier) {
  expect_all_ok([](Communicator& comm) {
    check_barrier(comm);
    return 0;
  });
}

TEST_P(ControlConformance, AllReduceMinMaxSum) {
  expect_all_ok([](Communicator& comm) {
    check_all_reduce(comm);
    check_all_reduce_large(comm);
    return 0;
  });
}

TEST_P(ControlConformance, Broadcast) {
  expect_all_ok([](Communicator& comm) {
    check_broadcast(comm);
    return 0;
  });
}

TEST_P(ControlConformance, AllGather) {
  expect_all_ok([](Communicator& comm) {
    check_all_gather(comm);
    return 0;
  });
}

TEST_P(ControlConformance, UsedFromAnotherThread) {
  expect_all_ok([](Communicator& comm) {
    check_from_another_thread(comm);
    return 0;
  });
}

TEST_P(ControlConformance, ManyInARow) {
  expect_all_ok([](Communicator& comm) {
    check_many_in_a_row(comm);
    return 0;
  });
}

TEST_P(ControlConformance, MismatchedCallsAreReported) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  if (backend() != "inproc" && backend() != "shm") {
    GTEST_SKIP() << backend() << " does not check that ranks agree on the call";
  }
  expect_all_ok([](Communicator& comm) {
    std::vector<std::int64_t> values(comm.rank() == 0 ? 4 : 5, 1);
    try {
      comm.all_reduce(values, ReduceOp::kSum);
    } catch (const IoError& e) {
      const std::string what = e.what();
      EPLB_REQUIRE(what.find("all_reduce(sum, 5 values)") != std::string::npos, what);
      EPLB_REQUIRE(comm.broken());
      return 0;
    }
    return 2;
  });
}

// A rank that dies during a collective: every survivor fails within the timeout, with an error
// that names the collective; its next call fails at once.
TEST_P(ControlConformance, KilledRankFailsEverySurvivor) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  const int victim = size() - 1;
  const auto exits = run_group(Group(backend(), size(), std::chrono::milliseconds(3'000)),
                               [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == victim) {
      if (comm.backend() == "inproc") return 0;  // a thread "dies" by leaving the group
      raise(SIGKILL);
    }
    std::vector<std::int64_t> values = {1, 2, 3, 4};
    try {
      comm.all_reduce(values, ReduceOp::kSum);
    } catch (const Error& e) {
      const std::string what = e.what();
      std::fprintf(stderr, "rank %d got: %s\n", comm.rank(), e.what());
      EPLB_REQUIRE(dynamic_cast<const IoError*>(&e) || dynamic_cast<const Timeout*>(&e), what);
      EPLB_REQUIRE(what.find("all_reduce") != std::string::npos, what);
      // Later collectives fail too, never hang: IoError, or Timeout where a loaded machine let
      // the first one time out before the death was seen.
      try {
        comm.barrier();
      } catch (const IoError& again) {
        return 0;
      } catch (const Timeout& again) {
        return 0;
      }
      return 3;
    }
    return 2;  // no error: the dead rank was not noticed
  });
  for (const auto& exit : exits) {
    if (exit.rank == victim && backend() != "inproc") {
      EXPECT_EQ(exit.signal, SIGKILL) << describe(exits);
    } else {
      EXPECT_TRUE(exit.ok()) << describe(exits);
    }
  }
}

// A rank that stops (SIGSTOP) gives the survivors a Timeout, not a hang. With gloo a survivor
// may instead see another survivor's socket close once that one timed out (IoError).
TEST_P(ControlConformance, StoppedRankTimesOut) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  const int victim = size() - 1;
  std::atomic<int> finished{0};  // inproc only: survivors done
  const auto exits = run_group(Group(backend(), size(), std::chrono::milliseconds(1'000)),
                               [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == victim) {
      if (comm.backend() != "inproc") raise(SIGSTOP);
      while (finished.load() < comm.size() - 1) std::this_thread::yield();
      return 0;
    }
    std::vector<std::int64_t> values = {1, 2, 3, 4};
    int code = 2;
    try {
      comm.all_reduce(values, ReduceOp::kMax);
    } catch (const Timeout& e) {
      code = std::string(e.what()).find("all_reduce") != std::string::npos ? 0 : 3;
    } catch (const IoError& e) {
      code = std::string(e.what()).find("all_reduce") != std::string::npos ? 4 : 3;
    }
    finished.fetch_add(1);
    return code;
  });
  int timeouts = 0;
  for (const auto& exit : exits) {
    if (exit.rank == victim) {
      if (backend() != "inproc") {
        EXPECT_TRUE(exit.killed_by_launcher) << describe(exits);
      }
      continue;
    }
    EXPECT_EQ(exit.signal, 0) << describe(exits);
    if (backend() == "gloo") {
      EXPECT_TRUE(exit.exit_code == 0 || exit.exit_code == 4) << describe(exits);
    } else {
      EXPECT_EQ(exit.exit_code, 0) << describe(exits);
    }
    timeouts += exit.exit_code == 0;
  }
  EXPECT_GE(timeouts, 1) << describe(exits);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, ControlConformance,
    ::testing::Combine(::testing::ValuesIn(forkable_backends()), ::testing::Values(1, 2, 3, 4, 8)),
    [](const ::testing::TestParamInfo<Param>& param) {
      return std::get<0>(param.param) + "_" + std::to_string(std::get<1>(param.param)) + "ranks";
    });

}  // namespace
}  // namespace eplb::control::testing
