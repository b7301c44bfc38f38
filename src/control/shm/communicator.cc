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

constexpr std::uint64_t kMagic = 0x32'6d'68'73'62'6c'70'65;  // "eplbshm2" (layout version)
constexpr std::size_t kLine = 64;
// Payload bytes of one rank's buffer for one round; larger messages take several rounds.
constexpr std::size_t kCapacity = 32 * 1024;

// Waiting for the last rank of a round: spin while it is likely running on another core, then
// yield so that a peer sharing this core can run (8 ranks on 2 cores is a supported case),
// then sleep on the futex. The sleep is cut into slices to look for dead peers. Yielding comes
// before sleeping even with many more ranks than cores: a yield hands the core straight to a
// runnable peer, while a sleeper costs the publisher a wake-up and itself a trip through the
// scheduler's wake path (sleeping at once measured twice the p50 at 8 and at 64 ranks on
// 2 cores).
// The yield phase lasts kYieldFor, longer with many more ranks than cores: a round then takes
// about ranks / cores turns of the scheduler, and a rank that falls asleep before it ends costs
// a wake-up (64 ranks on 2 cores: p50 100-220 us with 100 us of yielding, 100-145 us with
// 1.6 ms, and less spread).
constexpr int kSpins = 256;
constexpr auto kYieldFor = std::chrono::microseconds(100);
constexpr int kYieldScaleMax = 16;
constexpr auto kSleepSlice = std::chrono::milliseconds(10);

enum Failure : std::uint32_t { kNone = 0, kPeerDied = 1, kPeerTimedOut = 2 };

struct alignas(kLine) Header {
  std::atomic<std::uint64_t> magic;  // written last by rank 0: the segment is ready
  std::int32_t size;
  std::uint32_t capacity;
  alignas(kLine) std::atomic<std::uint32_t> arrived;  // rank-rounds entered (wrapping)
  // The futex word: the last round whose outcome is published (wrapping). Written once per
  // round, by the rank that arrived last, so a sleeper is woken only when there is news.
  alignas(kLine) std::atomic<std::uint32_t> completed;
  std::atomic<std::uint32_t> sleepers;  // ranks asleep (or about to be) on `completed`
  std::atomic<std::int32_t> combiner;   // the rank that arrived last in the latest round
  alignas(kLine) std::atomic<std::uint32_t> failure;  // Failure; set once, after the next two
  std::atomic<std::uint32_t> reporting;               // taken by the first rank to report
  std::atomic<std::int32_t> failed_rank;              // the rank that died or was waited for
  std::atomic<std::int32_t> reporter;                 // the rank that found it
};

// The outcome of a round, written by the rank that arrived last before it publishes
// `completed`, read by every rank before it enters the next round (so one copy suffices: the
// next round's combiner writes only once every rank has entered that round).
struct alignas(kLine) Outcome {
  std::int32_t calls_differ;  // 1: some rank called another collective (each rank finds which)
  std::uint32_t values;       // all_reduce: the reduced values that follow
};

struct alignas(kLine) RankState {
  std::atomic<std::int32_t> pid;     // 0 before joining, -1 after leaving
  std::atomic<std::uint32_t> round;  // rounds entered (wrapping)
};

// Payloads up to kInline bytes (4 int64: the runtime's agreement, a barrier) travel in the
// buffer header itself. The headers of all ranks sit side by side, so the rank that combines a
// round reads one cache line per rank from a few pages, not two lines from a page per rank.
constexpr std::size_t kInline = 32;

struct alignas(kLine) BufferHeader {
  Call call;
  std::uint64_t total;  // bytes this rank contributes to the whole collective
  std::uint64_t chunk;  // bytes in this round: inline below if at most kInline, else in the
                        // rank's payload buffer
  std::byte inline_payload[kInline];
};
static_assert(sizeof(BufferHeader) == kLine);

constexpr std::size_t kOutcomeBytes = sizeof(Outcome) + kCapacity;

