#include "emu/live_metrics.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <system_error>

#include <fmt/core.h>
#include <prometheus/exposer.h>

#include "eplb/core/error.h"
#include "eplb/runtime/metric_families.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/stats/load_file.h"

namespace eplb::emu {

std::string snapshot_path(const std::string& dir, int rank) {
  return fmt::format("{}/metrics-rank{}.json", dir, rank);
}

void write_snapshot(const runtime::Rebalancer& rebalancer, const std::string& path) {
  const std::string tmp = path + ".tmp";
  stats::write_file(tmp, runtime::families_to_json(rebalancer.collect_metrics()));
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail<IoError>("cannot replace ", path, ": ", ec.message());
}

void SnapshotWriter::maybe_write(const runtime::Rebalancer& rebalancer) {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < period_) return;
  last_ = now;
  write_snapshot(rebalancer, path_);
}

std::vector<prometheus::MetricFamily> SnapshotCollectable::Collect() const {
  std::vector<std::vector<prometheus::MetricFamily>> sets;
  for (int rank = 0; rank < ranks_; ++rank) {
    try {
      sets.push_back(runtime::families_from_json(stats::read_file(snapshot_path(dir_, rank))));
    } catch (const Error&) {
      // Not written yet: this scrape goes without that rank.
    }
  }
  return runtime::merge_families(sets);
}

MetricsServer::MetricsServer(int port, std::shared_ptr<prometheus::Collectable> collectable)
    : collectable_(std::move(collectable)) {
  if (port < 1 || port > 65535) fail("--metrics-port ", port, " is not a port (1 to 65535)");
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(fmt::format("127.0.0.1:{}", port));
  } catch (const std::exception& e) {
    fail<IoError>("cannot serve metrics on 127.0.0.1:", port, " (", e.what(),
                  "): is the port in use? choose another --metrics-port");
  }
  exposer_->RegisterCollectable(collectable_);
}

MetricsServer::~MetricsServer() = default;

namespace {

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

std::string read_all(int fd) {
  std::string out;
  char buf[512];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace

MetricsServerProcess::MetricsServerProcess(int port, const std::string& dir, int ranks) {
  int status[2], keepalive[2];
  if (::pipe2(status, O_CLOEXEC) != 0 || ::pipe2(keepalive, O_CLOEXEC) != 0) {
    fail<IoError>("cannot start the metrics server: pipe: ", std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) fail<IoError>("cannot start the metrics server: fork: ", std::strerror(errno));
  if (pid == 0) {
    // The server: serves until the launcher closes its end of `keepalive` (or dies).
    ::close(status[0]);
    ::close(keepalive[1]);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(0);
    int code = 0;
    try {
      const MetricsServer server(port, std::make_shared<SnapshotCollectable>(dir, ranks));
      write_all(status[1], "ok");
      ::close(status[1]);
      char byte = 0;
      while (::read(keepalive[0], &byte, 1) < 0 && errno == EINTR) {
      }
    } catch (const std::exception& e) {
      write_all(status[1], e.what());
      code = 1;
    }
    ::_exit(code);
  }
  ::close(status[1]);
  ::close(keepalive[0]);
  pid_ = pid;
  keepalive_ = keepalive[1];
  const std::string answer = read_all(status[0]);
  ::close(status[0]);
  if (answer != "ok") {
    ::close(keepalive_);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    if (answer.empty()) fail<IoError>("the metrics server on port ", port, " ended at start");
    // The server's own message: an IoError naming the port.
    fail<IoError>(answer);
  }
}

MetricsServerProcess::~MetricsServerProcess() {
  if (pid_ < 0) return;
  ::close(keepalive_);
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace eplb::emu
