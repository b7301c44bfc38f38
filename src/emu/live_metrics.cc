#include "emu/live_metrics.h"

#include <cstdio>
#include <filesystem>
#include <system_error>

#include <fmt/core.h>
#include <prometheus/exposer.h>

#include "eplb/core/error.h"
#include "eplb/runtime/metrics.h"
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

}  // namespace eplb::emu
