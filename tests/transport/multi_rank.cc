#include "multi_rank.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "eplb/core/error.h"

namespace eplb::transport::testing {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}
constexpr auto kRendezvousTimeout = std::chrono::seconds(120);
constexpr int kExitPassed = 0, kExitFailed = 1, kExitThrew = 2, kExitSkipped = 77;

class ThreadRendezvous final : public Rendezvous {
 public:
  std::vector<Bytes> all_gather(const std::string& tag, int rank, const std::vector<int>& group,
                                const Bytes& mine) override {
    std::unique_lock lock(mu_);
    auto& slot = rounds_[tag];
    slot[rank] = mine;
    cv_.notify_all();
    const bool complete = cv_.wait_for(lock, kRendezvousTimeout, [&] {
      for (int r : group) {
        if (!slot.count(r)) return false;
      }
      return true;
    });
    if (!complete) fail<Timeout>("rendezvous '", tag, "': a rank never arrived");
    std::vector<Bytes> out;
    for (int r : group) out.push_back(slot[r]);
    return out;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::map<int, Bytes>> rounds_;
};

// Files `<dir>/<tag>.<rank>`, each written whole then renamed into place.
class FileRendezvous final : public Rendezvous {
 public:
  explicit FileRendezvous(fs::path dir) : dir_(std::move(dir)) {}

