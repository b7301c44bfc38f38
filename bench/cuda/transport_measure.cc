// eplb_cuda_transport_measure: what the cuda transport costs and gives on one GPU.
//
//   (a) pull bandwidth between two processes through the cuda transport (CUDA IPC, copy engines),
//       beside a same-process cudaMemcpy device to device of the same bytes, same run;
//   (b) the time a forward-like GEMM loop loses while a migration (pulls from the other process,
//       kept back to back) runs beside it, against the same loop alone, interleaved in one run.
// Both for each way the transport can issue its copies (EPLB_CUDA_COPY=batch: one
// cudaMemcpyBatchAsync with the overlap-with-compute hint, the default; =memcpy: one
// cudaMemcpyAsync per read). Exits 1 when a path could not be measured (the reason is printed).
//
// Two processes, forked before anything touches CUDA: rank 0 owns the region (and then only
// waits), rank 1 pulls and computes. Readable lines, or one JSON object with --json. Exits 0 with
// "no CUDA device" where there is none.
//
// Usage: eplb_cuda_transport_measure [--bytes N] [--read-bytes N] [--rounds N]
//                                    [--gemm M N K] [--gemm-iters N] [--json]

#include <cuda_runtime_api.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/transport/registry.h"

namespace eplb::bench {

// transport_measure_gemm.cu
cudaError_t launch_sgemm(int m, int n, int k, const float* a, const float* b, float* c,
                         cudaStream_t stream);

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kStepTimeout = 120s;     // any one wait between the two processes
constexpr auto kProgramTimeout = 300s;  // the whole run, enforced by the parent

struct Args {
  std::size_t bytes = std::size_t{1} << 30;
  std::size_t read_bytes = std::size_t{64} << 20;
  int rounds = 10;
  int m = 2048, n = 4096, k = 4096;  // tokens x hidden -> intermediate: an expert-FFN-like GEMM
  int gemm_iters = 40;
  bool json = false;
};

// Shared by the two processes: anonymous shared memory mapped before the fork.
struct Board {
  std::atomic<int> owner_ready;
  std::atomic<int> reader_done;
  std::atomic<int> failed;
  std::atomic<int> no_device;
  char error[1024];
  std::uint32_t descriptor_bytes;
  std::byte descriptor[64 * 1024];
  // Results, written by the reader.
  char gpu[256];
  int sms;
  double memcpy_gbps, gemm_alone_ms, gemm_tflops;
  struct Path {
    int measured;
    char error[512];  // why not
    double pull_gbps, gemm_migrating_ms, migration_gbps;
  } paths[2];  // [kPaths index]
};

// The cuda transport's two ways to issue a batch's copies (EPLB_CUDA_COPY), measured apart.
constexpr const char* kPaths[] = {"batch", "memcpy"};
constexpr const char* kPathNames[] = {"batched copies (overlap hint)",
                                      "one cudaMemcpyAsync per read"};

void report(Board& board, const std::string& message, bool no_device = false) {
  if (board.failed.exchange(1) == 0) {
    std::snprintf(board.error, sizeof board.error, "%s", message.c_str());
    if (no_device) board.no_device.store(1);
  }
}

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}
#define EPLB_MEASURE_CUDA(call) check((call), #call)

// Waits until `flag` is set, or the other process failed, or the step times out.
void await(Board& board, const std::atomic<int>& flag, const char* what) {
  const auto deadline = Clock::now() + kStepTimeout;
  while (flag.load() == 0) {
    if (board.failed.load() != 0) throw std::runtime_error("the other process failed");
    if (Clock::now() > deadline)
      throw std::runtime_error(std::string("timed out waiting for ") + what);
    std::this_thread::sleep_for(1ms);
  }
}

// Returns false (and says why on the board) when this process has no CUDA device.
bool have_device(Board& board) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return true;
  (void)cudaGetLastError();
  report(board,
         std::string("no CUDA device (cudaGetDeviceCount: ") +
             (status == cudaSuccess ? "0 devices" : cudaGetErrorString(status)) + ")",
         true);
  return false;
}

