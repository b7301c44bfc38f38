#include "control/gloo/communicator.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "eplb/core/error.h"

namespace eplb::control::gloo {
namespace {

constexpr std::string_view kRedisScheme = "redis://";

// Slots of eplb's own exchanges, apart from those of gloo's collectives (gloo/types.h uses
// prefixes 0x01-0x08); the tag counter keeps each call's slot unique.
constexpr std::uint8_t kExchangeSlotPrefix = 0xe0;

// Up to this many bytes gathered per rank (values x ranks), an all-reduce is one exchange in
// which every rank sends its values to every peer at once and reduces what it receives, so its
// latency is one message. gloo's own allreduce (this version: a ring in 2 x 2N - 4 steps of
// one message each, whatever the size) is for larger payloads.
constexpr std::size_t kExchangeBytes = 256 * 1024;

// Gloo reports a timeout as an IoException whose message says so; everything else it throws
// means the peers or links are in an unknown state.
template <typename F>
auto translate(F&& body) {
  try {
    return body();
  } catch (const ::gloo::IoException& e) {
    const std::string what = e.what();
    if (what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos) {
      fail<Timeout>("gloo: ", what);
    }
    fail<IoError>("gloo: ", what);
  } catch (const ::gloo::Exception& e) {
    fail<IoError>("gloo: ", e.what());
  } catch (const ::gloo::EnforceNotMet& e) {
    fail<IoError>("gloo: ", e.what());
  }
}

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  // Zero means "no timeout" to gloo: never pass it.
  return std::max(left, std::chrono::milliseconds(1));
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

ReduceFn reduce_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return static_cast<ReduceFn>(&::gloo::min<std::int64_t>);
    case ReduceOp::kMax:
      return static_cast<ReduceFn>(&::gloo::max<std::int64_t>);
    case ReduceOp::kSum:
      return static_cast<ReduceFn>(&::gloo::sum<std::int64_t>);
  }
  fail<InvalidArgument>("gloo: unknown reduce op ", static_cast<int>(op));
}

std::unique_ptr<::gloo::rendezvous::Store> make_store(const std::string& rendezvous) {
  if (rendezvous.rfind(kRedisScheme, 0) == 0) {
    const std::string address = rendezvous.substr(kRedisScheme.size());
    const auto colon = address.rfind(':');
    std::string host = address;
    int port = 6379;
    if (colon != std::string::npos) {
      host = address.substr(0, colon);
      const std::string digits = address.substr(colon + 1);
      char* end = nullptr;
      const long value = std::strtol(digits.c_str(), &end, 10);
      if (digits.empty() || *end != '\0' || value <= 0 || value > 65535) {
        fail<InvalidArgument>("control gloo: rendezvous '", rendezvous,
                              "' has no valid port (expected redis://host:port)");
      }
      port = static_cast<int>(value);
    }
    if (host.empty()) {
      fail<InvalidArgument>("control gloo: rendezvous '", rendezvous,
                            "' has no host (expected redis://host:port)");
    }
    return std::make_unique<::gloo::rendezvous::RedisStore>(host, port);
  }
  std::error_code error;
  std::filesystem::create_directories(rendezvous, error);
  if (error || !std::filesystem::is_directory(rendezvous)) {
    fail<IoError>("control gloo: rendezvous folder '", rendezvous,
                  "' cannot be created: ", error.message());
  }
  return std::make_unique<::gloo::rendezvous::FileStore>(rendezvous);
}

