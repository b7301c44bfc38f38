#pragma once
// UcxTransport, the class behind ucx::create() (transport.h describes its design), and the
// records it keeps. Three files define it:
//   connection.cc  the UCX context, the two workers, the progress thread, endpoints and their
//                  handshake, close()
//   region.cc      regions (ucp_mem_map) and the descriptor that carries them: export, import
//   batch.cc       post() and its batch: poll(), wait(), and what a pending batch does when
//                  destroyed
//
// Ownership. The Transport owns the UCX context, both workers and their event fds, the progress
// thread, its regions (control_, regions_) and its peers (peers_); a Peer owns its endpoint and
// its unpacked rkeys; a batch owns its BatchState.
//
// Threads. Every method is the reading side of eplb/transport/transport.h (one thread at a time)
// except serve(), which is the progress thread. Callbacks run on whichever thread progresses
// their worker, and an endpoint's error handler on any thread: the members they touch say so.

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/transport/transport.h"
#include "transport/process.h"

// Wraps a UCX status once: anything but UCS_OK is an IoError naming the call and the status.
#define EPLB_UCX_CHECK(expr, ...)                                                       \
  do {                                                                                  \
    const ucs_status_t eplb_status_ = (expr);                                           \
    if (eplb_status_ != UCS_OK) {                                                       \
      ::eplb::fail<::eplb::IoError>("ucx: ", __VA_ARGS__, ": ",                          \
                                    ucs_status_string(eplb_status_), " (", #expr, ")"); \
    }                                                                                   \
  } while (0)

namespace eplb::transport::ucx {

constexpr std::string_view kBackend = "ucx";
// How long close() and a cancelled batch wait for UCX to release an endpoint.
constexpr auto kCloseTimeout = std::chrono::seconds(10);

using Clock = std::chrono::steady_clock;

// Memory mapped (and possibly allocated) by UCX, with its packed rkey.
struct LocalRegion {
  ucp_mem_h memh = nullptr;
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  std::vector<std::byte> rkey;
};

struct Peer {
  int rank = -1;
  bool self = false;
  ucp_ep_h ep = nullptr;
  PeerProcess process;                    // owners on this machine only
  std::vector<ucp_rkey_h> rkeys;          // [region id]
  std::vector<std::uint64_t> base;        // [region id] remote address
  std::vector<std::uint64_t> bytes;       // [region id]
  std::vector<const std::byte*> direct;   // [region id] mapped by ucp_rkey_ptr, or null
  ucp_rkey_h control_rkey = nullptr;
  const std::byte* control = nullptr;     // the owner's open flag, when mapped
  bool abandoned = false;                 // its endpoint was force-closed by a cancelled batch
  std::atomic<int> failure{UCS_OK};       // set by the endpoint's error handler (any thread)

  bool one_sided() const {
    return std::all_of(direct.begin(), direct.end(), [](const std::byte* p) { return p; });
  }
};

struct BatchState;  // one batch's state (batch.cc)

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const Options& options);
  ~UcxTransport() override { close(); }

  std::string_view backend() const override { return kBackend; }
  int rank() const override { return rank_; }
  Capabilities capabilities() const override {
    return {.device_memory = false, .one_sided = false, .register_memory = true,
            .cross_node = true};
  }

  Region allocate(std::size_t bytes) override;
  Region register_memory(void* data, std::size_t bytes) override;
  std::vector<std::byte> export_descriptor() const override;
  void import_descriptor(int peer, std::span<const std::byte> descriptor) override;
  bool one_sided_to(int peer) const override;
  std::unique_ptr<Batch> post(std::span<const Read> reads) override;
  void close() override;

  // For batches (reading thread).
  void progress() {
    while (ucp_worker_progress(reader_) != 0) {
    }
  }
  // "" when every owner `state` read from is alive and open, else why not.
  std::string check_owners(const BatchState& state);
  // Force-closes the endpoints `state` still waits on, so UCX cancels its gets; false if a get
  // is still held after that (the state must then never be freed).
  bool abandon(BatchState& state);
  Peer& peer(int rank) { return *peers_[static_cast<std::size_t>(rank)]; }

 private:
  LocalRegion map_memory(void* address, std::size_t bytes, bool allocate);
  void release_peer(Peer& p);
  void force_close(Peer& p);
  void close_endpoint(ucp_ep_h ep);
  void handshake(Peer& p);
  ucp_worker_h make_worker(int* efd);
  void serve();
  void check_open() const {
    if (closed_) fail<InvalidArgument>("ucx transport of rank ", rank_, " is closed");
  }

  int rank_;
  ProcessIdentity identity_;
  bool closed_ = false;
  // Whether a peer may ever have talked to the worker (its address left this process, or an
  // endpoint was created); see close().
  mutable bool reachable_ = false;
  ucp_context_h context_ = nullptr;
  // Two workers, each shared by the reading thread and the progress thread
  // (UCS_THREAD_MODE_MULTI). The serving worker's address is the one in the descriptor: peers
  // connect to it, and it never connects to anyone itself. The reading worker holds this rank's
  // endpoints to peers' serving workers, and its address is never handed out. So no two workers
  // ever connect to each other from both ends at once: UCX 1.13 mishandles that "simultaneous
  // connect" of two ranks importing each other at the same moment (a failed assertion in
  // ucp_ep_update_remote_id). The progress thread serves both.
  ucp_worker_h worker_ = nullptr;  // serving
  ucp_worker_h reader_ = nullptr;  // reading
  int efd_ = -1;
  int reader_efd_ = -1;
  // The last handshake token echoed back to the reading worker (set on the thread that
  // progresses it); import_descriptor() waits for its own.
  std::atomic<std::uint64_t> acked_{0};
  std::uint64_t hello_token_ = 0;
  int stop_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread progress_thread_;
  std::vector<std::byte> address_;            // the worker's address
  LocalRegion control_;                       // byte 0: 1 while open
  std::vector<LocalRegion> regions_;          // [region id]
  std::vector<std::unique_ptr<Peer>> peers_;  // [peer rank]; null where not imported
};

}  // namespace eplb::transport::ucx
