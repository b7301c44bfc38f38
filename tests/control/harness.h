#pragma once
// Runs one group of ranks for a test: threads for inproc, forked processes for every other
// backend, meeting through a fresh rendezvous (a temp folder for gloo, a unique name for shm).

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"

namespace eplb::control::testing {

// A fresh folder, removed with everything in it at destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A name no other group of this machine uses.
std::string unique_name(const std::string& what);

struct Group {
  Group(std::string backend_, int size_,
        std::chrono::milliseconds timeout_ = std::chrono::milliseconds(20'000))
      : backend(std::move(backend_)), size(size_), timeout(timeout_) {}
  std::string backend;
  int size = 1;
  std::chrono::milliseconds timeout;
  std::string rendezvous;  // empty: a fresh one for the backend
};

// Connects every rank and runs body(comm) on it; a rank's exit code is body's return value
// (1 with the message on stderr when it throws). The communicator is destroyed when body returns.
std::vector<RankExit> run_group(const Group& group,
                                const std::function<int(Communicator&)>& body,
                                const ForkOptions& fork_options = {});

std::string describe(const std::vector<RankExit>& exits);

}  // namespace eplb::control::testing
