// The ucx transport's batches: post() copies what is mapped (or local) at once and starts a
// ucp_get_nbx for the rest; UcxBatch completes them in poll() and wait(), checks that the owners
// are alive and open, and on destruction of a pending batch cancels what is left through
// abandon(). A UcxBatch owns its BatchState and borrows the Transport, which must outlive it.
// Everything here runs on the reading side, except on_get_done(), which runs on whichever thread
// progresses the reading worker (the reading thread or the progress thread).

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/process.h"
#include "transport/ucx/ucx_transport.h"

namespace eplb::transport::ucx {

// State of one batch. Get callbacks run on whichever thread progresses the worker (the reading
// thread or the progress thread), so everything they touch is under `mu`.
struct BatchState {
  std::mutex mu;
  std::condition_variable cv;
  int outstanding = 0;
  ucs_status_t error = UCS_OK;
  int error_peer = -1;
  std::vector<char> completed;                               // [get]
  std::vector<int> get_peer;                                 // [get] rank
  std::vector<std::pair<BatchState*, std::size_t>> contexts; // [get] callback argument
  // Reading thread only:
  std::string failed;               // the IoError message, once failed
  bool done = false;
  bool timed_out = false;           // a wait() passed its deadline
  std::vector<int> peers;           // ranks this batch reads from (sorted, unique)
};

namespace {

// How often a pending batch checks that the owners on this machine are alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(1);

void on_get_done(void* request, ucs_status_t status, void* user_data) {
  const auto* context = static_cast<std::pair<BatchState*, std::size_t>*>(user_data);
  BatchState* state = context->first;
  {
    std::lock_guard lock(state->mu);
    state->completed[context->second] = 1;
    --state->outstanding;
    if (status != UCS_OK && state->error == UCS_OK) {
      state->error = status;
      state->error_peer = state->get_peer[context->second];
    }
  }
  state->cv.notify_all();
  ucp_request_free(request);
}

class UcxBatch final : public Batch {
 public:
  UcxBatch(UcxTransport& transport, std::unique_ptr<BatchState> state)
      : transport_(transport), state_(std::move(state)) {}
  ~UcxBatch() override {
    int outstanding;
    {
      std::lock_guard lock(state_->mu);
      outstanding = state_->outstanding;
    }
    if (outstanding > 0 && !transport_.abandon(*state_)) {
      (void)state_.release();  // a callback may still come: leak rather than free under it
    }
  }

  Progress poll() override {
    if (state_->failed.empty() && !state_->done) advance();
    if (!state_->failed.empty()) fail<IoError>(state_->failed);
    return state_->done ? Progress::kDone : Progress::kPending;
  }

  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (poll() == Progress::kPending) {
      const auto now = Clock::now();
      if (now >= deadline) {
        std::string ranks;
        int outstanding;
        {
          std::lock_guard lock(state_->mu);
          outstanding = state_->outstanding;
          std::vector<int> stuck;
          for (std::size_t i = 0; i < state_->completed.size(); ++i) {
            if (!state_->completed[i]) stuck.push_back(state_->get_peer[i]);
          }
          std::sort(stuck.begin(), stuck.end());
          stuck.erase(std::unique(stuck.begin(), stuck.end()), stuck.end());
          for (int r : stuck) {
            if (!ranks.empty()) ranks += ',';
            ranks += std::to_string(r);
          }
        }
        state_->timed_out = true;
        fail<Timeout>("ucx: ", outstanding, " reads from rank(s) ", ranks, " not done after ",
                      timeout.count(), " ms");
      }
      // The progress thread completes gets too; sleep until one does, a liveness check is due,
      // or the deadline.
      std::unique_lock lock(state_->mu);
      state_->cv.wait_for(lock, std::min<Clock::duration>(deadline - now, kLivenessPeriod),
                          [&] { return state_->outstanding == 0 || state_->error != UCS_OK; });
    }
  }

 private:
  void advance() {
    transport_.progress();
    ucs_status_t error;
    int error_peer, outstanding;
    {
      std::lock_guard lock(state_->mu);
      error = state_->error;
      error_peer = state_->error_peer;
      outstanding = state_->outstanding;
    }
    if (error != UCS_OK) {
      const int reason = transport_.peer(error_peer).failure.load();
      state_->failed = "ucx: a read from rank " + std::to_string(error_peer) +
                       " failed: " + ucs_status_string(error);
      if (reason != UCS_OK && reason != error) {
        state_->failed += std::string(" (") +
                          ucs_status_string(static_cast<ucs_status_t>(reason)) + ")";
      }
      return;
    }
    const auto now = Clock::now();
    if (outstanding == 0 || now - last_check_ >= kLivenessPeriod) {
      last_check_ = now;
      state_->failed = transport_.check_owners(*state_);
      if (!state_->failed.empty()) return;
    }
    if (outstanding == 0) state_->done = true;
  }

  UcxTransport& transport_;
  std::unique_ptr<BatchState> state_;
  Clock::time_point last_check_{};
};

}  // namespace

