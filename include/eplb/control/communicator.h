#pragma once
// The control plane: small CPU collectives among the ranks of one deployment.
//
// A Communicator connects `size` ranks. Every collective (barrier, all_reduce, broadcast,
// all_gather) must be called by every rank, in the same order, with matching arguments
// (same element count and op for all_reduce, same root for broadcast); payloads are small
// (control messages, descriptors, a window of load counts), not bulk data.
//
// Contract: each collective finishes within its timeout or throws. A rank that is gone (its
// process died, or in-process: its communicator was destroyed) makes every survivor's pending
// or next collective throw eplb::IoError; a rank that stops answering (stopped, hung, too
// slow) makes it throw eplb::Timeout. Messages start with "control <op>" and name the backend,
// this rank and, where known, the peer at fault. No collective waits forever.
// After an IoError or Timeout the communicator is broken: the ranks may be out of step, so
// every later call throws IoError at once; build a new one (mpi: the process must exit, see
// mpi below). InvalidArgument (bad argument on this rank) leaves it usable.
//
// Ownership: a Communicator is owned by one rank of one process; destroying it leaves the group
// (peers still waiting on this rank get IoError where the backend can tell, Timeout otherwise).
//
// Thread-safety: a communicator may be used from any thread, including one that did not create
// it, but never from two threads at once: the calls of one communicator are a sequence. In the
// runtime one control thread owns it and other threads hand it their collectives. A concurrent
// call is detected and throws InvalidArgument rather than corrupting the sequence.
// rank(), size(), backend() and broken() may be called from any thread at any time.
//
// Implementing a backend (the engine's seam: an engine that has its own collectives gives them
// to eplb instead of letting eplb build a control plane; docs/design.md, "Embedding"). Subclass
// Communicator with the rank and size of the group and implement the four do_* hooks below:
//   - which thread: one at a time, never concurrently (the public calls detect misuse), from
//     the thread of Rebalancer::connect() or reconfigure() at start-up, then from the runtime's
//     control thread only: the engine's forward thread never calls them;
//   - the deadline: finish by it or throw eplb::Timeout; no hook may wait without bound (a
//     stopped peer must not hang the control thread);
//   - failure: a peer gone or a connection broken throws eplb::IoError with a message that
//     says what failed (and, where the backend can tell, which peer); the base class then
//     marks the communicator broken and every later call throws IoError at once;
//   - arguments arrive checked (sizes, root) with the deadline computed; messages get the
//     "control <op>" prefix from the public call.
// The collectives' order is eplb's: every rank issues the same sequence, so a group shared
// with the engine's own collectives must not interleave with them (dedicate one to eplb).
// The torch.distributed adapter of the Python module is one implementation
// (python/src/python_communicator.h).
//
// Backends (see backend_names() for those built): inproc (ranks are threads of one process;
// reference and test double), shm (processes of one machine, flags in POSIX shared memory),
// gloo (TCP through Debian's gloo; rendezvous through a shared folder or Redis; connect sets
// SIGPIPE to ignored unless the program handles it, so a dead peer's socket fails a collective
// instead of killing the rank), mpi (OpenMPI, when launched by mpirun). How to start ranks: eplb/control/launch.h.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace eplb::control {

using Bytes = std::vector<std::byte>;
using Clock = std::chrono::steady_clock;

enum class ReduceOp : std::uint8_t { kMin, kMax, kSum };
std::string_view to_string(ReduceOp op);  // "min" | "max" | "sum"

// Passed as the timeout of a collective: use the communicator's default (Options::timeout).
inline constexpr std::chrono::milliseconds kDefaultTimeout{-1};

// How a rank joins its group. `rendezvous` is where the ranks meet; its meaning depends on the
// backend:
//   inproc  any name, shared by the threads of one group in this process;
//   shm     any name, shared by the processes of one group on this machine (it names a POSIX
//           shared-memory segment, removed once every rank has joined);
//   gloo    a folder shared by all ranks (gloo FileStore; created if missing), or
//           redis://host:port (gloo RedisStore), as torch.distributed uses them;
//   mpi     unused: the group is mpirun's world (rank and size must match it or be -1).
// `group` separates several communicators that meet through one rendezvous.
struct Options {
  int rank = 0;
  int size = 1;
  std::string rendezvous;
  std::string group = "eplb";
  // Default timeout of every collective, and the limit on joining the group.
  std::chrono::milliseconds timeout{30'000};
  // gloo only: the address to listen on. Empty: the interface named by GLOO_SOCKET_IFNAME
  // (torch's variable) if set, else this host's name.
  std::string hostname;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string_view backend() const = 0;
  std::chrono::milliseconds timeout() const { return timeout_; }
  // True after a collective failed with IoError or Timeout.
  bool broken() const;

  void barrier(std::chrono::milliseconds timeout = kDefaultTimeout);

  // In place: on return every rank holds op over all ranks' values, element by element.
  // Every rank passes the same number of values.
  void all_reduce(std::span<std::int64_t> values, ReduceOp op,
                  std::chrono::milliseconds timeout = kDefaultTimeout);

  // On return every rank's `data` equals root's (any length, zero included).
  void broadcast(Bytes& data, int root, std::chrono::milliseconds timeout = kDefaultTimeout);

  // Returns every rank's `data`, indexed by rank; lengths may differ between ranks.
  std::vector<Bytes> all_gather(std::span<const std::byte> data,
                                std::chrono::milliseconds timeout = kDefaultTimeout);

 protected:
  Communicator(int rank, int size, std::chrono::milliseconds timeout);

  // The backend's collectives. Arguments are validated and the deadline computed; they throw
  // IoError or Timeout without the "control <op>" prefix, which the public calls add.
  virtual void do_barrier(Clock::time_point deadline) = 0;
  virtual void do_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                             Clock::time_point deadline) = 0;
  virtual void do_broadcast(Bytes& data, int root, Clock::time_point deadline) = 0;
  virtual std::vector<Bytes> do_all_gather(std::span<const std::byte> data,
                                           Clock::time_point deadline) = 0;

 private:
  template <typename F>
  auto run(const char* op, std::chrono::milliseconds timeout, F&& body);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  struct State;
  std::unique_ptr<State> state_;
};

// Element-wise reduction shared by the backends: acc[i] = op(acc[i], in[i]).
void reduce_into(std::span<std::int64_t> acc, std::span<const std::int64_t> in, ReduceOp op);

// The registry of built backends, filled explicitly (no self-registration).
using Factory = std::function<std::unique_ptr<Communicator>(const Options&)>;

// Names of the backends this build has, in a fixed order: inproc, shm, then gloo and mpi
// where built.
std::vector<std::string> backend_names();

// Joins the group described by `options` with the named backend. Blocks until every rank has
// joined or options.timeout passes (Timeout). Unknown backend or bad options: InvalidArgument
// naming the value and what would be right.
std::unique_ptr<Communicator> connect(std::string_view backend, const Options& options);

}  // namespace eplb::control
