#include "control/shm/communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <thread>

#include "control/protocol.h"
#include "eplb/core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace eplb::control::shm {
namespace {

using detail::Call;
using detail::Kind;

constexpr std::uint64_t kMagic = 0x31'6d'68'73'62'6c'70'65;  // "eplbshm1"
constexpr std::size_t kLine = 64;
// Payload bytes of one rank's buffer for one round; larger messages take several rounds.
constexpr std::size_t kCapacity = 32 * 1024;

// Waiting for the last rank of a round: spin while it is likely running on another core, then
// yield so that a peer sharing this core can run (8 ranks on 2 cores is a supported case),
// then sleep on the futex. The sleep is cut into slices to look for dead peers.
constexpr int kSpins = 256;
constexpr auto kYieldFor = std::chrono::microseconds(100);
constexpr auto kSleepSlice = std::chrono::milliseconds(10);

enum Failure : std::uint32_t { kNone = 0, kPeerDied = 1, kPeerTimedOut = 2 };

struct alignas(kLine) Header {
  std::atomic<std::uint64_t> magic;  // written last by rank 0: the segment is ready
  std::int32_t size;
  std::uint32_t capacity;
  alignas(kLine) std::atomic<std::uint32_t> arrived;  // futex word: rank-rounds entered
  std::atomic<std::uint32_t> sleepers;                // ranks asleep on `arrived`
  alignas(kLine) std::atomic<std::uint32_t> failure;  // Failure; set once, after the next two
  std::atomic<std::uint32_t> reporting;               // taken by the first rank to report
  std::atomic<std::int32_t> failed_rank;              // the rank that died or was waited for
  std::atomic<std::int32_t> reporter;                 // the rank that found it
};

struct alignas(kLine) RankState {
  std::atomic<std::int32_t> pid;     // 0 before joining, -1 after leaving
  std::atomic<std::uint32_t> round;  // rounds entered (wrapping)
};

struct alignas(kLine) BufferHeader {
  Call call;
  std::uint64_t total;  // bytes this rank contributes to the whole collective
  std::uint64_t chunk;  // bytes in this round
};

constexpr std::size_t kBufferStride = sizeof(BufferHeader) + kCapacity;

std::size_t segment_bytes(int size) {
  return sizeof(Header) + sizeof(RankState) * size + kBufferStride * 2 * size;
}

// A name for shm_open: "/eplb.<rendezvous>.<group>", characters outside [A-Za-z0-9._-] made
// '_', and hashed when too long for a file name.
std::string segment_name(const std::string& rendezvous, const std::string& group) {
  std::string name = rendezvous + "." + group;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  }
  if (name.size() > 200) {
    std::uint64_t hash = 1469598103934665603ull;  // FNV-1a
    for (unsigned char c : rendezvous + "\n" + group) hash = (hash ^ c) * 1099511628211ull;
    name = name.substr(0, 150) + "." + std::to_string(hash);
  }
  return "/eplb." + name;
}

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value,
           const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, timeout, nullptr,
                 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A process that has exited is gone even before its parent reaps it (a zombie).
bool process_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;  // no /proc: trust kill()
  const auto paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return true;
  const char state = text[paren + 2];
  return state != 'Z' && state != 'X';
}

std::string errno_text(int err) { return std::strerror(err); }

