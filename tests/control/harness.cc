#include "control/harness.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "eplb/core/error.h"

namespace eplb::control::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/eplb-control-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) fail<IoError>("mkdtemp failed for ", pattern);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string unique_name(const std::string& what) {
  static std::atomic<int> counter{0};
  return detail::concat("test-", what, "-", getpid(), "-", counter++);
}

namespace {

int run_rank(const Group& group, const std::string& rendezvous, int rank,
             const std::function<int(Communicator&)>& body) {
  Options options;
  options.rank = rank;
  options.size = group.size;
  options.rendezvous = rendezvous;
  options.timeout = group.timeout;
  options.hostname = "127.0.0.1";
  auto comm = connect(group.backend, options);
  return body(*comm);
}

}  // namespace

std::vector<RankExit> run_group(const Group& group,
                                const std::function<int(Communicator&)>& body,
                                const ForkOptions& fork_options) {
  std::optional<TempDir> folder;
  std::string rendezvous = group.rendezvous;
  if (rendezvous.empty()) {
    if (group.backend == "gloo") {
      folder.emplace();
      rendezvous = folder->path();
    } else {
      rendezvous = unique_name(group.backend);
    }
  }
  if (group.backend != "inproc") {
    return fork_ranks(
        group.size, [&](int rank) { return run_rank(group, rendezvous, rank, body); },
        fork_options);
  }
  std::vector<RankExit> exits(group.size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < group.size; ++rank) {
    threads.emplace_back([&, rank] {
      exits[rank].rank = rank;
      exits[rank].pid = getpid();
      try {
        exits[rank].exit_code = run_rank(group, rendezvous, rank, body);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        exits[rank].exit_code = 1;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return exits;
}

std::string describe(const std::vector<RankExit>& exits) {
  std::string out;
  for (const auto& exit : exits) out += exit.describe() + "\n";
  return out;
}

}  // namespace eplb::control::testing
