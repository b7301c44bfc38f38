#pragma once
// Runs a test body on N ranks: threads of this process (inproc) or forked processes (every
// other backend), meeting through a small rendezvous of their own (a mutex for threads, files in
// a temporary folder for processes) so that these tests depend on no control-plane backend.
//
// Processes are forked before anything creates a UCX context or a thread. A child runs the body,
// and exits 0 when it passed, 1 when a gtest expectation failed, 2 on an exception, 77 to skip
// (a backend that cannot start here); the parent checks every exit code. A rank may die on
// purpose (SIGKILL) or stop (SIGSTOP): the parent expects that fate for it and kills a stopped
// rank once every other rank has exited. The parent never waits forever: past a generous
// deadline it kills every child and fails the test, so a hang is a failure, not a stuck run.

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace eplb::transport::testing {

using Bytes = std::vector<std::byte>;

// Thrown in a rank to skip the whole test, with the reason.
struct SkipRanks {
  std::string reason;
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Every rank of `group` calls this with the same `tag`; each gets every contribution, in the
  // order of `group`. Throws Timeout (a peer never came) or SkipRanks (a peer skipped).
  virtual std::vector<Bytes> all_gather(const std::string& tag, int rank,
                                        const std::vector<int>& group, const Bytes& mine) = 0;
};

enum class Fate { kExits, kKilled, kStopped };

struct RankContext {
  int rank = 0;
  int world = 1;
  bool processes = false;  // ranks are processes (else threads)
  Rendezvous* rendezvous = nullptr;

  std::vector<int> all() const;
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine) {
    return rendezvous->all_gather(tag, rank, all(), mine);
  }
  void barrier(const std::string& tag) { all_gather(tag, {}); }
};

struct RunOptions {
  int world = 1;
  bool processes = true;
  std::vector<std::pair<std::string, std::string>> env;  // set in each child before the body
  std::function<Fate(int rank)> fate = [](int) { return Fate::kExits; };
  std::chrono::seconds deadline{180};
};

// Runs `body` on every rank and records gtest failures for every rank that failed; calls
// GTEST_SKIP-equivalent (returns true) when a rank skipped. Returns whether the test was skipped.
bool run_ranks(const RunOptions& options, const std::function<void(RankContext&)>& body,
               std::string* skip_reason);

}  // namespace eplb::transport::testing