  std::vector<Bytes> all_gather(const std::string& tag, int rank, const std::vector<int>& group,
                                const Bytes& mine) override {
    const fs::path final_path = dir_ / (tag + "." + std::to_string(rank));
    const fs::path temp = dir_ / (".tmp." + tag + "." + std::to_string(rank));
    {
      std::ofstream out(temp, std::ios::binary);
      out.write(reinterpret_cast<const char*>(mine.data()),
                static_cast<std::streamsize>(mine.size()));
    }
    fs::rename(temp, final_path);
    const auto deadline = std::chrono::steady_clock::now() + kRendezvousTimeout;
    std::vector<Bytes> out;
    for (int r : group) {
      const fs::path path = dir_ / (tag + "." + std::to_string(r));
      while (!fs::exists(path)) {
        if (fs::exists(dir_ / "skip")) {
          throw SkipRanks{read_file(dir_ / "skip")};
        }
        if (std::chrono::steady_clock::now() > deadline) {
          fail<Timeout>("rendezvous '", tag, "': rank ", r, " never arrived");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      const std::string text = read_file(path);
      const auto* first = reinterpret_cast<const std::byte*>(text.data());
      out.emplace_back(first, first + text.size());
    }
    return out;
  }

 private:
  fs::path dir_;
};

int run_child(const RunOptions& options, int rank, const fs::path& dir,
              const std::function<void(RankContext&)>& body) {
  for (const auto& [name, value] : options.env) ::setenv(name.c_str(), value.c_str(), 1);
  FileRendezvous rendezvous(dir);
  RankContext ctx{rank, options.world, true, &rendezvous};
  int code = kExitPassed;
  try {
    body(ctx);
    if (::testing::Test::HasFailure()) code = kExitFailed;
  } catch (const SkipRanks& skip) {
    // Every rank may skip at once: each writes its own file, and the renames replace each
    // other atomically (any reason will do).
    const fs::path mine = dir / (".skip.tmp." + std::to_string(rank));
    std::ofstream(mine) << skip.reason;
    std::error_code ignored;
    fs::rename(mine, dir / "skip", ignored);
    code = kExitSkipped;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d threw: %s\n", rank, e.what());
    code = kExitThrew;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  return code;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

bool run_processes(const RunOptions& options, const std::function<void(RankContext&)>& body,
                   std::string* skip_reason) {
  std::string pattern = (fs::temp_directory_path() / "eplb-transport-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "cannot create a rendezvous folder";
    return false;
  }
  const fs::path dir = pattern;
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<std::size_t>(options.world), -1);
  for (int rank = 0; rank < options.world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(run_child(options, rank, dir, body));
    if (pid < 0) {
      ADD_FAILURE() << "fork failed for rank " << rank;
      break;
    }
    pids[static_cast<std::size_t>(rank)] = pid;
  }

  std::map<int, int> status;  // rank -> wait status
  const auto deadline = std::chrono::steady_clock::now() + options.deadline;
  bool hung = false;
  auto alive = [&] {
    int n = 0;
    for (int rank = 0; rank < options.world; ++rank) {
      if (pids[rank] > 0 && !status.count(rank)) ++n;
    }
    return n;
  };
  int failed_rank = -1;
  std::set<int> ended_for_failure;  // ranks killed here because failed_rank failed
  while (alive() > 0) {
    bool reaped = false;
    for (int rank = 0; rank < options.world; ++rank) {
      if (pids[rank] <= 0 || status.count(rank)) continue;
      int st = 0;
      if (::waitpid(pids[rank], &st, WNOHANG) == pids[rank]) {
        status[rank] = st;
        reaped = true;
      }
    }
    // Stopped ranks are released once every other rank has finished.
    int others = 0;
    for (int rank = 0; rank < options.world; ++rank) {
      if (pids[rank] > 0 && !status.count(rank) && options.fate(rank) != Fate::kStopped) ++others;
    }
    if (others == 0) {
      for (int rank = 0; rank < options.world; ++rank) {
        if (pids[rank] > 0 && !status.count(rank)) ::kill(pids[rank], SIGKILL);
      }
    }
    // A rank that was to exit normally but failed: the others may wait for it at a rendezvous
    // until their timeout, so end them now (the failure is reported once, by that rank).
    if (failed_rank < 0) {
      for (const auto& [rank, st] : status) {
        const bool passed = WIFEXITED(st) && (WEXITSTATUS(st) == kExitPassed ||
                                              WEXITSTATUS(st) == kExitSkipped);
        if (options.fate(rank) == Fate::kExits && !passed) failed_rank = rank;
      }
      if (failed_rank >= 0) {
        for (int rank = 0; rank < options.world; ++rank) {
          if (pids[rank] > 0 && !status.count(rank)) {
            ::kill(pids[rank], SIGKILL);
            ended_for_failure.insert(rank);
          }
        }
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      hung = true;
      for (int rank = 0; rank < options.world; ++rank) {
        if (pids[rank] > 0 && !status.count(rank)) ::kill(pids[rank], SIGKILL);
      }
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (hung) ADD_FAILURE() << "ranks still running after " << options.deadline.count() << " s";

  bool skipped = false;
  for (int rank = 0; rank < options.world; ++rank) {
    if (pids[rank] <= 0) continue;
    const int st = status[rank];
    const Fate fate = options.fate(rank);
    if (WIFEXITED(st) && WEXITSTATUS(st) == kExitSkipped) {
      skipped = true;
      continue;
    }
    if (ended_for_failure.count(rank)) continue;  // stopped because failed_rank failed
    if (fate == Fate::kExits) {
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == kExitPassed)
          << "rank " << rank << " ended with " << describe(st);
    } else {
      EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)
          << "rank " << rank << " was meant to be killed, ended with " << describe(st);
    }
  }
  if (fs::exists(dir / "skip")) {
    *skip_reason = read_file(dir / "skip");
    skipped = true;
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  return skipped && !::testing::Test::HasFailure();
}

bool run_threads(const RunOptions& options, const std::function<void(RankContext&)>& body,
                 std::string* skip_reason) {
  ThreadRendezvous rendezvous;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < options.world; ++rank) {
    threads.emplace_back([&, rank] {
      RankContext ctx{rank, options.world, false, &rendezvous};
      try {
        body(ctx);
      } catch (const SkipRanks& skip) {
        std::lock_guard lock(mu);
        *skip_reason = skip.reason;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return !skip_reason->empty();
}

}  // namespace

std::vector<int> RankContext::all() const {
  std::vector<int> ranks(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) ranks[r] = r;
  return ranks;
}

bool run_ranks(const RunOptions& options, const std::function<void(RankContext&)>& body,
               std::string* skip_reason) {
  skip_reason->clear();
  return options.processes ? run_processes(options, body, skip_reason)
                           : run_threads(options, body, skip_reason);
}

}  // namespace eplb::transport::testing
