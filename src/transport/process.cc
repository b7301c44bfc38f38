#include "transport/process.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "eplb/core/error.h"

namespace eplb::transport {
namespace {

// Start time of `pid` (field 22 of /proc/<pid>/stat), 0 if it is gone or a zombie.
std::uint64_t start_time_of(std::int32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  // The command name is in parentheses and may contain spaces: fields restart after the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(line.substr(close + 2));
  std::string state;
  fields >> state;
  if (state == "Z" || state == "X") return 0;
  std::string skip;
  for (int field = 4; field < 22; ++field) fields >> skip;
  std::uint64_t start = 0;
  fields >> start;
  return start;
}

int pidfd_open(std::int32_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

ProcessIdentity ProcessIdentity::self() {
  ProcessIdentity id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string text;
  std::getline(boot, text);
  std::strncpy(id.boot_id, text.c_str(), sizeof id.boot_id - 1);
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) id.pid_ns = ns.st_ino;
  id.pid = static_cast<std::int32_t>(::getpid());
  id.start_time = start_time_of(id.pid);
  return id;
}

bool ProcessIdentity::same_machine_as(const ProcessIdentity& other) const {
  return std::strncmp(boot_id, other.boot_id, sizeof boot_id) == 0 && pid_ns == other.pid_ns;
}

bool ProcessIdentity::operator==(const ProcessIdentity& other) const {
  return same_machine_as(other) && pid == other.pid && start_time == other.start_time;
}

PeerProcess::PeerProcess(const ProcessIdentity& identity) {
  pidfd_ = pidfd_open(identity.pid);
  if (pidfd_ < 0 && errno != ENOSYS && errno != EPERM) {
    fail<IoError>("peer process ", identity.pid, " is gone (", std::strerror(errno), ")");
  }
  // Checked after the pidfd is open, so the pidfd refers to the owner, not a successor.
  if (start_time_of(identity.pid) != identity.start_time) {
    if (pidfd_ >= 0) ::close(pidfd_);
    pidfd_ = -1;
    fail<IoError>("peer process ", identity.pid, " is gone (exited since it exported its ",
                  "descriptor)");
  }
  if (pidfd_ < 0) {
    pid_ = identity.pid;
    start_time_ = identity.start_time;
  }
}

PeerProcess::PeerProcess(PeerProcess&& other) noexcept
    : pidfd_(std::exchange(other.pidfd_, -1)),
      pid_(std::exchange(other.pid_, 0)),
      start_time_(other.start_time_) {}

PeerProcess& PeerProcess::operator=(PeerProcess&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) ::close(pidfd_);
    pidfd_ = std::exchange(other.pidfd_, -1);
    pid_ = std::exchange(other.pid_, 0);
    start_time_ = other.start_time_;
  }
  return *this;
}

PeerProcess::~PeerProcess() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool PeerProcess::alive() const {
  const PeerProcess* self = this;
  return all_alive(std::span<const PeerProcess* const>(&self, 1));
}

bool all_alive(std::span<const PeerProcess* const> peers) {
  std::vector<pollfd> fds;
  for (const PeerProcess* peer : peers) {
    if (peer->pidfd_ >= 0) {
      fds.push_back({peer->pidfd_, POLLIN, 0});
    } else if (peer->pid_ > 0 && start_time_of(peer->pid_) != peer->start_time_) {
      return false;
    }
  }
  if (fds.empty()) return true;
  int ready;
  do {
    ready = ::poll(fds.data(), fds.size(), 0);
  } while (ready < 0 && errno == EINTR);
  return ready == 0;  // a pidfd turns readable when its process exits
}

}  // namespace eplb::transport
