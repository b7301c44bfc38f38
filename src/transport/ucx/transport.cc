#include "transport/ucx/transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/descriptor.h"
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
namespace {

constexpr std::string_view kBackend = "ucx";
constexpr std::uint16_t kVersion = 1;
constexpr std::size_t kControlBytes = 64;
// How long close() and a cancelled batch wait for UCX to release an endpoint.
constexpr auto kCloseTimeout = std::chrono::seconds(10);
// How long import_descriptor() waits for the connection handshake with a live peer: only a
// bound that turns a hang into an error.
constexpr auto kConnectTimeout = std::chrono::seconds(60);
// Active-message ids of the connection handshake (see import_descriptor()).
constexpr unsigned kHelloId = 1;     // reader -> owner's serving worker: a token
constexpr unsigned kHelloAckId = 2;  // serving worker -> reader: the token back
// How often a pending batch checks that the owners on this machine are alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(1);

using Clock = std::chrono::steady_clock;

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

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

// The serving worker's half of the handshake: echo the token to the reader that sent it. Runs
// on the progress thread. The reply is queued on the same endpoint as this worker's handshake
// reply, after it, so it reaches the reader only once that reply has.
ucs_status_t on_hello(void*, const void*, std::size_t, void* data, std::size_t length,
                      const ucp_am_recv_param_t* param) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
      length != sizeof(std::uint64_t)) {
    return UCS_OK;  // not ours to answer
  }
  auto* token = new std::uint64_t;
  std::memcpy(token, data, sizeof *token);
  ucp_request_param_t param_out{};
  param_out.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param_out.cb.send = [](void* request, ucs_status_t, void* user_data) {
    delete static_cast<std::uint64_t*>(user_data);
    ucp_request_free(request);
  };
  param_out.user_data = token;
  const ucs_status_ptr_t request =
      ucp_am_send_nbx(param->reply_ep, kHelloAckId, nullptr, 0, token, sizeof *token, &param_out);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) delete token;  // no callback will come
  return UCS_OK;
}

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

UcxTransport::UcxTransport(const Options& options)
    : rank_(options.rank), identity_(ProcessIdentity::self()) {
  EPLB_CHECK_GE(options.rank, 0, "transport rank must be >= 0");
  // UCX reads its own environment (UCX_TLS, UCX_NET_DEVICES, ...); nothing is overridden here.
  ucp_config_t* config = nullptr;
  EPLB_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config), "cannot read the UCX configuration");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  const ucs_status_t init = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (init != UCS_OK) {
    fail<IoError>("ucx: cannot start UCX: ", ucs_status_string(init), " (UCX_TLS=",
                  env_or("UCX_TLS", "<unset>"), ", UCX_NET_DEVICES=",
                  env_or("UCX_NET_DEVICES", "<unset>"), ")");
  }
  try {
    worker_ = make_worker(&efd_);
    reader_ = make_worker(&reader_efd_);
    auto set_handler = [](ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb,
                          void* arg) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = cb;
      hp.arg = arg;
      EPLB_UCX_CHECK(ucp_worker_set_am_recv_handler(worker, &hp),
                     "cannot set an active-message handler");
    };
    set_handler(worker_, kHelloId, &on_hello, nullptr);
    set_handler(
        reader_, kHelloAckId,
        [](void* arg, const void*, std::size_t, void* data, std::size_t length,
           const ucp_am_recv_param_t*) {
          if (length == sizeof(std::uint64_t)) {
            std::uint64_t token;
            std::memcpy(&token, data, sizeof token);
            static_cast<std::atomic<std::uint64_t>*>(arg)->store(token,
                                                                 std::memory_order_release);
          }
          return UCS_OK;
        },
        &acked_);
    ucp_address_t* address = nullptr;
    std::size_t length = 0;
    EPLB_UCX_CHECK(ucp_worker_get_address(worker_, &address, &length),
                   "cannot get the worker address");
    const auto* a = reinterpret_cast<const std::byte*>(address);
    address_.assign(a, a + length);
    ucp_worker_release_address(worker_, address);
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop_fd_ < 0) fail<IoError>("ucx: eventfd failed: ", std::strerror(errno));
    control_ = map_memory(nullptr, kControlBytes, /*allocate=*/true);
    std::memset(control_.data, 0, kControlBytes);
    reinterpret_cast<std::atomic<std::uint8_t>*>(control_.data)->store(1);
    progress_thread_ = std::thread([this] { serve(); });
  } catch (...) {
    close();
    throw;
  }
}

