#pragma once
// One-sided reads of registered memory: the data plane that moves expert weights.
//
// Each rank creates one Transport, allocates (or registers) the regions peers will read from,
// exports a descriptor (a few hundred bytes), and hands it to every peer through the control
// plane; each peer imports it under that rank's number. From then on a rank pulls bytes from any
// peer's regions with post(): a batch of reads `(peer, region, offset) -> local pointer, bytes`,
// completed with poll() or wait(timeout). The reading side does all the work. The serving side
// never takes part in a transfer, except for a progress thread the backend runs itself where its
// protocol needs one (UCX over TCP emulates a read with messages); capabilities() and
// one_sided_to() say which case holds.
//
// Ownership. Memory from allocate() belongs to the Transport and stays valid until the Transport
// is destroyed; memory given to register_memory() stays the caller's and must outlive the
// Transport. A peer's regions are only ever read, never written, and a local destination belongs
// to the caller: it must stay valid until its batch is done, failed, or destroyed. Nothing is
// written to a destination after its Batch is destroyed (a pending batch is cancelled).
//
// Threads. allocate(), register_memory(), export_descriptor(), import_descriptor(), post(),
// close() and everything on a Batch form the reading side: one thread at a time (any thread, not
// only the creating one; calls from two threads must be ordered by the caller, as the runtime's
// worker thread does). rank(), backend() and capabilities() may be called from any thread. The
// regions' bytes may be changed by their owner only while no peer reads them; the protocol above
// (the control plane's agreement) guarantees that, the transport does not. Every Batch must be
// destroyed before its Transport is closed.
//
// Failure. A read of a peer that is gone (its process exited or was killed, or it closed its
// Transport) fails with IoError; a read that does not finish in time fails with Timeout. A batch
// reports kDone only if every owner it read from was still alive and open when its bytes had
// arrived: with one-sided shared memory a dead owner's pages stay readable, and this check is
// what keeps a read of a dead peer from succeeding silently. After IoError or Timeout the peer
// may be unusable until its descriptor is imported again. Bad input (unknown peer or region,
// out-of-bounds read, a malformed or foreign descriptor) fails with InvalidArgument.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace eplb::transport {

// "In progress" is a state, not an error.
enum class Progress { kPending, kDone };

// What a backend can do. Operations a backend lacks throw NotSupported.
struct Capabilities {
  bool device_memory = false;    // regions and destinations may be GPU memory
  bool one_sided = false;        // reads of allocated regions never need the owner's CPU, on any
                                 // configuration; when false, ask one_sided_to(peer)
  bool register_memory = false;  // register_memory() can serve reads from caller buffers
  bool cross_node = false;       // peers may run on other machines
};

struct Options {
  int rank = 0;  // this rank; descriptors carry it and import_descriptor() checks it
  // hybrid: the name of this rank's node; peers of the same name are read through shared
  // memory, the others through UCX. Empty: this machine. Other backends ignore it.
  std::string node = {};
};

// A piece of registered memory of this rank, readable by peers that imported its descriptor.
struct Region {
  int id = -1;                 // index among this Transport's regions, in order of creation
  std::byte* data = nullptr;   // local address
  std::size_t bytes = 0;
};

// One read: `bytes` bytes at `offset` of region `region` of rank `peer`, copied to `dst`.
// The peer may be this rank (a local copy). A zero-length read may have a null `dst`.
struct Read {
  int peer = 0;
  int region = 0;
  std::uint64_t offset = 0;
  void* dst = nullptr;
  std::size_t bytes = 0;
};

// The reads of one post(). Destroying a pending batch cancels it and returns only once nothing
// will be written to its destinations any more.
class Batch {
 public:
  virtual ~Batch() = default;

  // kDone once every read has landed; throws IoError if a read failed or an owner is gone.
  // Once done or failed, later calls give the same answer.
  virtual Progress poll() = 0;

  // Blocks until poll() would return kDone, or throws IoError, or Timeout when `timeout` passes
  // first (the batch then stays pending: wait again, or destroy it to give up).
  virtual void wait(std::chrono::milliseconds timeout) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view backend() const = 0;
  virtual int rank() const = 0;
  virtual Capabilities capabilities() const = 0;

  // A new region of `bytes` bytes (> 0) of memory the backend serves best (shared, or allocated
  // by UCX), zero-filled.
  virtual Region allocate(std::size_t bytes) = 0;

  // Registers caller memory as a new region; NotSupported where peers cannot read it
  // (capabilities().register_memory).
  virtual Region register_memory(void* data, std::size_t bytes) = 0;

  // This rank's regions as they are now, as bytes to hand to every peer. Regions created later
  // need a new export and import.
  virtual std::vector<std::byte> export_descriptor() const = 0;

  // Makes rank `peer`'s regions readable from here. `descriptor` must come from rank `peer` on
  // the same backend (InvalidArgument otherwise, naming what was wrong). Importing this rank's
  // own descriptor is allowed; own regions are readable without it. Importing again replaces the
  // peer's previous view (and clears a failure). Where the backend has connections (UCX) the
  // connection is complete when this returns; a peer that cannot be reached gives IoError.
  virtual void import_descriptor(int peer, std::span<const std::byte> descriptor) = 0;

  // Whether reads from `peer`'s allocated regions need no help from the peer's CPU, as measured
  // on the imported connection (UCX: a mapped shared-memory key rather than emulated gets).
  virtual bool one_sided_to(int peer) const = 0;

  // Starts a batch of reads. Checks every read first (InvalidArgument for an unknown peer or
  // region, or a range outside the region) and starts none if one is bad.
  virtual std::unique_ptr<Batch> post(std::span<const Read> reads) = 0;

  // Releases everything: peers reading from here fail with IoError from now on. Idempotent;
  // the destructor calls it.
  virtual void close() = 0;
};

}  // namespace eplb::transport
