#include "runtime/cpu_wait.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

namespace eplb::runtime {
namespace {

// This thread's schedstat file: opened at the first call, closed when the thread ends.
class SchedStat {
 public:
  SchedStat() : fd_(::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC)) {}
  ~SchedStat() {
    if (fd_ >= 0) ::close(fd_);
  }
  SchedStat(const SchedStat&) = delete;
  SchedStat& operator=(const SchedStat&) = delete;

  // "<ns on a cpu> <ns waiting on a run queue> <time slices>\n"
  int64_t wait_ns() const {
    if (fd_ < 0) return -1;
    char text[96];
    const ssize_t n = ::pread(fd_, text, sizeof(text) - 1, 0);
    if (n <= 0) return -1;
    const char* end = text + n;
    const char* space = static_cast<const char*>(std::memchr(text, ' ', static_cast<size_t>(n)));
    if (space == nullptr) return -1;
    int64_t wait = 0;
    const auto [rest, error] = std::from_chars(space + 1, end, wait);
    return error == std::errc() && rest != space + 1 ? wait : -1;
  }

 private:
  int fd_;
};

}  // namespace

void make_background_thread() {
  sched_param param{};
  param.sched_priority = 0;
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
}

int64_t run_queue_wait_ns() {
  thread_local const SchedStat stat;
  return stat.wait_ns();
}

}  // namespace eplb::runtime