::gloo::transport::tcp::attr device_attr(const Options& options) {
  ::gloo::transport::tcp::attr attr;
  if (!options.hostname.empty()) {
    attr.hostname = options.hostname;
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    attr.hostname = host;
  }
  return attr;
}

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(const Options& options)
      : Communicator(options.rank, options.size, options.timeout) {}

  ~GlooCommunicator() override {
    // Pairs first (they close their sockets), then the device and its event loop.
    context_.reset();
    device_.reset();
  }

  std::string_view backend() const override { return "gloo"; }

  void open(const Options& options) {
    translate([&] {
      device_ = ::gloo::transport::tcp::CreateDevice(device_attr(options));
      auto store = make_store(options.rendezvous);
      ::gloo::rendezvous::PrefixStore prefixed(options.group, *store);
      auto context = std::make_shared<::gloo::rendezvous::Context>(rank(), size());
      // Bounds the store waits and the connection of every pair, then each collective.
      context->setTimeout(options.timeout);
      context->connectFullMesh(prefixed, device_);
      context_ = std::move(context);
    });
    // A pair is connected on one side before the other has finished its handshake: without
    // this barrier a rank that returns and exits at once can break a peer's connect.
    do_barrier(Clock::now() + options.timeout);
  }

 protected:
  void do_barrier(Clock::time_point deadline) override {
    translate([&] {
      ::gloo::BarrierOptions opts(context_);
      opts.setTag(next_tag());
      opts.setTimeout(remaining(deadline));
      ::gloo::barrier(opts);
    });
  }

  void do_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                     Clock::time_point deadline) override {
    if (values.empty()) return;  // every rank passes the same count: nothing to exchange
    if (size() == 1) return;
    if (values.size_bytes() * static_cast<std::size_t>(size()) <= kExchangeBytes) {
      translate([&] { exchange_all_reduce(values, op, deadline); });
      return;
    }
    translate([&] {
      ::gloo::AllreduceOptions opts(context_);
      opts.setOutput(values.data(), values.size());
      opts.setReduceFunction(reduce_function(op));
      opts.setTag(next_tag());
      opts.setTimeout(remaining(deadline));
      ::gloo::allreduce(opts);
    });
  }

  void do_broadcast(Bytes& data, int root, Clock::time_point deadline) override {
    translate([&] {
      // Step 1: the length, so that every rank can size its buffer.
      std::uint64_t length = rank() == root ? data.size() : 0;
      {
        ::gloo::BroadcastOptions opts(context_);
        opts.setOutput(&length, 1);
        opts.setRoot(root);
        opts.setTag(next_tag());
        opts.setTimeout(remaining(deadline));
        ::gloo::broadcast(opts);
      }
      if (rank() != root) data.resize(length);
      if (length == 0) return;
      // Step 2: the bytes.
      ::gloo::BroadcastOptions opts(context_);
      opts.setOutput(reinterpret_cast<std::uint8_t*>(data.data()), data.size());
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(remaining(deadline));
      ::gloo::broadcast(opts);
    });
  }

  std::vector<Bytes> do_all_gather(std::span<const std::byte> data,
                                   Clock::time_point deadline) override {
    return translate([&] {
      // Step 1: every rank's length.
      std::uint64_t mine = data.size();
      std::vector<std::uint64_t> lengths(size());
      {
        ::gloo::AllgatherOptions opts(context_);
        opts.setInput(&mine, 1);
        opts.setOutput(lengths.data(), lengths.size());
        opts.setTag(next_tag());
        opts.setTimeout(remaining(deadline));
        ::gloo::allgather(opts);
      }
      std::vector<Bytes> out(size());
      std::uint64_t total = 0;
      for (auto length : lengths) total += length;
      if (total == 0) return out;
      // Step 2: the bytes, in rank order.
      std::vector<std::uint8_t> gathered(total);
      std::uint8_t empty = 0;  // gloo wants a pointer even for zero bytes
      auto* input = data.empty() ? &empty
                                 : const_cast<std::uint8_t*>(
                                       reinterpret_cast<const std::uint8_t*>(data.data()));
      ::gloo::AllgathervOptions opts(context_);
      opts.setInput(input, data.size());
      opts.setOutput(gathered.data(), std::vector<size_t>(lengths.begin(), lengths.end()));
      opts.setTag(next_tag());
      opts.setTimeout(remaining(deadline));
      ::gloo::allgatherv(opts);
      std::size_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        const auto* begin = reinterpret_cast<const std::byte*>(gathered.data() + offset);
        out[r].assign(begin, begin + lengths[r]);
        offset += lengths[r];
      }
      return out;
    });
  }

 private:
  // Every rank sends its values to every peer and receives theirs, all posted at once; then
  // reduces in rank order (the same result on every rank).
  void exchange_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                           Clock::time_point deadline) {
    const std::size_t bytes = values.size_bytes();
    gathered_.assign(values.size() * static_cast<std::size_t>(size()), 0);  // [rank][values]
    std::copy(values.begin(), values.end(),
              gathered_.begin() + static_cast<std::ptrdiff_t>(values.size()) * rank());
    auto in = context_->createUnboundBuffer(gathered_.data(), bytes * size());
    auto out = context_->createUnboundBuffer(values.data(), bytes);
    const auto slot = ::gloo::Slot::build(kExchangeSlotPrefix, next_tag());
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != rank()) in->recv(peer, slot, bytes * peer, bytes);
    }
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != rank()) out->send(peer, slot, 0, bytes);
    }
    for (int i = 1; i < size(); ++i) in->waitRecv(remaining(deadline));
    for (int i = 1; i < size(); ++i) out->waitSend(remaining(deadline));
    std::copy_n(gathered_.begin(), values.size(), values.begin());
    for (int r = 1; r < size(); ++r) {
      reduce_into(
          values,
          std::span<const std::int64_t>(gathered_.data() + values.size() * r, values.size()), op);
    }
  }

  // Collectives of one communicator run one at a time, so a counter gives each its own tag,
  // as torch.distributed does.
  std::uint32_t next_tag() { return tag_++; }

  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  std::uint32_t tag_ = 0;
  std::vector<std::int64_t> gathered_;  // exchange_all_reduce's receive buffer, kept
};

// gloo's TCP pairs write with plain send(): a write to a peer that just died raises SIGPIPE,
// whose default action kills this rank instead of letting the collective fail with IoError.
// Ignore it, unless the program installed a handler of its own (Python already ignores it).
void ignore_sigpipe_by_default() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

std::unique_ptr<Communicator> connect(const Options& options) {
  ignore_sigpipe_by_default();
  if (options.rendezvous.empty()) {
    fail<InvalidArgument>("control gloo: Options::rendezvous is empty (give a folder shared by "
                          "all ranks, or redis://host:port)");
  }
  auto comm = std::make_unique<GlooCommunicator>(options);
  const auto prefix =
      ::eplb::detail::concat("control connect (gloo, rank ", options.rank, " of ", options.size,
                             ", rendezvous '", options.rendezvous, "'): ");
  try {
    comm->open(options);
  } catch (const Timeout& e) {
    fail<Timeout>(prefix, e.what());
  } catch (const IoError& e) {
    fail<IoError>(prefix, e.what());
  }
  return comm;
}

}  // namespace eplb::control::gloo
