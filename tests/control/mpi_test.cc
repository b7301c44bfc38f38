// The mpi backend under mpirun: runs eplb_control_mpi_rank with 1..8 ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "eplb/config.h"

namespace {

#if EPLB_HAVE_MPI
struct Run {
  int status = -1;
  std::string output;
};

Run mpirun(int ranks, const std::string& mode) {
  // --oversubscribe: more ranks than cores; as root OpenMPI also wants --allow-run-as-root.
  std::string command = std::string(EPLB_MPIRUN) + " -np " + std::to_string(ranks) +
                        " --oversubscribe" + (geteuid() == 0 ? " --allow-run-as-root" : "") +
                        " " + EPLB_MPI_RANK_BINARY + " " + mode + " 2>&1";
  Run run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) run.output += line;
  run.status = pclose(pipe);
  return run;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

bool have_mpirun() { return std::string(EPLB_MPIRUN).size() > 0 && access(EPLB_MPIRUN, X_OK) == 0; }

class ControlMpi : public ::testing::TestWithParam<int> {};

TEST_P(ControlMpi, ConformanceUnderMpirun) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found (apt-get install openmpi-bin)";
  const int ranks = GetParam();
  const auto run = mpirun(ranks, "check");
  EXPECT_EQ(run.status, 0) << run.output;
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(count(run.output, "rank " + std::to_string(r) + " ok"), 1) << run.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ControlMpi, ::testing::Values(1, 2, 3, 4, 8));

TEST(ControlMpiFailure, StalledRankGivesTimeout) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found (apt-get install openmpi-bin)";
  const auto run = mpirun(3, "stall");
  EXPECT_EQ(count(run.output, "timeout ok"), 2) << run.output;
}

TEST(ControlMpiFailure, KilledRankEndsTheJob) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found (apt-get install openmpi-bin)";
  // mpirun ends every rank when one dies: the survivors either saw an error or were killed;
  // what matters is that mpirun returns (the test has a timeout) and reports the failure.
  const auto run = mpirun(3, "kill");
  EXPECT_NE(run.status, 0) << run.output;
  EXPECT_EQ(count(run.output, "no error"), 0) << run.output;
}
#else
TEST(ControlMpi, NotBuilt) { GTEST_SKIP() << "built without MPI (EPLB_WITH_MPI=OFF)"; }
#endif

}  // namespace