ucp_worker_h UcxTransport::make_worker(int* efd) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  ucp_worker_h worker = nullptr;
  EPLB_UCX_CHECK(ucp_worker_create(context_, &wp, &worker), "cannot create a worker");
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  const ucs_status_t queried = ucp_worker_query(worker, &attr);
  const ucs_status_t got_efd = ucp_worker_get_efd(worker, efd);
  if (queried != UCS_OK || got_efd != UCS_OK || attr.thread_mode != UCS_THREAD_MODE_MULTI) {
    ucp_worker_destroy(worker);
    EPLB_UCX_CHECK(queried, "cannot query the worker");
    EPLB_UCX_CHECK(got_efd, "no event fd for the worker");
    fail<IoError>("ucx: this UCX was built without multi-thread support, which the ",
                  "progress thread needs");
  }
  return worker;
}

void UcxTransport::serve() {
  pollfd fds[3] = {{efd_, POLLIN, 0}, {reader_efd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  while (!stop_.load(std::memory_order_acquire)) {
    while (ucp_worker_progress(worker_) + ucp_worker_progress(reader_) != 0) {
    }
    // Events that arrived meanwhile: progress again.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY || ucp_worker_arm(reader_) == UCS_ERR_BUSY) {
      continue;
    }
    // The periodic wake-up is only a backstop; requests wake the thread through the event fds.
    ::poll(fds, 3, 100);
  }
}

LocalRegion UcxTransport::map_memory(void* address, std::size_t bytes, bool allocate) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = address;
  mp.length = bytes;
  mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  LocalRegion r;
  EPLB_UCX_CHECK(ucp_mem_map(context_, &mp, &r.memh), allocate ? "cannot allocate " : "cannot ",
                 allocate ? "" : "register ", bytes, " bytes");
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  EPLB_UCX_CHECK(ucp_mem_query(r.memh, &attr), "cannot query mapped memory");
  // UCX reports the registration's own start, which for caller memory may be rounded down to
  // a page: the region is the caller's bytes, from the caller's address.
  r.data = allocate ? static_cast<std::byte*>(attr.address) : static_cast<std::byte*>(address);
  r.bytes = bytes;
  void* packed = nullptr;
  std::size_t packed_size = 0;
  EPLB_UCX_CHECK(ucp_rkey_pack(context_, r.memh, &packed, &packed_size), "cannot pack an rkey");
  const auto* p = static_cast<const std::byte*>(packed);
  r.rkey.assign(p, p + packed_size);
  ucp_rkey_buffer_release(packed);
  return r;
}

Region UcxTransport::allocate(std::size_t bytes) {
  EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate() needs a positive size");
  check_open();
  regions_.push_back(map_memory(nullptr, bytes, /*allocate=*/true));
  LocalRegion& r = regions_.back();
  std::memset(r.data, 0, bytes);  // also faults the pages in now, not at the first read
  return {static_cast<int>(regions_.size()) - 1, r.data, r.bytes};
}

Region UcxTransport::register_memory(void* data, std::size_t bytes) {
  EPLB_CHECK(data != nullptr, "register_memory() of a null pointer");
  EPLB_CHECK_GT(bytes, std::size_t{0}, "register_memory() needs a positive size");
  check_open();
  regions_.push_back(map_memory(data, bytes, /*allocate=*/false));
  LocalRegion& r = regions_.back();
  return {static_cast<int>(regions_.size()) - 1, r.data, r.bytes};
}

std::vector<std::byte> UcxTransport::export_descriptor() const {
  check_open();
  reachable_ = true;
  DescriptorWriter out(kBackend, kVersion, rank_);
  out.put(identity_);
  out.put(static_cast<std::uint32_t>(address_.size()));
  out.put_bytes(address_.data(), address_.size());
  auto put_region = [&](const LocalRegion& r) {
    out.put(reinterpret_cast<std::uint64_t>(r.data));
    out.put(static_cast<std::uint64_t>(r.bytes));
    out.put(static_cast<std::uint32_t>(r.rkey.size()));
    out.put_bytes(r.rkey.data(), r.rkey.size());
  };
  put_region(control_);
  out.put(static_cast<std::uint32_t>(regions_.size()));
  for (const LocalRegion& r : regions_) put_region(r);
  return std::move(out).finish();
}