// Layout: Header, Outcome + values, RankState[size], BufferHeader[size][2],
// payload[size][2][kCapacity].
std::size_t segment_bytes(int size) {
  return sizeof(Header) + kOutcomeBytes + (sizeof(RankState) + 2 * sizeof(BufferHeader)) * size +
         kCapacity * 2 * size;
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
    enter_round(deadline, join);
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
    enter_round(deadline, call);
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
      enter_round(deadline, call);
      // The rank that arrived last reduced the chunk (in rank order) into the outcome.
      std::copy_n(outcome_values(), n, chunk.begin());
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
      enter_round(deadline, call);
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
      enter_round(deadline, call);
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
  Outcome& outcome() const {
    return *reinterpret_cast<Outcome*>(static_cast<char*>(base_) + sizeof(Header));
  }
  std::int64_t* outcome_values() const {
    return reinterpret_cast<std::int64_t*>(static_cast<char*>(base_) + sizeof(Header) +
                                           sizeof(Outcome));
  }
  RankState& rank_state(int r) const {
    return reinterpret_cast<RankState*>(static_cast<char*>(base_) + sizeof(Header) +
                                        kOutcomeBytes)[r];
  }
  // The buffer of rank r for round `round` (the local count: every rank is at the same round
  // when it reads): its header, and the payload that does not fit in it.
  BufferHeader* header_of(int r, std::uint32_t round) const {
    const std::size_t index = static_cast<std::size_t>(r) * 2 + (round & 1);
    return reinterpret_cast<BufferHeader*>(static_cast<char*>(base_) + sizeof(Header) +
                                           kOutcomeBytes + sizeof(RankState) * size()) +
           index;
  }
  std::byte* payload_of(int r, std::uint32_t round) const {
    const std::size_t index = static_cast<std::size_t>(r) * 2 + (round & 1);
    auto* payloads = reinterpret_cast<std::byte*>(header_of(0, 0) + 2 * size());
    return payloads + kCapacity * index;
  }
  const BufferHeader& buffer_header(int r) const { return *header_of(r, round_); }
  template <typename T>
  const T* payload(int r) const {
    const BufferHeader& head = buffer_header(r);
    return reinterpret_cast<const T*>(head.chunk <= kInline ? head.inline_payload
                                                            : payload_of(r, round_));
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
    new (&outcome()) Outcome{};
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
    BufferHeader* head = header_of(rank(), round_ + 1);
    head->call = call;
    head->total = total;
    head->chunk = chunk.size();
    if (chunk.empty()) return;
    std::byte* to = chunk.size() <= kInline ? head->inline_payload : payload_of(rank(), round_ + 1);
    std::memcpy(to, chunk.data(), chunk.size());
  }

  void check_calls(const Call& mine) const {
    for (int r = 0; r < size(); ++r) detail::check_same_call(mine, buffer_header(r).call, r);
  }

  void wake_all() { futex(&header().completed, FUTEX_WAKE, INT_MAX, nullptr); }

  static bool done(std::uint32_t completed, std::uint32_t round) {
    return static_cast<std::int32_t>(completed - round) >= 0;
  }

  // Counts this rank into the next round and returns once every rank has entered it and the
  // round's outcome is published; throws IoError when the ranks' calls differ from `mine`.
  //
  // Step 1: arrive. The rank that arrives last combines (checks the calls, reduces an
  // all-reduce) and publishes: one rank reads every buffer, the others read one outcome, so a
  // round costs O(ranks), not O(ranks^2), in memory traffic and page touches.
  // Step 2: the others wait for the outcome (wait_for).
  // Step 3: every rank looks at the outcome.
  void enter_round(Clock::time_point deadline, const Call& mine) {
    Header& header = this->header();
    const std::uint32_t round = ++round_;
    rank_state(rank()).round.store(round, std::memory_order_release);
    const std::uint32_t target = round * static_cast<std::uint32_t>(size());
    const std::uint32_t before = header.arrived.fetch_add(1, std::memory_order_acq_rel);
    if (before + 1 == target) {
      combine();
      header.completed.store(round, std::memory_order_seq_cst);
      // Only a rank counted in `sleepers` can be asleep: the syscall is skipped on the fast
      // path, when every waiter is still spinning or yielding.
      if (header.sleepers.load(std::memory_order_seq_cst) > 0) wake_all();
    } else {
      wait_for(round, deadline);
    }
    if (outcome().calls_differ != 0) {
      check_calls(mine);
      fail<IoError>("the ranks called different collectives in round ", round);
    }
  }

  // Run by the rank that arrived last: every rank's buffer for this round is written.
  void combine() {
    Header& header = this->header();
    Outcome& out = outcome();
    header.combiner.store(rank(), std::memory_order_relaxed);
    const BufferHeader& first = buffer_header(0);
    bool differ = false;
    for (int r = 1; r < size() && !differ; ++r) differ = !(buffer_header(r).call == first.call);
    out.calls_differ = differ ? 1 : 0;
    out.values = 0;
    if (differ || first.call.kind != Kind::kAllReduce) return;
    const std::size_t n = first.chunk / sizeof(std::int64_t);
    for (int r = 1; r < size(); ++r) {
      if (buffer_header(r).chunk != first.chunk) {
        out.calls_differ = 1;  // same call, other length: check_calls names no one; say so
        return;
      }
    }
    const auto op = static_cast<ReduceOp>(first.call.arg);
    std::span<std::int64_t> acc(outcome_values(), n);
    std::copy_n(payload<std::int64_t>(0), n, acc.begin());
    for (int r = 1; r < size(); ++r) {
      reduce_into(acc, std::span<const std::int64_t>(payload<std::int64_t>(r), n), op);
    }
    out.values = static_cast<std::uint32_t>(n);
  }

  // Waits until `round` is published. Spin while the last rank is likely running on another
  // core; yield so that a peer sharing this core can run; then sleep on the futex word, in
  // slices, looking for dead peers and the deadline between them.
  void wait_for(std::uint32_t round, Clock::time_point deadline) {
    Header& header = this->header();
    for (int i = 0; i < spins_; ++i) {
      if (done(header.completed.load(std::memory_order_acquire), round)) return;
      cpu_relax();
    }
    {
      const auto yield_until = Clock::now() + yield_for_;
      for (unsigned i = 1;; ++i) {
        if (done(header.completed.load(std::memory_order_acquire), round)) return;
        sched_yield();
        // The clock is read every 8th turn: cheap as it is, with many ranks a turn is short.
        if (i % 8 == 0 && Clock::now() >= yield_until) break;
      }
    }
    // Peers are looked at once a slice, not before the first sleep: with many ranks on few
    // cores most waits end in the first sleep, and N ranks each probing N peers' processes
    // every round would cost more than the round itself.
    auto next_check = Clock::now() + kSleepSlice;
    while (true) {
      if (done(header.completed.load(std::memory_order_acquire), round)) return;
      raise_failure();
      const auto now = Clock::now();
      if (now >= next_check || now >= deadline) {
        if (check_peers(round)) return;
        next_check = now + kSleepSlice;
      }
      if (now >= deadline) {
        if (done(header.completed.load(std::memory_order_acquire), round)) return;
        const int late = first_missing(round);
        const int stuck = late >= 0 ? late : header.combiner.load(std::memory_order_relaxed);
        report(kPeerTimedOut, stuck);
        if (late < 0) {
          fail<Timeout>("timed out waiting for rank ", stuck,
                        " to finish the round (it arrived last; stopped, hung or too slow)");
        }
        fail<Timeout>("timed out waiting for rank(s) ", missing(round),
                      " (stopped, hung or too slow)");
      }
      const auto slice = std::min<Clock::duration>(kSleepSlice, deadline - now);
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      const timespec relative{static_cast<time_t>(ns / 1'000'000'000),
                              static_cast<long>(ns % 1'000'000'000)};
      // Register, then look again: the publisher stores `completed` before it reads
      // `sleepers` (both seq_cst), so either it sees this rank counted and wakes it, or this
      // rank sees the round done here. The kernel compares the word again before sleeping.
      header.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t seen = header.completed.load(std::memory_order_seq_cst);
      if (!done(seen, round) && header.failure.load(std::memory_order_seq_cst) == kNone) {
        futex(&header.completed, FUTEX_WAIT, seen, &relative);
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

  // Looks for peers that are gone while `round` is not published: those that have not
  // entered it, or, once every rank has, any (the one combining may be the one that died).
  // Returns true when the round turns out to be published after all.
  bool check_peers(std::uint32_t round) {
    const bool all_in = first_missing(round) < 0;
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      const RankState& peer = rank_state(r);
      if (!all_in && entered(peer, round)) continue;
      const std::int32_t pid = peer.pid.load(std::memory_order_acquire);
      if (pid == 0) continue;  // not joined yet: only the deadline applies
      if (pid > 0 && process_alive(pid)) continue;
      // It may have seen the round published and left or exited since the word was read; a
      // process that is gone moves no more, so a second read settles it.
      if (done(header().completed.load(std::memory_order_acquire), round)) return true;
      if (!all_in && entered(peer, round)) continue;
      report(kPeerDied, r);
      if (pid < 0) fail<IoError>("rank ", r, " left the group (its communicator was destroyed)");
      fail<IoError>("rank ", r, " (pid ", pid, ") died");
    }
    return false;
  }

  static bool entered(const RankState& peer, std::uint32_t round) {
    return static_cast<std::int32_t>(peer.round.load(std::memory_order_acquire) - round) >= 0;
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
  // 100 us up to 2 ranks a core, then in proportion (64 ranks on 2 cores: 1.6 ms).
  const std::chrono::microseconds yield_for_ =
      kYieldFor * std::clamp(size() / (2 * std::max(online_cpus(), 1)), 1, kYieldScaleMax);
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
