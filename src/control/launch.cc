#include "eplb/control/launch.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

#include "eplb/config.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "control/child.h"

namespace eplb::control {
namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

long env_int(const char* name, long fallback) {
  const char* value = env(name);
  if (value == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long parsed = std::strtol(value, &end, 10);
  if (errno != 0 || *end != '\0') {
    fail<InvalidArgument>("environment variable ", name, "='", value,
                          "' is not an integer");
  }
  return parsed;
}

}  // namespace

bool launched_by_mpirun() { return env("OMPI_COMM_WORLD_RANK") != nullptr; }

std::optional<LaunchInfo> launch_info_from_env() {
  LaunchInfo info;
  if (launched_by_mpirun()) {
    info.under_mpirun = true;
    info.rank = static_cast<int>(env_int("OMPI_COMM_WORLD_RANK", 0));
    info.size = static_cast<int>(env_int("OMPI_COMM_WORLD_SIZE", 1));
    info.local_rank = static_cast<int>(env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0));
    info.local_size = static_cast<int>(env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1));
    info.backend = EPLB_HAVE_MPI ? "mpi" : "gloo";
  } else if (env("RANK") != nullptr) {
    if (env("WORLD_SIZE") == nullptr) {
      fail<InvalidArgument>("RANK is set but WORLD_SIZE is not (set both: the number of ranks)");
    }
    info.rank = static_cast<int>(env_int("RANK", 0));
    info.size = static_cast<int>(env_int("WORLD_SIZE", 1));
    info.local_rank = static_cast<int>(env_int("LOCAL_RANK", info.rank));
    info.local_size = static_cast<int>(env_int("LOCAL_WORLD_SIZE", info.size));
    info.backend = "gloo";
  } else {
    return std::nullopt;
  }
  if (const char* backend = env("EPLB_CONTROL_BACKEND")) info.backend = backend;
  if (const char* rendezvous = env("EPLB_RENDEZVOUS")) info.rendezvous = rendezvous;
  const long timeout_ms = env_int("EPLB_CONTROL_TIMEOUT_MS", 30'000);
  if (timeout_ms < 0) {
    fail<InvalidArgument>("EPLB_CONTROL_TIMEOUT_MS=", timeout_ms, " is negative");
  }
  info.timeout = std::chrono::milliseconds(timeout_ms);

  if (info.size < 1) fail<InvalidArgument>("WORLD_SIZE=", info.size, " must be at least 1");
  if (info.rank < 0 || info.rank >= info.size) {
    fail<InvalidArgument>("RANK=", info.rank, " is not in 0..", info.size - 1, " (WORLD_SIZE=",
                          info.size, ")");
  }
  if (info.local_rank < 0 || info.local_rank >= info.local_size) {
    fail<InvalidArgument>("LOCAL_RANK=", info.local_rank, " is not in 0..",
                          info.local_size - 1, " (LOCAL_WORLD_SIZE=", info.local_size, ")");
  }
  if (info.backend != "mpi" && info.rendezvous.empty()) {
    fail<InvalidArgument>("EPLB_RENDEZVOUS is not set: the ", info.backend,
                          " control backend needs a folder shared by all ranks, or "
                          "redis://host:port (gloo), or a name shared by the ranks (shm)");
  }
  return info;
}

std::unique_ptr<Communicator> connect_from_env() {
  const auto info = launch_info_from_env();
  if (!info) {
    fail<InvalidArgument>("no rank in the environment: set RANK, WORLD_SIZE and "
                          "EPLB_RENDEZVOUS (torchrun's convention), or start under mpirun");
  }
  Options options;
  options.rank = info->rank;
  options.size = info->size;
  options.rendezvous = info->rendezvous;
  options.timeout = info->timeout;
  return connect(info->backend, options);
}

std::string RankExit::describe() const {
  std::string text = detail::concat("rank ", rank, " (pid ", pid, "): ");
  if (stopped) {
    // Stopped ranks answer nobody: their peers' collectives time out, and the launcher ends
    // them once nothing else runs.
    text += "stopped (SIGSTOP or SIGTSTP) and stopped answering its peers until they timed out; "
            "then killed by the launcher";
    return text;
  }
  if (signal != 0) {
    text += detail::concat("killed by signal ", signal, " (", strsignal(signal), ")");
  } else {
    text += detail::concat("exit code ", exit_code);
  }
  if (killed_by_launcher) text += ", killed by the launcher";
  if (!error.empty()) text += ": " + error;
  return text;
}

int max_local_ranks() {
  long most = kMaxLocalRanks;
  // A rank process takes some MiB even when its work is small (its stacks, a communicator's
  // and a transport's buffers): 16 MiB each as a floor.
  const int64_t available = memory_available();
  if (available >= 0) most = std::min<long>(most, static_cast<long>(available >> 24));
  rlimit limit{};
  if (getrlimit(RLIMIT_NPROC, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    // Leave room for the threads of this process and of the ranks themselves.
    most = std::min<long>(most, static_cast<long>(limit.rlim_cur / 4));
  }
  return static_cast<int>(std::max(1L, most));
}

void check_all_ok(const std::vector<RankExit>& exits) {
  std::string failed;
  for (const auto& exit : exits) {
    if (!exit.ok()) failed += (failed.empty() ? "" : "; ") + exit.describe();
  }
  if (!failed.empty()) fail<IoError>("ranks failed: ", failed);
}

namespace {

// Which machine and pid namespace a pid belongs to: a folder's pid is checked only where it
// means the same process (a /tmp shared between containers or machines holds others' too).
std::string pid_space() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat ns {};
  const uint64_t inode = ::stat("/proc/self/ns/pid", &ns) == 0 ? ns.st_ino : 0;
  return detail::concat(boot.substr(0, 8), ".", inode);
}

}  // namespace