int online_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(const Options& options, std::string name)
      : Communicator(options.rank, options.size, options.timeout), name_(std::move(name)),
        bytes_(segment_bytes(options.size)) {}

  ~ShmCommunicator() override {
    if (base_ != nullptr) {
      rank_state(rank()).pid.store(-1, std::memory_order_release);
      wake_all();
      munmap(base_, bytes_);
    }
    if (rank() == 0 && !unlinked_) shm_unlink(name_.c_str());
  }

  std::string_view backend() const override { return "shm"; }

  void open(Clock::time_point deadline) {
    if (rank() == 0) {
      create();
    } else {
      attach(deadline);
    }
    rank_state(rank()).pid.store(static_cast<std::int32_t>(getpid()), std::memory_order_release);
    Call join{Kind::kJoin, 0, 0};
    write(join, 0, {});
    enter_round(deadline);
    check_calls(join);
    // Everyone has mapped the segment: the name is no longer needed, and removing it now
    // leaves nothing behind whatever happens next.
    if (rank() == 0) {
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
  }

 protected:
  void do_barrier(Clock::time_point deadline) override {
    const Call call{Kind::kBarrier, 0, 0};
    write(call, 0, {});
    enter_round(deadline);
    check_calls(call);
  }

  void do_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                     Clock::time_point deadline) override {
    const Call call{Kind::kAllReduce, static_cast<std::uint32_t>(op), values.size()};
    constexpr std::size_t per_round = kCapacity / sizeof(std::int64_t);
    std::size_t done = 0;
    do {
      const std::size_t n = std::min(per_round, values.size() - done);
      const auto chunk = values.subspan(done, n);
      write(call, values.size_bytes(), std::as_bytes(chunk));
      enter_round(deadline);
      check_calls(call);
      // Step: reduce in rank order, the same on every rank.
      std::copy_n(payload<std::int64_t>(0), n, chunk.begin());
      for (int r = 1; r < size(); ++r) {
        reduce_into(chunk, std::span<const std::int64_t>(payload<std::int64_t>(r), n), op);
      }
      done += n;
    } while (done < values.size());
  }

  void do_broadcast(Bytes& data, int root, Clock::time_point deadline) override {
    const Call call{Kind::kBroadcast, static_cast<std::uint32_t>(root), 0};
    const bool is_root = rank() == root;
    std::uint64_t total = is_root ? data.size() : 0;
    std::uint64_t done = 0;
    bool first = true;
    do {
      const std::size_t n = is_root ? std::min<std::uint64_t>(kCapacity, total - done) : 0;
      write(call, total,
            is_root ? std::span<const std::byte>(data.data() + done, n)
                    : std::span<const std::byte>{});
      enter_round(deadline);
      check_calls(call);
      const BufferHeader& from = buffer_header(root);
      if (first && !is_root) {
        total = from.total;
        data.resize(total);
      }
      first = false;
      if (!is_root && from.chunk > 0) std::memcpy(data.data() + done, payload<std::byte>(root), from.chunk);
      done += from.chunk;
    } while (done < total);
  }

  std::vector<Bytes> do_all_gather(std::span<const std::byte> data,
                                   Clock::time_point deadline) override {
    const Call call{Kind::kAllGather, 0, 0};
    std::vector<Bytes> out(size());
    std::vector<std::uint64_t> done(size(), 0);
    bool first = true;
    bool more = false;
    do {
      const std::size_t mine = std::min<std::size_t>(kCapacity, data.size() - done[rank()]);
      write(call, data.size(), data.subspan(done[rank()], mine));
      enter_round(deadline);
      check_calls(call);
      more = false;
      for (int r = 0; r < size(); ++r) {
        const BufferHeader& from = buffer_header(r);
        if (first) out[r].resize(from.total);
        if (from.chunk > 0) std::memcpy(out[r].data() + done[r], payload<std::byte>(r), from.chunk);
        done[r] += from.chunk;
        more = more || done[r] < out[r].size();
      }
      first = false;
    } while (more);
    return out;
  }

 private:
  Header& header() const { return *static_cast<Header*>(base_); }
  RankState& rank_state(int r) const {
    return reinterpret_cast<RankState*>(static_cast<char*>(base_) + sizeof(Header))[r];
  }
  // The buffer of rank r for round `round` (the local count: every rank is at the same round
  // when it reads).
  char* buffer(int r, std::uint32_t round) const {
    const std::size_t index = static_cast<std::size_t>(r) * 2 + (round & 1);
    return static_cast<char*>(base_) + sizeof(Header) + sizeof(RankState) * size() +
           kBufferStride * index;
  }
  const BufferHeader& buffer_header(int r) const {
    return *reinterpret_cast<const BufferHeader*>(buffer(r, round_));
  }
  template <typename T>
  const T* payload(int r) const {
    return reinterpret_cast<const T*>(buffer(r, round_) + sizeof(BufferHeader));
  }

  void create() {
    shm_unlink(name_.c_str());  // a segment left by a run that died while joining
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      fail<IoError>("cannot create shared memory segment '", name_, "': ", errno_text(errno));
    }
    if (ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      const int err = errno;
      close(fd);
      fail<IoError>("cannot size shared memory segment '", name_, "' to ", bytes_,
                    " bytes: ", errno_text(err));
    }
    map(fd);
    auto* header = new (base_) Header{};
    header->size = size();
    header->capacity = static_cast<std::uint32_t>(kCapacity);
    for (int r = 0; r < size(); ++r) {
      new (&rank_state(r)) RankState{};
    }
    // Before the magic: a joining rank checks that rank 0 is alive.
    rank_state(0).pid.store(static_cast<std::int32_t>(getpid()), std::memory_order_relaxed);
    header->magic.store(kMagic, std::memory_order_release);
  }

  void attach(Clock::time_point deadline) {
    std::string last = "it does not exist yet";
    while (true) {
      const int fd = shm_open(name_.c_str(), O_RDWR, 0);
      if (fd >= 0) {
        struct stat st {};
        if (fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) == bytes_) {
          map(fd);
          const Header& header = this->header();
          if (header.magic.load(std::memory_order_acquire) == kMagic) {
            if (header.size != size()) {
              fail<InvalidArgument>("shared memory segment '", name_, "' has ", header.size,
                                    " ranks but this rank was told ", size(),
                                    " (every rank must pass the same size)");
            }
            if (process_alive(rank_state(0).pid.load(std::memory_order_acquire))) return;
            last = "it was left by a run whose rank 0 is gone";
          } else {
            last = "rank 0 has not finished creating it";
          }
          munmap(base_, bytes_);
          base_ = nullptr;
        } else {
          close(fd);
          last = "rank 0 has not sized it yet (or it was made for another size)";
        }
      } else if (errno != ENOENT) {
        last = errno_text(errno);
      }
      if (Clock::now() >= deadline) {
        fail<Timeout>("timed out joining shared memory segment '", name_, "': ", last,
                      " (is rank 0 running, with the same rendezvous and group?)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  void map(int fd) {
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (base == MAP_FAILED) {
      fail<IoError>("cannot map shared memory segment '", name_, "': ", errno_text(err));
    }
    base_ = base;
  }

  // Fills this rank's buffer for the next round.
  void write(const Call& call, std::uint64_t total, std::span<const std::byte> chunk) {
    char* buf = buffer(rank(), round_ + 1);
    auto* head = reinterpret_cast<BufferHeader*>(buf);
    head->call = call;
    head->total = total;
    head->chunk = chunk.size();
    if (!chunk.empty()) std::memcpy(buf + sizeof(BufferHeader), chunk.data(), chunk.size());
  }

  void check_calls(const Call& mine) const {
    for (int r = 0; r < size(); ++r) detail::check_same_call(mine, buffer_header(r).call, r);
  }

  void wake_all() { futex(&header().arrived, FUTEX_WAKE, INT_MAX, nullptr); }

  // Counts this rank into the next round and returns once every rank has entered it.
  void enter_round(Clock::time_point deadline) {
    Header& header = this->header();
    const std::uint32_t round = ++round_;
    rank_state(rank()).round.store(round, std::memory_order_release);
    const std::uint32_t target = round * static_cast<std::uint32_t>(size());
    const std::uint32_t before = header.arrived.fetch_add(1, std::memory_order_seq_cst);
    if (before + 1 == target) {
      if (header.sleepers.load(std::memory_order_seq_cst) > 0) wake_all();
      return;
    }
    const auto reached = [&](std::uint32_t arrived) {
      return static_cast<std::int32_t>(arrived - target) >= 0;
    };

    // Step 1: spin, for a peer running on another core; pointless when the ranks outnumber
    // the cores, where the peer is more likely waiting for this one.
    for (int i = 0; i < spins_; ++i) {
      if (reached(header.arrived.load(std::memory_order_acquire))) return;
      cpu_relax();
    }
    // Step 2: yield, for a peer waiting for this core.
    const auto yield_until = Clock::now() + kYieldFor;
    do {
      if (reached(header.arrived.load(std::memory_order_acquire))) return;
      sched_yield();
    } while (Clock::now() < yield_until);
    // Step 3: sleep on the futex, looking for dead peers and the deadline between slices.
    while (true) {
      if (reached(header.arrived.load(std::memory_order_acquire))) return;
      raise_failure();
      const auto now = Clock::now();
      check_peers(round);
      if (now >= deadline) {
        if (reached(header.arrived.load(std::memory_order_acquire))) return;
        report(kPeerTimedOut, first_missing(round));
        fail<Timeout>("timed out waiting for rank(s) ", missing(round),
                      " (stopped, hung or too slow)");
      }
      const auto slice = std::min<Clock::duration>(kSleepSlice, deadline - now);
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      const timespec relative{static_cast<time_t>(ns / 1'000'000'000),
                              static_cast<long>(ns % 1'000'000'000)};
      header.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t seen = header.arrived.load(std::memory_order_seq_cst);
      if (!reached(seen) && header.failure.load(std::memory_order_seq_cst) == kNone) {
        futex(&header.arrived, FUTEX_WAIT, seen, &relative);
      }
      header.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Ranks that have not entered `round`.
  std::string missing(std::uint32_t round) const {
    std::string out;
    for (int r = 0; r < size(); ++r) {
      if (static_cast<std::int32_t>(rank_state(r).round.load(std::memory_order_acquire) -
                                    round) < 0) {
        out += (out.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return out;
  }

  int first_missing(std::uint32_t round) const {
    for (int r = 0; r < size(); ++r) {
      if (static_cast<std::int32_t>(rank_state(r).round.load(std::memory_order_acquire) -
                                    round) < 0) {
        return r;
      }
    }
    return -1;
  }

  void check_peers(std::uint32_t round) {
    for (int r = 0; r < size(); ++r) {
      const RankState& peer = rank_state(r);
      if (static_cast<std::int32_t>(peer.round.load(std::memory_order_acquire) - round) >= 0) {
        continue;
      }
      const std::int32_t pid = peer.pid.load(std::memory_order_acquire);
      if (pid == 0) continue;  // not joined yet: only the deadline applies
      if (pid > 0 && process_alive(pid)) continue;
      // It may have entered the round, finished it and left or exited since its round was
      // read; a process that is gone moves no more, so a second read settles it.
      if (static_cast<std::int32_t>(peer.round.load(std::memory_order_acquire) - round) >= 0) {
        continue;
      }
      report(kPeerDied, r);
      if (pid < 0) fail<IoError>("rank ", r, " left the group (its communicator was destroyed)");
      fail<IoError>("rank ", r, " (pid ", pid, ") died");
    }
  }

  // Tells every rank of the group that it is broken, once, and wakes the sleepers.
  void report(Failure failure, int failed_rank) {
    Header& header = this->header();
    if (header.reporting.exchange(1, std::memory_order_acq_rel) == 0) {
      header.failed_rank.store(failed_rank, std::memory_order_relaxed);
      header.reporter.store(rank(), std::memory_order_relaxed);
      header.failure.store(failure, std::memory_order_seq_cst);
    }
    wake_all();
  }

  // Throws when a peer has reported a failure of the group.
  void raise_failure() const {
    const Header& header = this->header();
    const std::uint32_t failure = header.failure.load(std::memory_order_seq_cst);
    if (failure == kNone) return;
    const int failed = header.failed_rank.load(std::memory_order_relaxed);
    const int reporter = header.reporter.load(std::memory_order_relaxed);
    if (failure == kPeerTimedOut) {
      fail<Timeout>("rank ", reporter, " timed out waiting for rank ", failed,
                    " (stopped, hung or too slow)");
    }
    fail<IoError>("rank ", failed, " died or left (found by rank ", reporter, ")");
  }

  const std::string name_;
  const std::size_t bytes_;
  void* base_ = nullptr;
  bool unlinked_ = false;
  std::uint32_t round_ = 0;  // rounds this rank has entered
  const int spins_ = size() <= online_cpus() ? kSpins : 0;
};

}  // namespace

std::unique_ptr<Communicator> connect(const Options& options) {
  if (options.rendezvous.empty()) {
    fail<InvalidArgument>("control shm: Options::rendezvous is empty (give the ranks a name "
                          "they share, unique on this machine)");
  }
  const std::string name = segment_name(options.rendezvous, options.group);
  auto comm = std::make_unique<ShmCommunicator>(options, name);
  const auto prefix = ::eplb::detail::concat("control connect (shm, rank ", options.rank,
                                             " of ", options.size, ", segment '", name, "'): ");
  try {
    comm->open(Clock::now() + options.timeout);
  } catch (const Timeout& e) {
    fail<Timeout>(prefix, e.what());
  } catch (const IoError& e) {
    fail<IoError>(prefix, e.what());
  }
  return comm;
}

}  // namespace eplb::control::shm