void UcxTransport::import_descriptor(int peer_rank, std::span<const std::byte> descriptor) {
  EPLB_CHECK_GE(peer_rank, 0, "import_descriptor(): peer rank must be >= 0");
  check_open();
  DescriptorReader in(descriptor, kBackend, kVersion);
  if (in.rank() != peer_rank) {
    fail<InvalidArgument>("descriptor of rank ", in.rank(), " imported as peer ", peer_rank,
                          ": hand each rank's descriptor to its own slot");
  }
  struct Entry {
    std::uint64_t base, bytes;
    std::span<const std::byte> rkey;
  };
  const auto identity = in.get<ProcessIdentity>("process identity");
  const auto address = in.get_span(in.get<std::uint32_t>("address length"), "worker address");
  auto get_entry = [&in] {
    Entry e;
    e.base = in.get<std::uint64_t>("region address");
    e.bytes = in.get<std::uint64_t>("region size");
    e.rkey = in.get_span(in.get<std::uint32_t>("rkey length"), "rkey");
    return e;
  };
  const Entry control = get_entry();
  std::vector<Entry> entries(in.get_count("region count", 20));
  for (Entry& e : entries) e = get_entry();
  in.expect_end();
  if (address.empty()) {
    fail<InvalidArgument>("ucx descriptor of rank ", peer_rank, " has an empty worker address");
  }
  if (identity == identity_ && peer_rank != rank_) {
    fail<InvalidArgument>("ucx descriptor imported as peer ", peer_rank, " comes from this ",
                          "process, which is rank ", rank_);
  }

  if (peers_.size() <= static_cast<std::size_t>(peer_rank)) peers_.resize(peer_rank + 1);
  if (peers_[peer_rank]) release_peer(*peers_[peer_rank]);
  peers_[peer_rank] = nullptr;
  auto p = std::make_unique<Peer>();
  p->rank = peer_rank;
  for (const Entry& e : entries) p->bytes.push_back(e.bytes);
  if (identity == identity_) {
    p->self = true;
    peers_[peer_rank] = std::move(p);
    return;
  }
  if (identity.same_machine_as(identity_)) p->process = PeerProcess(identity);

  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    int expected = UCS_OK;
    static_cast<Peer*>(arg)->failure.compare_exchange_strong(expected, status);
  };
  ep_params.err_handler.arg = p.get();
  EPLB_UCX_CHECK(ucp_ep_create(reader_, &ep_params, &p->ep), "cannot connect to rank ",
                 peer_rank);
  reachable_ = true;
  try {
    auto unpack = [&](const Entry& e, ucp_rkey_h* rkey, const std::byte** direct) {
      EPLB_UCX_CHECK(ucp_ep_rkey_unpack(p->ep, e.rkey.data(), rkey),
                     "cannot unpack an rkey of rank ", peer_rank);
      void* mapped = nullptr;
      if (ucp_rkey_ptr(*rkey, e.base, &mapped) == UCS_OK) {
        *direct = static_cast<const std::byte*>(mapped);
      }
    };
    unpack(control, &p->control_rkey, &p->control);
    for (const Entry& e : entries) {
      ucp_rkey_h rkey = nullptr;
      const std::byte* direct = nullptr;
      unpack(e, &rkey, &direct);
      p->rkeys.push_back(rkey);
      p->base.push_back(e.base);
      p->direct.push_back(direct);
    }
    handshake(*p);
  } catch (...) {
    release_peer(*p);
    throw;
  }
  peers_[peer_rank] = std::move(p);
}