ScratchFolder::ScratchFolder(std::string_view prefix) {
  const char* tmp = env("TMPDIR");
  const std::filesystem::path root = tmp != nullptr ? tmp : "/tmp";
  // Step 1: the folders of launchers that died without removing theirs. A folder's name
  // carries its launcher's pid and pid space; one of another pid space, or whose pid is alive
  // (its own, or a reused one), stays.
  const std::string stem = std::string(prefix) + "-";
  const std::string space = pid_space();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= stem.size() || name.compare(0, stem.size(), stem) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + stem.size(), &end, 10);
    if (pid <= 0 || end == nullptr || *end != '-' || !entry.is_directory(ec)) continue;
    const std::string rest = end + 1;
    if (rest.compare(0, space.size() + 1, space + "-") != 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      std::filesystem::remove_all(entry.path(), ignored);
    }
  }
  // Step 2: this launcher's own.
  path_ = (root / detail::concat(prefix, "-", getpid(), "-", space, "-XXXXXX")).string();
  if (::mkdtemp(path_.data()) == nullptr) {
    fail<IoError>("cannot create a folder from ", path_, ": ", std::strerror(errno),
                  " (set TMPDIR to a writable folder)");
  }
}

ScratchFolder::~ScratchFolder() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void child::keep_error(char* slot, const char* message) {
  std::strncpy(slot, message, kErrorBytes - 1);
  slot[kErrorBytes - 1] = '\0';
}

void child::run_child(int rank, pid_t parent, const std::function<int()>& body,
                       char* error_slot) {
  // Die with the launcher, so that no rank outlives it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(125);
  int code = 1;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    keep_error(error_slot, e.what());
  } catch (...) {
    std::fprintf(stderr, "rank %d: unknown exception\n", rank);
    keep_error(error_slot, "an exception that is not a std::exception");
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

std::vector<RankExit> fork_ranks(int n, const std::function<int(int rank)>& body,
                                 const ForkOptions& options) {
  EPLB_CHECK(n >= 1, "fork_ranks: n ", n, " must be at least 1");
  if (n > max_local_ranks()) {
    fail("ranks ", n, " is more rank processes than this machine takes: at most ",
         max_local_ranks(), " (", kMaxLocalRanks, ", fewer when the memory available gives "
         "less than 16 MiB each or the process limit, ulimit -u, less than 4 processes each)");
  }
  std::vector<RankExit> exits(n);
  const size_t error_bytes = static_cast<size_t>(n) * child::kErrorBytes;
  void* shared = mmap(nullptr, error_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                      -1, 0);
  if (shared == MAP_FAILED) {
    fail<IoError>("fork_ranks: mmap of ", error_bytes, " B for the ranks' errors failed: ",
                  std::strerror(errno));
  }
  auto* errors = static_cast<char*>(shared);  // zero-filled: no error
  struct Unmap {
    void* at;
    size_t bytes;
    ~Unmap() { munmap(at, bytes); }
  } unmap{shared, error_bytes};
  std::vector<bool> running(n, false), stopped(n, false);
  // Output buffered so far would otherwise be written once per child too.
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();

  const auto kill_running = [&] {
    for (int r = 0; r < n; ++r) {
      if (!running[r]) continue;
      kill(exits[r].pid, SIGKILL);
      int status = 0;
      while (waitpid(exits[r].pid, &status, 0) < 0 && errno == EINTR) {
      }
      running[r] = false;
      exits[r].killed_by_launcher = true;
      exits[r].stopped = stopped[r];
      exits[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
      if (WIFEXITED(status)) {
        exits[r].signal = 0;
        exits[r].exit_code = WEXITSTATUS(status);
      }
    }
  };

  for (int r = 0; r < n; ++r) {
    exits[r].rank = r;
    const pid_t pid = fork();
    if (pid == 0) {
      child::run_child(r, parent, [&] { return body(r); },
                        errors + static_cast<size_t>(r) * child::kErrorBytes);
    }
    if (pid < 0) {
      const int err = errno;
      kill_running();
      fail<IoError>("fork_ranks: fork of rank ", r, " failed: ", std::strerror(err));
    }
    exits[r].pid = pid;
    running[r] = true;
  }

  const auto start = Clock::now();
  std::optional<Clock::time_point> first_failure;
  auto nap = std::chrono::microseconds(50);
  while (true) {
    bool any_running = false, any_exited = false, all_running_stopped = true;
    for (int r = 0; r < n; ++r) {
      if (!running[r]) {
        any_exited = true;
        continue;
      }
      int status = 0;
      const pid_t got = waitpid(exits[r].pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (got == exits[r].pid) {
        if (WIFEXITED(status) || WIFSIGNALED(status)) {
          running[r] = false;
          any_exited = true;
          exits[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
          exits[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
          if (!exits[r].ok() && !first_failure) first_failure = Clock::now();
          nap = std::chrono::microseconds(50);
          continue;
        }
        if (WIFSTOPPED(status)) stopped[r] = true;
        if (WIFCONTINUED(status)) stopped[r] = false;
      }
      any_running = true;
      all_running_stopped = all_running_stopped && stopped[r];
    }
    if (!any_running) break;
    const auto now = Clock::now();
    if (now - start >= options.timeout ||
        (first_failure && now - *first_failure >= options.grace) ||
        (any_exited && all_running_stopped)) {
      kill_running();
      break;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(2000));
  }
  for (int r = 0; r < n; ++r) {
    const char* slot = errors + static_cast<size_t>(r) * child::kErrorBytes;
    exits[r].error.assign(slot, strnlen(slot, child::kErrorBytes));
  }
  return exits;
}

}  // namespace eplb::control
