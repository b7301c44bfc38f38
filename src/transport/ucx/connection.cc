// The ucx transport's connections: its UCX context, the serving and the reading worker with
// their active-message handlers, the progress thread that serves both (serve()), the endpoints
// to peers with the handshake that completes each, and close(). The Transport owns the context,
// the workers and the thread; a Peer owns its endpoint until release_peer() or force_close()
// closes it. serve() and on_hello() run on the progress thread; the rest on the reading side
// (construction, import_descriptor(), a batch's cancellation, close()).

#include "transport/ucx/transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "eplb/core/error.h"
#include "transport/process.h"
#include "transport/ucx/ucx_transport.h"

namespace eplb::transport::ucx {
namespace {

constexpr std::size_t kControlBytes = 64;
// How long import_descriptor() waits for the connection handshake with a live peer: only a
// bound that turns a hang into an error.
constexpr auto kConnectTimeout = std::chrono::seconds(60);
// Active-message ids of the connection handshake (see import_descriptor()).
constexpr unsigned kHelloId = 1;     // reader -> owner's serving worker: a token
constexpr unsigned kHelloAckId = 2;  // serving worker -> reader: the token back

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
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

}  // namespace

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

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<UcxTransport>(options);
}

}  // namespace eplb::transport::ucx
