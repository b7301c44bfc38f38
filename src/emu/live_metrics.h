#pragma once
// Metrics of `eplb run` while it runs (--metrics-port): each rank process writes its metric
// families to a file every half second; the launcher process merges the files of every rank
// and serves them over HTTP on 127.0.0.1 with prometheus-cpp's pull module. A rank started by
// a launcher (mpirun, torchrun) serves its own registry instead.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/collectable.h>

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace eplb::runtime {
class Rebalancer;
}

namespace eplb::emu {

// The snapshot file of `rank` in `dir`.
std::string snapshot_path(const std::string& dir, int rank);

// Writes `rebalancer`'s families to `path` whole (a temporary file renamed over it), so a
// reader never sees half a file. IoError when it cannot.
void write_snapshot(const runtime::Rebalancer& rebalancer, const std::string& path);

// Forward thread of a rank: write_snapshot at most every `period`.
class SnapshotWriter {
 public:
  SnapshotWriter(std::string path, std::chrono::milliseconds period)
      : path_(std::move(path)), period_(period) {}
  void maybe_write(const runtime::Rebalancer& rebalancer);

 private:
  std::string path_;
  std::chrono::milliseconds period_;
  std::chrono::steady_clock::time_point last_{};
};

// The families of the ranks' snapshot files, merged (a rank whose file is missing or being
// replaced is left out of that scrape).
class SnapshotCollectable : public prometheus::Collectable {
 public:
  SnapshotCollectable(std::string dir, int ranks) : dir_(std::move(dir)), ranks_(ranks) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::string dir_;
  int ranks_;
};

// An HTTP endpoint /metrics on 127.0.0.1:port serving `collectable`; IoError naming the port
// when it cannot listen (in use, or not allowed).
class MetricsServer {
 public:
  MetricsServer(int port, std::shared_ptr<prometheus::Collectable> collectable);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

 private:
  std::shared_ptr<prometheus::Collectable> collectable_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

// The launcher's endpoint for forked ranks: a MetricsServer over the ranks' snapshot files in
// a process of its own, forked before the ranks are. The launcher stays single-threaded, so its
// ranks fork from a process without the server's threads or its listening socket. Throws
// (IoError naming the port) when the port cannot be served; the destructor ends the process.
class MetricsServerProcess {
 public:
  MetricsServerProcess(int port, const std::string& dir, int ranks);
  ~MetricsServerProcess();
  MetricsServerProcess(const MetricsServerProcess&) = delete;
  MetricsServerProcess& operator=(const MetricsServerProcess&) = delete;

 private:
  int pid_ = -1;
  int keepalive_ = -1;  // write end of the pipe whose EOF tells the server to end
};

}  // namespace eplb::emu
