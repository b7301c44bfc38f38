// Launching ranks: fork_ranks() and the torchrun-style environment.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

#include "control/checks.h"
#include "control/harness.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"

namespace eplb::control::testing {
namespace {

TEST(ControlForkRanks, CollectsExitCodes) {
  const auto exits = fork_ranks(4, [](int rank) { return rank * 10; });
  ASSERT_EQ(exits.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(exits[r].rank, r);
    EXPECT_EQ(exits[r].exit_code, r * 10) << exits[r].describe();
    EXPECT_FALSE(exits[r].killed_by_launcher);
  }
  EXPECT_THROW(check_all_ok(exits), IoError);
}

TEST(ControlForkRanks, ExceptionIsExitCodeOne) {
  const auto exits = fork_ranks(2, [](int rank) -> int {
    if (rank == 1) throw std::runtime_error("rank 1 fails on purpose");
    return 0;
  });
  EXPECT_TRUE(exits[0].ok());
  EXPECT_EQ(exits[1].exit_code, 1);
}

TEST(ControlForkRanks, KillsTheRestWhenOneDies) {
  ForkOptions options;
  options.grace = std::chrono::milliseconds(50);
  const auto exits = fork_ranks(3, [](int rank) {
    if (rank == 0) raise(SIGKILL);
    pause();  // would wait forever
    return 0;
  }, options);
  EXPECT_EQ(exits[0].signal, SIGKILL);
  EXPECT_FALSE(exits[0].killed_by_launcher);
  for (int r = 1; r < 3; ++r) {
    EXPECT_TRUE(exits[r].killed_by_launcher) << exits[r].describe();
    EXPECT_EQ(exits[r].signal, SIGKILL);
  }
}

TEST(ControlForkRanks, TimeoutKillsEveryone) {
  ForkOptions options;
  options.timeout = std::chrono::milliseconds(100);
  const auto exits = fork_ranks(2, [](int) {
    pause();
    return 0;
  }, options);
  for (const auto& exit : exits) {
    EXPECT_TRUE(exit.killed_by_launcher);
    EXPECT_EQ(exit.signal, SIGKILL);
  }
}

TEST(ControlForkRanks, StoppedRankIsKilledOnceTheOthersAreDone) {
  const auto exits = fork_ranks(2, [](int rank) {
    if (rank == 1) raise(SIGSTOP);
    return 0;
  });
  EXPECT_TRUE(exits[0].ok());
  EXPECT_TRUE(exits[1].killed_by_launcher);
}

class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    clear();
    for (const auto& [name, value] : vars) setenv(name, value, 1);
  }
  ~ScopedEnv() { clear(); }

 private:
  static void clear() {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "EPLB_RENDEZVOUS", "EPLB_CONTROL_BACKEND",
                             "EPLB_CONTROL_TIMEOUT_MS"}) {
      unsetenv(name);
    }
  }
};

TEST(ControlLaunchEnv, NothingSetIsNullopt) {
  if (launched_by_mpirun()) GTEST_SKIP() << "running under mpirun";
  ScopedEnv env({});
  EXPECT_FALSE(launch_info_from_env().has_value());
  EXPECT_THROW(connect_from_env(), InvalidArgument);
}

TEST(ControlLaunchEnv, TorchrunVariables) {
  if (launched_by_mpirun()) GTEST_SKIP() << "running under mpirun";
  ScopedEnv env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "2"}, {"EPLB_RENDEZVOUS", "/some/folder"},
                 {"EPLB_CONTROL_TIMEOUT_MS", "1500"}});
  const auto info = launch_info_from_env();
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_size, 2);
  EXPECT_EQ(info->rendezvous, "/some/folder");
  EXPECT_EQ(info->backend, "gloo");
  EXPECT_EQ(info->timeout, std::chrono::milliseconds(1500));
}

TEST(ControlLaunchEnv, BadValuesNameTheVariable) {
  if (launched_by_mpirun()) GTEST_SKIP() << "running under mpirun";
  const auto message = [] {
    try {
      launch_info_from_env();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {
    ScopedEnv env({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"EPLB_RENDEZVOUS", "x"}});
    EXPECT_NE(message().find("RANK=4"), std::string::npos) << message();
  }
  {
    ScopedEnv env({{"RANK", "zero"}, {"WORLD_SIZE", "4"}});
    EXPECT_NE(message().find("RANK='zero'"), std::string::npos) << message();
  }
  {
    ScopedEnv env({{"RANK", "0"}});
    EXPECT_NE(message().find("WORLD_SIZE"), std::string::npos) << message();
  }
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
    EXPECT_NE(message().find("EPLB_RENDEZVOUS"), std::string::npos) << message();
  }
}

TEST(ControlLaunchEnv, ForkedRanksConnectFromEnvironment) {
  if (launched_by_mpirun()) GTEST_SKIP() << "running under mpirun";
  const std::string name = unique_name("env");
  const auto exits = fork_ranks(3, [&](int rank) {
    const std::string rank_text = std::to_string(rank);
    ScopedEnv env({{"RANK", rank_text.c_str()}, {"WORLD_SIZE", "3"},
                   {"EPLB_RENDEZVOUS", name.c_str()}, {"EPLB_CONTROL_BACKEND", "shm"}});
    auto comm = connect_from_env();
    check_all_reduce(*comm);
    return comm->rank() == rank ? 0 : 2;
  });
  for (const auto& exit : exits) EXPECT_TRUE(exit.ok()) << describe(exits);
}

TEST(ControlRegistry, UnknownBackendListsTheBuiltOnes) {
  try {
    connect("carrier-pigeon", Options{});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("inproc, shm"), std::string::npos) << e.what();
  }
}

TEST(ControlRegistry, BadRankAndRoot) {
  Options options;
  options.rank = 2;
  options.size = 2;
  options.rendezvous = "x";
  EXPECT_THROW(connect("inproc", options), InvalidArgument);
  options.rank = 0;
  options.size = 1;
  options.rendezvous = unique_name("root");
  auto comm = connect("inproc", options);
  Bytes data;
  EXPECT_THROW(comm->broadcast(data, 1), InvalidArgument);
  EXPECT_FALSE(comm->broken());
  comm->barrier();
}

TEST(ControlRegistry, ShmJoinTimesOutWithoutPeers) {
  Options options;
  options.rank = 1;
  options.size = 2;
  options.rendezvous = unique_name("alone");
  options.timeout = std::chrono::milliseconds(50);
  try {
    connect("shm", options);
    FAIL() << "no error";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace eplb::control::testing