// Completes the connection to `p` before import_descriptor() returns: a token sent to the
// owner's serving worker and echoed back. Its echo travels behind the owner's handshake reply on
// the owner's endpoint, so once it is here neither side has a handshake message in flight. That
// is what lets either rank exit or close at any later moment: UCX 1.13 aborts a process that
// still holds a handshake message for a peer that is gone (a failed assertion in wireup_ep.c,
// openucx/ucx#8175), and a read through a mapped key never waits for the handshake by itself.
void UcxTransport::handshake(Peer& p) {
  // On the heap: the send holds it until it completes.
  auto sent_token = std::make_unique<std::uint64_t>(++hello_token_);
  const std::uint64_t token = *sent_token;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t request = ucp_am_send_nbx(p.ep, kHelloId, nullptr, 0, sent_token.get(),
                                             sizeof token, &param);
  if (UCS_PTR_IS_ERR(request)) {
    EPLB_UCX_CHECK(UCS_PTR_STATUS(request), "cannot connect to rank ", p.rank);
  }
  const auto deadline = Clock::now() + kConnectTimeout;
  std::string failed;
  while (true) {
    progress();
    if (request != nullptr && ucp_request_check_status(request) != UCS_INPROGRESS) {
      const ucs_status_t sent = ucp_request_check_status(request);
      ucp_request_free(request);
      request = nullptr;
      if (sent != UCS_OK) {
        failed = std::string("the handshake failed: ") + ucs_status_string(sent);
        break;
      }
    }
    if (request == nullptr && acked_.load(std::memory_order_acquire) == token) return;
    if (const int failure = p.failure.load(); failure != UCS_OK) {
      failed = std::string("the connection failed: ") +
               ucs_status_string(static_cast<ucs_status_t>(failure));
      break;
    }
    if (p.process.watching() && !p.process.alive()) {
      failed = "its process exited";
      break;
    }
    if (Clock::now() >= deadline) {
      failed = "no handshake reply after " + std::to_string(kConnectTimeout.count()) + " s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // Closing the endpoint cancels the hello; the peer must be imported again.
  force_close(p);
  if (request != nullptr) {
    // Freed now, or released by UCX when it completes; its token is left to it in that case.
    if (ucp_request_check_status(request) == UCS_INPROGRESS) (void)sent_token.release();
    ucp_request_free(request);
  }
  fail<IoError>("ucx: cannot connect to rank ", p.rank, ": ", failed);
}

bool UcxTransport::one_sided_to(int peer_rank) const {
  if (peer_rank == rank_) return true;
  if (peer_rank < 0 || static_cast<std::size_t>(peer_rank) >= peers_.size() ||
      !peers_[peer_rank]) {
    fail<InvalidArgument>("one_sided_to(", peer_rank, "): that peer was not imported");
  }
  return peers_[peer_rank]->self || peers_[peer_rank]->one_sided();
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

void UcxTransport::force_close(Peer& p) {
  p.abandoned = true;
  if (p.ep != nullptr) close_endpoint(p.ep);
  p.ep = nullptr;
}

void UcxTransport::close_endpoint(ucp_ep_h ep) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  const auto deadline = Clock::now() + kCloseTimeout;
  while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < deadline) {
    progress();
    std::this_thread::yield();
  }
  if (ucp_request_check_status(request) != UCS_INPROGRESS) ucp_request_free(request);
}

void UcxTransport::release_peer(Peer& p) {
  if (p.control_rkey != nullptr) ucp_rkey_destroy(p.control_rkey);
  for (ucp_rkey_h rkey : p.rkeys) ucp_rkey_destroy(rkey);
  p.control_rkey = nullptr;
  p.rkeys.clear();
  const bool failed = p.failure.load() != UCS_OK || p.abandoned ||
                      (p.process.watching() && !p.process.alive());
  // UCX 1.13 can abort (a failed assertion in wireup_ep.c) when it closes an endpoint to a dead
  // peer whose connection handshake never finished; such an endpoint is left to the process's
  // exit, like the worker (see close()).
  if (!failed && p.ep != nullptr) {
    close_endpoint(p.ep);
  }
  p.ep = nullptr;
}

void UcxTransport::close() {
  if (closed_) return;
  closed_ = true;
  if (control_.data != nullptr) {
    reinterpret_cast<std::atomic<std::uint8_t>*>(control_.data)->store(0,
                                                                        std::memory_order_release);
  }
  for (auto& p : peers_) {
    if (p) release_peer(*p);
  }
  if (progress_thread_.joinable()) {
    stop_.store(true, std::memory_order_release);
    const std::uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof one);
    progress_thread_.join();
  }
  peers_.clear();
  for (LocalRegion& r : regions_) ucp_mem_unmap(context_, r.memh);
  regions_.clear();
  if (control_.memh != nullptr) ucp_mem_unmap(context_, control_.memh);
  control_ = LocalRegion();
  if (stop_fd_ >= 0) ::close(stop_fd_);
  stop_fd_ = -1;
  // UCX 1.13 aborts (a failed assertion in ucp_request_send_state_ff, fixed upstream later) when
  // it destroys a worker that still holds a connection-handshake reply to a peer that is gone,
  // dead or merely closed first: an ordinary race at shutdown. Once peers may have talked to
  // this worker it is therefore left, with its context, to the end of the process (the kernel frees
  // them); the progress thread is stopped and the memory unmapped above either way.
  if (!reachable_) {
    if (reader_ != nullptr) ucp_worker_destroy(reader_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  reader_ = nullptr;
  worker_ = nullptr;
  context_ = nullptr;
}


}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<UcxTransport>(options);
}

}  // namespace eplb::transport::ucx