struct DeviceBuffer {
  void* data = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { EPLB_MEASURE_CUDA(cudaMalloc(&data, bytes)); }
  ~DeviceBuffer() { (void)cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- rank 0: the owner --------------------------------------------------------------------------

void run_owner(Board& board, const Args& args) {
  if (!have_device(board)) return;
  auto transport = transport::create("cuda", transport::Options{.rank = 0});
  const transport::Region region = transport->allocate(args.bytes);
  EPLB_MEASURE_CUDA(cudaMemset(region.data, 0x42, region.bytes));
  EPLB_MEASURE_CUDA(cudaDeviceSynchronize());
  const auto descriptor = transport->export_descriptor();
  if (descriptor.size() > sizeof board.descriptor) throw std::runtime_error("descriptor too large");
  std::memcpy(board.descriptor, descriptor.data(), descriptor.size());
  board.descriptor_bytes = static_cast<std::uint32_t>(descriptor.size());
  board.owner_ready.store(1);
  // From here on the owner takes no part: its memory is read while it sleeps.
  const auto deadline = Clock::now() + kProgramTimeout;
  while (board.reader_done.load() == 0 && board.failed.load() == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
}

// ---- rank 1: the reader -------------------------------------------------------------------------

// The reads of one pull of the whole region, in pieces of `read_bytes`.
std::vector<transport::Read> pull_reads(const Args& args, void* dst) {
  std::vector<transport::Read> reads;
  for (std::size_t at = 0; at < args.bytes; at += args.read_bytes) {
    reads.push_back(
        {0, 0, at, static_cast<std::byte*>(dst) + at, std::min(args.read_bytes, args.bytes - at)});
  }
  return reads;
}

// Completion by polling without sleeping, so a figure is not rounded up to a sleep.
void spin_until_done(transport::Batch& batch) {
  const auto deadline = Clock::now() + kStepTimeout;
  while (batch.poll() == transport::Progress::kPending) {
    if (Clock::now() > deadline) throw std::runtime_error("a pull did not finish in time");
  }
}

// One Transport per copy path, each with the owner's region imported; null where one could not
// start (the reason goes to the board).
using Transports = std::vector<std::unique_ptr<transport::Transport>>;

// Runs `measure` for every path still measurable; a path that throws is marked and skipped.
template <typename F>
void for_each_path(Board& board, Transports& transports, F&& measure) {
  for (std::size_t p = 0; p < transports.size(); ++p) {
    if (!transports[p]) continue;
    try {
      measure(p, *transports[p]);
    } catch (const std::exception& e) {
      std::snprintf(board.paths[p].error, sizeof board.paths[p].error, "%s", e.what());
      transports[p].reset();
    }
  }
}

void measure_bandwidth(Board& board, const Args& args, Transports& transports, void* dst) {
  const auto reads = pull_reads(args, dst);
  DeviceBuffer src(args.bytes);
  EPLB_MEASURE_CUDA(cudaMemset(src.data, 0x17, args.bytes));
  cudaStream_t stream = nullptr;
  EPLB_MEASURE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EPLB_MEASURE_CUDA(cudaDeviceSynchronize());
  auto memcpy_once = [&] {
    EPLB_MEASURE_CUDA(cudaMemcpyAsync(dst, src.data, args.bytes, cudaMemcpyDeviceToDevice, stream));
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    }
    EPLB_MEASURE_CUDA(cudaStreamQuery(stream));
  };
  auto pull_once = [&](transport::Transport& t) { spin_until_done(*t.post(reads)); };
  // Warm-up: first-use costs stay out of the figures.
  for_each_path(board, transports, [&](std::size_t, transport::Transport& t) { pull_once(t); });
  memcpy_once();
  std::vector<std::vector<double>> pull_s(transports.size());
  std::vector<double> copy_s;
  for (int round = 0; round < args.rounds; ++round) {
    for_each_path(board, transports, [&](std::size_t p, transport::Transport& t) {
      const auto t0 = Clock::now();
      pull_once(t);
      pull_s[p].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    });
    const auto t0 = Clock::now();
    memcpy_once();
    copy_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  board.memcpy_gbps = static_cast<double>(args.bytes) / median(copy_s) / 1e9;
  // The pulled bytes are the owner's.
  for_each_path(board, transports, [&](std::size_t p, transport::Transport& t) {
    EPLB_MEASURE_CUDA(cudaMemset(dst, 0, args.bytes));
    EPLB_MEASURE_CUDA(cudaDeviceSynchronize());
    pull_once(t);
    unsigned char first = 0, last = 0;
    EPLB_MEASURE_CUDA(cudaMemcpy(&first, dst, 1, cudaMemcpyDeviceToHost));
    EPLB_MEASURE_CUDA(cudaMemcpy(&last, static_cast<std::byte*>(dst) + args.bytes - 1, 1,
                                 cudaMemcpyDeviceToHost));
    if (first != 0x42 || last != 0x42) throw std::runtime_error("the pull returned wrong bytes");
    board.paths[p].pull_gbps = static_cast<double>(args.bytes) / median(pull_s[p]) / 1e9;
  });
  EPLB_MEASURE_CUDA(cudaStreamDestroy(stream));
}

// Values whose products and sums are exact in float, so the check below is exact.
float a_value(long long i, long long k) {
  return static_cast<float>((i * 7 + k * 3) % 13 - 6) * 0.125f;
}
float b_value(long long k, long long j) {
  return static_cast<float>((k * 5 + j * 11) % 17 - 8) * 0.0625f;
}

// Pulls back to back (two batches in flight, so the copy engines never idle) until `stop`.
class Migration {
 public:
  Migration(const Args& args, transport::Transport& transport, void* dst)
      : reads_(pull_reads(args, dst)), bytes_(args.bytes), transport_(transport) {}
  ~Migration() {
    if (thread_.joinable()) {
      stop_.store(true);
      thread_.join();
    }
  }
  Migration(const Migration&) = delete;
  Migration& operator=(const Migration&) = delete;

  void start() {
    stop_.store(false);
    started_.store(false);
    pulled_ = 0;
    thread_ = std::thread([this] {
      try {
        run();
      } catch (...) {
        error_ = std::current_exception();
        started_.store(true);
      }
    });
    while (!started_.load()) std::this_thread::yield();
  }

  // Stops, and returns the bandwidth it pulled at between start() and now.
  double stop() {
    stop_.store(true);
    thread_.join();
    if (error_) std::rethrow_exception(error_);
    return static_cast<double>(pulled_) / seconds_ / 1e9;
  }

 private:
  void run() {
    const auto t0 = Clock::now();
    std::unique_ptr<transport::Batch> previous = transport_.post(reads_);
    started_.store(true);
    while (!stop_.load()) {
      auto next = transport_.post(reads_);
      previous->wait(kStepTimeout);
      pulled_ += bytes_;
      previous = std::move(next);
    }
    previous->wait(kStepTimeout);
    pulled_ += bytes_;
    seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
  }

  std::vector<transport::Read> reads_;
  std::size_t bytes_;
  transport::Transport& transport_;
  std::thread thread_;
  std::atomic<bool> stop_{false}, started_{false};
  std::exception_ptr error_;
  std::size_t pulled_ = 0;
  double seconds_ = 1;
};

void measure_gemm(Board& board, const Args& args, Transports& transports, void* dst) {
  const std::size_t m = static_cast<std::size_t>(args.m), n = static_cast<std::size_t>(args.n),
                    k = static_cast<std::size_t>(args.k);
  std::vector<float> a(m * k), b(k * n);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < k; ++j)
      a[i * k + j] = a_value(static_cast<long long>(i), static_cast<long long>(j));
  }
  for (std::size_t i = 0; i < k; ++i) {
    for (std::size_t j = 0; j < n; ++j)
      b[i * n + j] = b_value(static_cast<long long>(i), static_cast<long long>(j));
  }
  DeviceBuffer da(a.size() * sizeof(float)), db(b.size() * sizeof(float)),
      dc(m * n * sizeof(float));
  EPLB_MEASURE_CUDA(
      cudaMemcpy(da.data, a.data(), a.size() * sizeof(float), cudaMemcpyHostToDevice));
  EPLB_MEASURE_CUDA(
      cudaMemcpy(db.data, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;  // the engine's serving stream: default priority
  EPLB_MEASURE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t begin = nullptr, end = nullptr;
  EPLB_MEASURE_CUDA(cudaEventCreate(&begin));
  EPLB_MEASURE_CUDA(cudaEventCreate(&end));
  EPLB_MEASURE_CUDA(cudaDeviceSynchronize());
  const auto* fa = static_cast<const float*>(da.data);
  const auto* fb = static_cast<const float*>(db.data);
  auto* fc = static_cast<float*>(dc.data);

  auto loop_ms = [&] {
    EPLB_MEASURE_CUDA(cudaEventRecord(begin, stream));
    for (int i = 0; i < args.gemm_iters; ++i) {
      EPLB_MEASURE_CUDA(launch_sgemm(args.m, args.n, args.k, fa, fb, fc, stream));
    }
    EPLB_MEASURE_CUDA(cudaEventRecord(end, stream));
    EPLB_MEASURE_CUDA(cudaEventSynchronize(end));
    float ms = 0;
    EPLB_MEASURE_CUDA(cudaEventElapsedTime(&ms, begin, end));
    return static_cast<double>(ms);
  };
  loop_ms();  // warm-up

  // The GEMM is right (exact values: see a_value/b_value).
  std::vector<float> c(m * n);
  EPLB_MEASURE_CUDA(cudaMemcpy(c.data(), fc, c.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (std::size_t probe = 0; probe < 64; ++probe) {
    const std::size_t i = (probe * 977) % m, j = (probe * 1231 + 7) % n;
    double expected = 0;
    for (std::size_t x = 0; x < k; ++x)
      expected += static_cast<double>(a[i * k + x]) * b[x * n + j];
    if (static_cast<double>(c[i * n + j]) != expected) {
      throw std::runtime_error("the SGEMM kernel computed a wrong value at (" + std::to_string(i) +
                               ", " + std::to_string(j) + ")");
    }
  }

  // Interleaved: alone, beside a migration on each path, alone, ... so that every figure sees
  // the same clocks and heat.
  std::vector<double> alone;
  std::vector<std::vector<double>> migrating(transports.size()), migration_gbps(transports.size());
  for (int round = 0; round < 3; ++round) {
    alone.push_back(loop_ms());
    for_each_path(board, transports, [&](std::size_t p, transport::Transport& t) {
      Migration migration(args, t, dst);
      migration.start();
      migrating[p].push_back(loop_ms());
      migration_gbps[p].push_back(migration.stop());
    });
  }
  board.gemm_alone_ms = median(alone);
  board.gemm_tflops = 2.0 * static_cast<double>(m) * static_cast<double>(n) *
                      static_cast<double>(k) * args.gemm_iters / (board.gemm_alone_ms / 1e3) / 1e12;
  for (std::size_t p = 0; p < transports.size(); ++p) {
    if (!transports[p]) continue;
    board.paths[p].gemm_migrating_ms = median(migrating[p]);
    board.paths[p].migration_gbps = median(migration_gbps[p]);
    board.paths[p].measured = 1;
  }
  EPLB_MEASURE_CUDA(cudaEventDestroy(begin));
  EPLB_MEASURE_CUDA(cudaEventDestroy(end));
  EPLB_MEASURE_CUDA(cudaStreamDestroy(stream));
}

void run_reader(Board& board, const Args& args) {
  if (!have_device(board)) return;
  int device = 0;
  EPLB_MEASURE_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  EPLB_MEASURE_CUDA(cudaGetDeviceProperties(&prop, device));
  std::snprintf(board.gpu, sizeof board.gpu, "%s", prop.name);
  board.sms = prop.multiProcessorCount;
  await(board, board.owner_ready, "the owner's descriptor");
  const std::span<const std::byte> descriptor(board.descriptor, board.descriptor_bytes);
  // Two Transports in this process, one per copy path; both map the owner's region (CUDA IPC
  // counts the second opening of a handle in a process, and returns the same mapping).
  Transports transports(std::size(kPaths));
  for (std::size_t p = 0; p < transports.size(); ++p) {
    ::setenv("EPLB_CUDA_COPY", kPaths[p], 1);
    try {
      transports[p] = transport::create("cuda", transport::Options{.rank = 1});
      transports[p]->import_descriptor(0, descriptor);
    } catch (const Error& e) {
      std::snprintf(board.paths[p].error, sizeof board.paths[p].error, "%s", e.what());
      transports[p].reset();
    }
  }
  ::unsetenv("EPLB_CUDA_COPY");
  DeviceBuffer dst(args.bytes);
  measure_bandwidth(board, args, transports, dst.data);
  measure_gemm(board, args, transports, dst.data);
  board.reader_done.store(1);
}

// ---- the parent ---------------------------------------------------------------------------------

std::size_t parse_size(const char* flag, const char* text) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0' || value == 0) {
    fail<InvalidArgument>(flag, " ", text, ": give a positive whole number");
  }
  return static_cast<std::size_t>(value);
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&](int ahead = 1) -> const char* {
      if (i + ahead >= argc) fail<InvalidArgument>(flag, " needs a value");
      return argv[i + ahead];
    };
    if (flag == "--json") {
      args.json = true;
    } else if (flag == "--bytes") {
      args.bytes = parse_size("--bytes", value());
      ++i;
    } else if (flag == "--read-bytes") {
      args.read_bytes = parse_size("--read-bytes", value());
      ++i;
    } else if (flag == "--rounds") {
      args.rounds = static_cast<int>(parse_size("--rounds", value()));
      ++i;
    } else if (flag == "--gemm") {
      args.m = static_cast<int>(parse_size("--gemm M", value(1)));
      args.n = static_cast<int>(parse_size("--gemm N", value(2)));
      args.k = static_cast<int>(parse_size("--gemm K", value(3)));
      i += 3;
    } else if (flag == "--gemm-iters") {
      args.gemm_iters = static_cast<int>(parse_size("--gemm-iters", value()));
      ++i;
    } else if (flag == "--help" || flag == "-h") {
      std::printf(
          "usage: %s [--bytes N] [--read-bytes N] [--rounds N] [--gemm M N K] "
          "[--gemm-iters N] [--json]\n",
          argv[0]);
      std::exit(0);
    } else {
      fail<InvalidArgument>("unknown option ", flag, " (see --help)");
    }
  }
  if (args.m % 64 != 0 || args.n % 64 != 0 || args.k % 16 != 0) {
    fail<InvalidArgument>("--gemm ", args.m, " ", args.n, " ", args.k,
                          ": M and N must be multiples of 64 and K of 16 (the kernel's tiles)");
  }
  return args;
}

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  void* mem =
      ::mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("cannot map shared memory");
  Board& board = *new (mem) Board{};
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int code = 0;
      try {
        rank == 0 ? run_owner(board, args) : run_reader(board, args);
      } catch (const std::exception& e) {
        report(board, std::string(rank == 0 ? "owner: " : "reader: ") + e.what());
        code = 1;
      }
      std::fflush(stdout);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + kProgramTimeout;
  std::vector<int> status(pids.size(), -1);
  for (std::size_t done = 0; done < pids.size();) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      int st = 0;
      if (status[r] == -1 && ::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        ++done;
      }
    }
    if (Clock::now() > deadline) {
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (status[r] == -1) ::kill(pids[r], SIGKILL);
      }
      report(board, "the measurement did not finish within " +
                        std::to_string(kProgramTimeout.count()) + " s");
    }
    std::this_thread::sleep_for(2ms);
  }
  for (int s : status) {
    if (WIFSIGNALED(s))
      report(board, std::string("a process was killed by signal ") + strsignal(WTERMSIG(s)));
  }

  if (board.no_device.load() != 0) {
    if (args.json) {
      std::printf("%s\n",
                  nlohmann::json{{"no_device", true}, {"reason", board.error}}.dump().c_str());
    } else {
      std::printf("%s: nothing to measure\n", board.error);
    }
    return 0;
  }
  if (board.failed.load() != 0) {
    std::fprintf(stderr, "eplb_cuda_transport_measure: %s\n", board.error);
    return 1;
  }
  bool all_measured = true;
  if (args.json) {
    nlohmann::json paths = nlohmann::json::object();
    for (std::size_t p = 0; p < std::size(kPaths); ++p) {
      const Board::Path& r = board.paths[p];
      if (r.measured == 0) {
        all_measured = false;
        paths[kPaths[p]] = {{"error", r.error}};
        continue;
      }
      paths[kPaths[p]] = {
          {"pull_gbps", r.pull_gbps},
          {"pull_over_memcpy", r.pull_gbps / board.memcpy_gbps},
          {"gemm_with_migration_ms", r.gemm_migrating_ms},
          {"gemm_slowdown_pct", (r.gemm_migrating_ms / board.gemm_alone_ms - 1) * 100},
          {"migration_gbps", r.migration_gbps}};
    }
    const nlohmann::json out{{"gpu", board.gpu},
                             {"sms", board.sms},
                             {"bytes", args.bytes},
                             {"read_bytes", args.read_bytes},
                             {"rounds", args.rounds},
                             {"memcpy_d2d_gbps", board.memcpy_gbps},
                             {"gemm",
                              {{"m", args.m},
                               {"n", args.n},
                               {"k", args.k},
                               {"iters", args.gemm_iters},
                               {"alone_ms", board.gemm_alone_ms},
                               {"tflops", board.gemm_tflops}}},
                             {"paths", paths}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf(
        "cuda transport on %s (%d SMs): %zu MiB pulled from another process in %zu MiB "
        "reads, median of %d\n",
        board.gpu, board.sms, args.bytes >> 20, args.read_bytes >> 20, args.rounds);
    for (std::size_t p = 0; p < std::size(kPaths); ++p) {
      const Board::Path& r = board.paths[p];
      if (r.measured == 0) {
        all_measured = false;
        std::printf("  pull, %-30s  not measured: %s\n", kPathNames[p], r.error);
        continue;
      }
      std::printf("  pull, %-30s  %7.1f GB/s  (%.2f x same-process memcpy)\n", kPathNames[p],
                  r.pull_gbps, r.pull_gbps / board.memcpy_gbps);
    }
    std::printf("  same-process cudaMemcpy device to device  %7.1f GB/s\n", board.memcpy_gbps);
    std::printf("  GEMM loop, %dx%dx%d SGEMM x %d, alone: %.2f ms (%.1f TFLOP/s)\n", args.m, args.n,
                args.k, args.gemm_iters, board.gemm_alone_ms, board.gemm_tflops);
    for (std::size_t p = 0; p < std::size(kPaths); ++p) {
      const Board::Path& r = board.paths[p];
      if (r.measured == 0) continue;
      std::printf("    beside a migration, %-30s  %.2f ms: %+.1f%%  (migration pulled %.1f GB/s)\n",
                  kPathNames[p], r.gemm_migrating_ms,
                  (r.gemm_migrating_ms / board.gemm_alone_ms - 1) * 100, r.migration_gbps);
    }
  }
  if (!all_measured) {
    std::fprintf(stderr, "eplb_cuda_transport_measure: a copy path could not be measured\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace eplb::bench

int main(int argc, char** argv) {
  try {
    return eplb::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eplb_cuda_transport_measure: %s\n", e.what());
    return 2;
  }
}