std::unique_ptr<Batch> UcxTransport::post(std::span<const Read> reads) {
  check_open();
  std::vector<std::uint64_t> own_bytes;
  for (const LocalRegion& r : regions_) own_bytes.push_back(r.bytes);
  auto is_self = [&](int rank) {
    return rank == rank_ && (static_cast<std::size_t>(rank) >= peers_.size() ||
                             !peers_[rank] || peers_[rank]->self);
  };
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const Read& r = reads[i];
    if (is_self(r.peer)) {
      check_read(r, i, own_bytes);
      continue;
    }
    if (r.peer < 0 || static_cast<std::size_t>(r.peer) >= peers_.size() || !peers_[r.peer]) {
      fail_unknown_peer(r, i, peers_.size());
    }
    check_read(r, i, peers_[r.peer]->bytes);
  }

  auto state = std::make_unique<BatchState>();
  for (const Read& r : reads) {
    if (!is_self(r.peer)) state->peers.push_back(r.peer);
  }
  std::sort(state->peers.begin(), state->peers.end());
  state->peers.erase(std::unique(state->peers.begin(), state->peers.end()), state->peers.end());
  for (int rank : state->peers) {
    const Peer& p = peer(rank);
    const int failure = p.failure.load();
    if (failure != UCS_OK || p.abandoned) {
      state->failed = "ucx: rank " + std::to_string(rank) + " failed earlier (" +
                      (failure != UCS_OK ? ucs_status_string(static_cast<ucs_status_t>(failure))
                                         : "a batch reading from it was abandoned") +
                      "); import its descriptor again to read from it";
      return std::make_unique<UcxBatch>(*this, std::move(state));
    }
  }

  // Slots for every get first: a callback may run on the progress thread as soon as its get is
  // posted, and must find its slot in place.
  std::size_t gets = 0;
  for (const Read& r : reads) {
    if (r.bytes > 0 && !is_self(r.peer) &&
        peer(r.peer).direct[static_cast<std::size_t>(r.region)] == nullptr) {
      ++gets;
    }
  }
  state->completed.assign(gets, 0);
  state->get_peer.reserve(gets);
  state->contexts.reserve(gets);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &on_get_done;
  for (const Read& r : reads) {
    if (r.bytes == 0) continue;
    const auto region = static_cast<std::size_t>(r.region);
    if (is_self(r.peer)) {
      std::memcpy(r.dst, regions_[region].data + r.offset, r.bytes);
      continue;
    }
    Peer& p = peer(r.peer);
    if (p.direct[region] != nullptr) {
      std::memcpy(r.dst, p.direct[region] + r.offset, r.bytes);
      continue;
    }
    const std::size_t slot = state->get_peer.size();
    state->get_peer.push_back(r.peer);
    state->contexts.emplace_back(state.get(), slot);
    param.user_data = &state->contexts.back();
    {
      std::lock_guard lock(state->mu);
      ++state->outstanding;
    }
    const ucs_status_ptr_t request =
        ucp_get_nbx(p.ep, r.dst, r.bytes, p.base[region] + r.offset, p.rkeys[region], &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
      // Done (or failed) in place: no callback will come.
      std::lock_guard lock(state->mu);
      state->completed[slot] = 1;
      --state->outstanding;
      if (UCS_PTR_IS_ERR(request) && state->error == UCS_OK) {
        state->error = UCS_PTR_STATUS(request);
        state->error_peer = r.peer;
      }
    }
  }
  return std::make_unique<UcxBatch>(*this, std::move(state));
}

std::string UcxTransport::check_owners(const BatchState& state) {
  std::vector<const PeerProcess*> watched;
  for (int rank : state.peers) {
    const Peer& p = peer(rank);
    const int failure = p.failure.load();
    if (failure != UCS_OK) {
      return "ucx: rank " + std::to_string(rank) +
             " failed: " + ucs_status_string(static_cast<ucs_status_t>(failure));
    }
    if (p.control != nullptr &&
        reinterpret_cast<const std::atomic<std::uint8_t>*>(p.control)->load(
            std::memory_order_acquire) == 0) {
      return "ucx: rank " + std::to_string(rank) + " closed its transport";
    }
    if (p.process.watching()) watched.push_back(&p.process);
  }
  if (all_alive(watched)) return "";
  for (int rank : state.peers) {
    if (peer(rank).process.watching() && !peer(rank).process.alive()) {
      return "ucx: rank " + std::to_string(rank) + " is gone (its process exited)";
    }
  }
  return "";
}

bool UcxTransport::abandon(BatchState& state) {
  auto stuck_peers = [&state] {
    std::vector<int> stuck;
    std::lock_guard lock(state.mu);
    for (std::size_t i = 0; i < state.completed.size(); ++i) {
      if (!state.completed[i]) stuck.push_back(state.get_peer[i]);
    }
    std::sort(stuck.begin(), stuck.end());
    stuck.erase(std::unique(stuck.begin(), stuck.end()), stuck.end());
    return stuck;
  };
  auto drain = [&](Clock::duration within) {
    const auto deadline = Clock::now() + within;
    while (true) {
      progress();
      std::unique_lock lock(state.mu);
      if (state.outstanding == 0) return true;
      if (Clock::now() >= deadline) return false;
      state.cv.wait_for(lock, std::chrono::milliseconds(1));
    }
  };
  // Gets cannot be cancelled one by one; closing an endpoint cancels all of its gets, and the
  // peer is unusable until imported again. Step 1: close the endpoints of peers that failed,
  // are gone, or stalled past a wait's deadline. Step 2: let reads from healthy peers finish.
  // Step 3: close whatever still holds a read.
  for (int rank : stuck_peers()) {
    Peer& p = peer(rank);
    if (state.timed_out || p.failure.load() != UCS_OK ||
        (p.process.watching() && !p.process.alive())) {
      force_close(p);
    }
  }
  if (drain(kCloseTimeout)) return true;
  for (int rank : stuck_peers()) force_close(peer(rank));
  return drain(kCloseTimeout);
}

}  // namespace eplb::transport::ucx
