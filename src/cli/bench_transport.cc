// `eplb bench transport`: pull bandwidth of a transport backend beside memcpy, same run.
//
// N ranks (threads for inproc, forked processes otherwise) each serve one region of B bytes and
// pull B bytes from their peers (split evenly over the other ranks; from itself when alone).
// memcpy of B bytes between two private buffers is timed in the same processes, interleaved
// with the transport rounds and run on every rank at once, so both figures see the same memory
// bandwidth. Figures are per rank, median over rounds, averaged over ranks.
//
// Beside the wall-clock figures, two that do not depend on what else the machine runs: the
// same copies timed in the rank thread's CPU time (a rank that waits for a core is not
// copying), and the page faults each timed copy took (a pull into or from pages not yet mapped
// faults once per page; a warm one, none).

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/option_checks.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/shareable.h"

namespace eplb::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxRanks = 64;
constexpr int64_t kMaxBytes = int64_t{1} << 40;  // --bytes, before the memory check
constexpr std::size_t kMaxDescriptor = 64 * 1024;
constexpr int kRounds = 5;
constexpr auto kBarrierTimeout = std::chrono::seconds(120);

// Shared by every rank: anonymous shared memory mapped before the fork (or plain memory for
// threads). The ranks' own rendezvous, independent of any control-plane backend.
struct Board {
  std::atomic<int> arrived;
  std::atomic<int> generation;
  std::atomic<int> failed;
  char error[1024];
  std::uint32_t descriptor_bytes[kMaxRanks];
  std::byte descriptors[kMaxRanks][kMaxDescriptor];
  double transport_gbps[kMaxRanks];
  double memcpy_gbps[kMaxRanks];
  double transport_cpu_gbps[kMaxRanks];  // in the rank thread's CPU time
  double memcpy_cpu_gbps[kMaxRanks];
  double pull_faults[kMaxRanks];  // page faults (minor and major) per timed pull
  double memcpy_faults[kMaxRanks];
};

