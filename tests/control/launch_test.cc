// Launching ranks: fork_ranks(), fork_elastic() and the torchrun-style environment.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <stdexcept>
#include <vector>

#include "control/checks.h"
#include "control/harness.h"
#include "eplb/control/elastic.h"
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
  // The launcher has the rank's message, not only its exit code.
  EXPECT_EQ(exits[1].error, "rank 1 fails on purpose");
  EXPECT_NE(exits[1].describe().find("exit code 1: rank 1 fails on purpose"), std::string::npos)
      << exits[1].describe();
  EXPECT_TRUE(exits[0].error.empty());
  try {
    check_all_ok(exits);
    ADD_FAILURE() << "check_all_ok accepted a failed rank";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 fails on purpose"), std::string::npos) << e.what();
  }
}

TEST(ControlForkRanks, LongErrorIsCutNotLost) {
  const auto exits =
      fork_ranks(1, [](int) -> int { throw InvalidArgument(std::string(10000, 'x')); });
  EXPECT_EQ(exits[0].exit_code, 1);
  EXPECT_GT(exits[0].error.size(), 1000u);
  EXPECT_LT(exits[0].error.size(), 10000u);
}

TEST(ControlForkRanks, TooManyRanksFailBeforeAnyFork) {
  EXPECT_GE(max_local_ranks(), 1);
  EXPECT_LE(max_local_ranks(), kMaxLocalRanks);
  bool forked = false;
  try {
    fork_ranks(100000, [&](int) {
      forked = true;
      return 0;
    });
    ADD_FAILURE() << "100000 ranks were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 100000 is more rank processes"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(forked);
}

TEST(ControlScratchFolder, RemovesFoldersOfDeadLaunchersOnly) {
  char root_template[] = "/tmp/eplb-scratch-test-XXXXXX";
  ASSERT_NE(mkdtemp(root_template), nullptr);
  const std::string root = root_template;
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old != nullptr ? old : "";
  setenv("TMPDIR", root.c_str(), 1);
  // A launcher that is gone: a child that exited (and was reaped), so its pid is free.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  // This machine's pid space, as the folders are named: <prefix>-<pid>-<space>-XXXXXX.
  std::string space;
  {
    ScratchFolder probe("eplb-test");
    const std::string head = root + "/eplb-test-" + std::to_string(getpid()) + "-";
    ASSERT_EQ(probe.path().rfind(head, 0), 0u) << probe.path();
    space = probe.path().substr(head.size(), probe.path().size() - head.size() - 7);
  }
  const std::string dead = root + "/eplb-test-" + std::to_string(child) + "-" + space + "-abcdef";
  const std::string alive =
      root + "/eplb-test-" + std::to_string(getpid()) + "-" + space + "-ghijkl";
  const std::string other = root + "/eplb-other-" + std::to_string(child) + "-" + space + "-mnop";
  // A folder of another machine or pid namespace (a /tmp shared with a container): its pid
  // means nothing here, so it stays.
  const std::string elsewhere = root + "/eplb-test-" + std::to_string(child) + "-0123abcd.1-qrst";
  for (const std::string& dir : {dead, alive, other, elsewhere}) {
    ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  }
  std::string mine;
  {
    ScratchFolder folder("eplb-test");
    mine = folder.path();
    EXPECT_EQ(mine.rfind(root + "/eplb-test-" + std::to_string(getpid()) + "-", 0), 0u) << mine;
    EXPECT_EQ(access(mine.c_str(), F_OK), 0);
    EXPECT_NE(access(dead.c_str(), F_OK), 0) << "the folder of a dead launcher stayed";
    EXPECT_EQ(access(alive.c_str(), F_OK), 0) << "the folder of a live launcher was removed";
    EXPECT_EQ(access(other.c_str(), F_OK), 0) << "a folder of another prefix was removed";
    EXPECT_EQ(access(elsewhere.c_str(), F_OK), 0) << "a folder of another pid space was removed";
  }
  EXPECT_NE(access(mine.c_str(), F_OK), 0) << "the folder outlived its object";
  if (old != nullptr) {
    setenv("TMPDIR", saved.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
  std::filesystem::remove_all(root);
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
  EXPECT_TRUE(exits[1].stopped);
  EXPECT_NE(exits[1].describe().find("stopped (SIGSTOP or SIGTSTP) and stopped answering"),
            std::string::npos)
      << exits[1].describe();
}

// Elastic runs have one rule for a process that dies: a signal the launcher did not send makes
// it lost, whoever sent it and whichever signal it was; an exit code is a failure.
TEST(ControlForkElastic, AnySignalFromOutsideIsALoss) {
  MembershipBoard board(3);
  const auto exits = fork_elastic(
      3,
      [&](int seat, bool) {
        if (seat == 1) raise(SIGTERM);  // not the SIGKILL a planned kill uses
        board.wait_newer(0, std::chrono::seconds(60));  // the group went on without seat 1
        return 0;
      },
      board, nullptr);
  ASSERT_EQ(exits.size(), 3u);
  EXPECT_EQ(exits[1].signal, SIGTERM);
  EXPECT_TRUE(is_lost(exits[1])) << exits[1].describe();
  EXPECT_TRUE(exits[0].ok() && exits[2].ok()) << exits[0].describe() << "; " << exits[2].describe();
  EXPECT_EQ(board.view().seats, (std::vector<int32_t>{0, 2}));

  RankExit failed;
  failed.exit_code = 1;
  EXPECT_FALSE(is_lost(failed));
  RankExit ended;
  ended.signal = SIGKILL;
  ended.killed_by_launcher = true;
  EXPECT_FALSE(is_lost(ended));
}

// A replacement waits for a group to add it; when the group's processes have all ended (a run
// that stopped before its rejoin step), nothing can add it any more: the launcher ends it
// instead of waiting for the timeout.
TEST(ControlForkElastic, ReplacementNobodyCanAddIsEnded) {
  MembershipBoard board(2);
  ForkOptions options;
  options.timeout = std::chrono::minutes(10);  // far beyond the test: only the rule ends it
  bool respawned = false;
  const auto exits = fork_elastic(
      2,
      [&](int seat, bool joining) {
        if (joining) {
          pause();  // waits to be added, forever
          return 0;
        }
        if (seat == 0) raise(SIGKILL);
        board.wait_newer(0, std::chrono::seconds(60));
        return 0;
      },
      board,
      [&](int seat) {
        if (seat != 0 || respawned) return false;
        respawned = true;
        return true;
      },
      options);
  ASSERT_EQ(exits.size(), 3u);
  EXPECT_TRUE(is_lost(exits[0])) << exits[0].describe();
  EXPECT_TRUE(exits[1].ok()) << exits[1].describe();
  EXPECT_EQ(exits[2].rank, 0);
  EXPECT_TRUE(exits[2].killed_by_launcher) << exits[2].describe();
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
