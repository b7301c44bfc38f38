#pragma once
// Starting N ranks and telling each who it is. Three ways (docs/launch.md):
//
//  (a) a launcher that sets environment variables, torchrun's convention:
//        RANK, WORLD_SIZE            this rank and the number of ranks (required)
//        LOCAL_RANK, LOCAL_WORLD_SIZE  rank and ranks on this machine (optional)
//        EPLB_RENDEZVOUS             a folder shared by all ranks, or redis://host:port
//        EPLB_CONTROL_BACKEND        inproc | shm | gloo | mpi (optional; default gloo)
//        EPLB_CONTROL_TIMEOUT_MS     default collective timeout (optional; default 30000)
//  (b) mpirun (OpenMPI): rank and size come from OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK,
//      and the backend defaults to mpi when this build has it;
//  (c) fork_ranks(): one launcher process forks N children on this machine, each running a
//      function with its rank; what tests, benchmarks and `eplb run` use.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/control/communicator.h"

namespace eplb::control {

// Who this process is, as its launcher said.
struct LaunchInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string rendezvous;  // EPLB_RENDEZVOUS; empty under mpirun
  std::string backend;     // EPLB_CONTROL_BACKEND, or the default for this launcher
  std::chrono::milliseconds timeout{30'000};
  bool under_mpirun = false;
};

// True when this process was started by OpenMPI's mpirun (OMPI_COMM_WORLD_RANK is set).
bool launched_by_mpirun();

// Reads (b) if under mpirun, else (a). Returns nullopt when neither RANK nor
// OMPI_COMM_WORLD_RANK is set; throws InvalidArgument naming the variable for a malformed or
// inconsistent value (e.g. RANK=4 with WORLD_SIZE=4, or gloo without EPLB_RENDEZVOUS).
std::optional<LaunchInfo> launch_info_from_env();

// launch_info_from_env() and connect(). Throws InvalidArgument when the environment names no
// rank (say which variables to set).
std::unique_ptr<Communicator> connect_from_env();

// (c) Forked ranks.
struct ForkOptions {
  // Whole run: past it every child still running is killed (SIGKILL) and reported timed out.
  std::chrono::milliseconds timeout{60'000};
  // After a child fails (non-zero exit or a signal), how long the others may take to notice
  // through their own collectives and exit, before they are killed.
  std::chrono::milliseconds grace{5'000};
};

struct RankExit {
  int rank = 0;
  pid_t pid = 0;
  int exit_code = -1;             // when it exited, else -1
  int signal = 0;                 // the signal that ended it, else 0
  bool killed_by_launcher = false;  // ended by fork_ranks (a peer failed, timeout, or stopped)
  bool stopped = false;             // it was stopped (SIGSTOP, SIGTSTP) when the launcher ended it
  std::string error;  // the message of the exception the body threw (cut to 2 KiB), if any
  bool ok() const { return exit_code == 0 && signal == 0; }
  // "rank 2 (pid 123): exit code 1: <error>", "rank 1 (pid 9): stopped (SIGSTOP) and never
  // resumed; killed by the launcher"
  std::string describe() const;
};

// The most rank processes fork_ranks starts on one machine: kMaxLocalRanks, fewer where the
// memory available leaves less than 16 MiB a rank or the process limit (ulimit -u) less than 4
// processes a rank. A rank count above it is an error before the first fork.
inline constexpr int kMaxLocalRanks = 1024;
int max_local_ranks();

// Forks n children; child r runs body(r) and exits with its return value (an exception:
// message on stderr and in RankExit::error, exit code 1). n above max_local_ranks():
// InvalidArgument, before any fork. Children do not return into the caller's code: they end
// with _exit, so the parent's atexit handlers and static destructors never run twice.
// Waits for all of them and returns one RankExit per rank. No child outlives the call:
//  - when one fails, the others get `grace` to exit, then are killed;
//  - when every child still running is stopped (SIGSTOP) and the others are done, the stopped
//    ones are killed, since nothing can wake them;
//  - past `timeout` all are killed;
//  - each child also dies (SIGKILL) if the launcher process dies.
// Call it from a thread-free moment where possible: a forked child has only the calling thread.
std::vector<RankExit> fork_ranks(int n, const std::function<int(int rank)>& body,
                                 const ForkOptions& options = {});

// Throws IoError listing every rank that did not exit with 0.
void check_all_ok(const std::vector<RankExit>& exits);

// A launcher's scratch folder, where its forked ranks leave their reports: a new folder
// $TMPDIR/<prefix>-<pid>-<pid space>-XXXXXX (TMPDIR defaulting to /tmp; the pid space names the
// machine's boot and the pid namespace), removed with everything in it when the object goes. A
// launcher that is killed cannot remove its folder, so the constructor first removes the
// folders of this prefix, of this pid space, whose launcher process is gone.
class ScratchFolder {
 public:
  explicit ScratchFolder(std::string_view prefix);
  ~ScratchFolder();
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace eplb::control