void barrier(Board& board, int ranks) {
  const int generation = board.generation.load();
  if (board.arrived.fetch_add(1) + 1 == ranks) {
    board.arrived.store(0);
    board.generation.fetch_add(1);
    return;
  }
  const auto deadline = Clock::now() + kBarrierTimeout;
  while (board.generation.load() == generation) {
    if (board.failed.load()) fail<IoError>("another rank failed");
    if (Clock::now() > deadline) fail<Timeout>("bench transport: a rank never reached a barrier");
    sched_yield();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The calling thread's CPU time and page faults so far.
struct ThreadUsage {
  double cpu_s = 0;
  int64_t faults = 0;

  static ThreadUsage now() {
    rusage u{};
    ::getrusage(RUSAGE_THREAD, &u);
    timespec t{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return {static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9,
            static_cast<int64_t>(u.ru_minflt + u.ru_majflt)};
  }
};

void run_rank(Board& board, const std::string& backend, int rank, int ranks, std::size_t bytes,
              const std::string& memory) {
  auto transport = transport::create(backend, transport::Options{.rank = rank});
  // --registered: the served bytes are the caller's (as an engine's weights are), not the
  // transport's own allocation: plain heap memory, or allocate_shareable()'s (--shareable).
  std::vector<std::byte> own;
  struct Shared {
    void* data = nullptr;
    ~Shared() {
      if (data != nullptr) transport::free_shareable(data);
    }
  } shared;
  transport::Region region;
  if (memory != "allocated") {
    if (!transport->capabilities().register_memory) {
      fail<NotSupported>("bench transport --registered: the ", backend, " backend cannot serve "
                         "memory it did not allocate");
    }
    void* data = nullptr;
    if (memory == "shareable") {
      data = shared.data = transport::allocate_shareable(bytes);
    } else {
      own.resize(bytes);
      data = own.data();
    }
    region = transport->register_memory(data, bytes);
  } else {
    region = transport->allocate(bytes);
  }
  std::memset(region.data, 0x40 + rank, bytes);
  const auto descriptor = transport->export_descriptor();
  if (descriptor.size() > kMaxDescriptor) {
    fail<IoError>("bench transport: a descriptor of ", descriptor.size(), " bytes is too large");
  }
  std::memcpy(board.descriptors[rank], descriptor.data(), descriptor.size());
  board.descriptor_bytes[rank] = static_cast<std::uint32_t>(descriptor.size());
  barrier(board, ranks);
  for (int peer = 0; peer < ranks; ++peer) {
    transport->import_descriptor(
        peer, std::span<const std::byte>(board.descriptors[peer], board.descriptor_bytes[peer]));
  }

  // B bytes from the other ranks, in equal contiguous pieces (the last takes the remainder).
  std::vector<std::byte> dst(bytes, std::byte{1});
  std::vector<std::byte> src(bytes, std::byte{2});
  std::vector<transport::Read> reads;
  const int peers = ranks == 1 ? 1 : ranks - 1;
  const std::size_t piece = bytes / static_cast<std::size_t>(peers);
  for (int k = 0; k < peers; ++k) {
    const int peer = ranks == 1 ? rank : (rank + 1 + k) % ranks;
    const std::size_t offset = piece * static_cast<std::size_t>(k);
    const std::size_t size = k + 1 == peers ? bytes - offset : piece;
    reads.push_back({peer, 0, offset, dst.data() + offset, size});
  }
  const auto pull = [&] { transport->post(reads)->wait(std::chrono::seconds(120)); };
  pull();  // warm up: connections, page tables, caches
  std::memcpy(dst.data(), src.data(), bytes);

  std::vector<double> copy_s, pull_s, copy_cpu_s, pull_cpu_s;
  int64_t copy_faults = 0, pull_faults = 0;
  // Times `copy` in wall-clock and CPU time, and counts its page faults.
  const auto timed = [](const auto& copy, std::vector<double>& wall, std::vector<double>& cpu,
                        int64_t& faults) {
    const ThreadUsage u0 = ThreadUsage::now();
    const auto t0 = Clock::now();
    copy();
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    const ThreadUsage u1 = ThreadUsage::now();
    cpu.push_back(std::max(u1.cpu_s - u0.cpu_s, 1e-9));
    faults += u1.faults - u0.faults;
  };
  for (int round = 0; round < kRounds; ++round) {
    barrier(board, ranks);
    timed([&] { std::memcpy(dst.data(), src.data(), bytes); }, copy_s, copy_cpu_s, copy_faults);
    barrier(board, ranks);
    timed(pull, pull_s, pull_cpu_s, pull_faults);
  }
  if (dst[bytes - 1] != static_cast<std::byte>(0x40 + reads.back().peer)) {
    fail<IoError>("bench transport: rank ", rank, " read wrong bytes");
  }
  board.memcpy_gbps[rank] = static_cast<double>(bytes) / median(copy_s) / 1e9;
  board.transport_gbps[rank] = static_cast<double>(bytes) / median(pull_s) / 1e9;
  board.memcpy_cpu_gbps[rank] = static_cast<double>(bytes) / median(copy_cpu_s) / 1e9;
  board.transport_cpu_gbps[rank] = static_cast<double>(bytes) / median(pull_cpu_s) / 1e9;
  board.memcpy_faults[rank] = static_cast<double>(copy_faults) / kRounds;
  board.pull_faults[rank] = static_cast<double>(pull_faults) / kRounds;
  barrier(board, ranks);  // nobody closes while a peer may still read from it
}

void report_failure(Board& board, const std::exception& e) {
  if (board.failed.exchange(1) == 0) {
    std::snprintf(board.error, sizeof board.error, "%s", e.what());
  }
}

void run_processes(Board& board, const std::string& backend, int ranks, std::size_t bytes,
                   const std::string& memory) {
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) fail<IoError>("bench transport: fork failed");
    if (pid == 0) {
      int code = 0;
      try {
        run_rank(board, backend, rank, ranks, bytes, memory);
      } catch (const std::exception& e) {
        report_failure(board, e);
        code = 1;
      }
      std::fflush(stdout);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  bool crashed = false;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) crashed = true;
    if (WIFSIGNALED(status) && !board.failed.load()) board.failed.store(1);
  }
  if (crashed && board.error[0] == '\0') {
    std::snprintf(board.error, sizeof board.error, "a rank was killed by a signal");
  }
}

void run_threads(Board& board, const std::string& backend, int ranks, std::size_t bytes,
                 const std::string& memory) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        run_rank(board, backend, rank, ranks, bytes, memory);
      } catch (const std::exception& e) {
        report_failure(board, e);
      }
    });
  }
  for (auto& t : threads) t.join();
}

void bench_transport(const std::string& backend, int ranks, int64_t bytes_given,
                     const std::string& memory, bool json) {
  if (!transport::has_backend(backend)) transport::create(backend, {});  // throws the message
  check_range("--ranks", ranks, 1, kMaxRanks,
              backend == "inproc" ? "rank threads" : "rank processes");
  check_range("--bytes", bytes_given, ranks, kMaxBytes,
              "bytes each rank pulls, at least one from each peer");
  // Every rank holds the region it serves, the buffer it pulls into and memcpy's source.
  check_fits_in_memory(
      checked_mul(bytes_given, 3 * ranks, "--bytes x 3 x --ranks"),
      fmt::format("--bytes {} with --ranks {} (each rank holds 3 buffers of --bytes)",
                  bytes_given, ranks),
      "lower --bytes or --ranks");
  const auto bytes = static_cast<std::size_t>(bytes_given);
  void* mem = ::mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                     -1, 0);
  if (mem == MAP_FAILED) fail<IoError>("bench transport: cannot map shared memory");
  std::unique_ptr<Board, void (*)(Board*)> board(new (mem) Board{},
                                                 [](Board* b) { ::munmap(b, sizeof(Board)); });
  if (backend == "inproc") {
    run_threads(*board, backend, ranks, bytes, memory);
  } else {
    run_processes(*board, backend, ranks, bytes, memory);
  }
  if (board->failed.load()) fail<IoError>("bench transport --backend ", backend, ": ", board->error);

  double gbps = 0, memcpy_gbps = 0, cpu_gbps = 0, memcpy_cpu_gbps = 0;
  double pull_faults = 0, memcpy_faults = 0;
  for (int rank = 0; rank < ranks; ++rank) {
    gbps += board->transport_gbps[rank] / ranks;
    memcpy_gbps += board->memcpy_gbps[rank] / ranks;
    cpu_gbps += board->transport_cpu_gbps[rank] / ranks;
    memcpy_cpu_gbps += board->memcpy_cpu_gbps[rank] / ranks;
    pull_faults += board->pull_faults[rank] / ranks;
    memcpy_faults += board->memcpy_faults[rank] / ranks;
  }
  const double ratio = gbps / memcpy_gbps;
  const double cpu_ratio = cpu_gbps / memcpy_cpu_gbps;
  if (json) {
    nlohmann::json out{{"backend", backend},
                       {"ranks", ranks},
                       {"bytes", bytes},
                       {"registered", memory != "allocated"},
                       {"memory", memory},
                       {"gbps", gbps},
                       {"memcpy_gbps", memcpy_gbps},
                       {"ratio", ratio},
                       {"cpu_gbps", cpu_gbps},
                       {"memcpy_cpu_gbps", memcpy_cpu_gbps},
                       {"cpu_ratio", cpu_ratio},
                       {"page_faults_per_pull", pull_faults},
                       {"page_faults_per_memcpy", memcpy_faults}};
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("transport {}{}: {} ranks pulling {} bytes each: {:.2f} GB/s per rank "
               "(memcpy {:.2f} GB/s, {:.2f}x)\n",
               backend, memory == "allocated" ? "" : " (registered " + memory + " memory)", ranks,
               bytes, gbps, memcpy_gbps, ratio);
    fmt::print("  in CPU time: {:.2f} GB/s (memcpy {:.2f} GB/s, {:.2f}x); page faults per pull "
               "{:.0f}, per memcpy {:.0f}\n",
               cpu_gbps, memcpy_cpu_gbps, cpu_ratio, pull_faults, memcpy_faults);
  }
}

}  // namespace

void add_bench_transport(CLI::App& bench) {
  struct Args {
    std::string backend;
    int ranks = 2;
    int64_t bytes = 64 << 20;
    bool registered = false;
    bool shareable = false;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  std::string names;
  for (const auto& n : transport::backend_names()) names += (names.empty() ? "" : "|") + n;
  CLI::App* cmd = bench.add_subcommand(
      "transport", "Pull bandwidth of a transport backend, beside memcpy in the same run");
  cmd->add_option("--backend", args->backend, "Backend: " + names)->required();
  cmd->add_option("--ranks", args->ranks, "Ranks (threads for inproc, processes otherwise)");
  cmd->add_option("--bytes", args->bytes, "Bytes each rank pulls from its peers");
  cmd->add_flag("--registered", args->registered,
                "Serve memory the ranks allocated themselves (register_memory), as an engine's "
                "weights, instead of the transport's own");
  cmd->add_flag("--shareable", args->shareable,
                "With --registered: the ranks' memory comes from allocate_shareable() (eplb.empty)");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] {
    if (args->shareable && !args->registered) fail("--shareable needs --registered");
    const std::string memory =
        !args->registered ? "allocated" : args->shareable ? "shareable" : "heap";
    bench_transport(args->backend, args->ranks, args->bytes, memory, args->json);
  });
}

}  // namespace eplb::cli
