#include "transport/hybrid/transport.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/descriptor.h"
#include "transport/process.h"
#include "transport/shm/transport.h"
#include "transport/ucx/transport.h"

namespace eplb::transport::hybrid {
namespace {

constexpr std::string_view kBackend = "hybrid";
constexpr std::uint16_t kVersion = 1;
constexpr std::uint32_t kMaxField = 1u << 24;  // bounds a corrupted length before it allocates

enum class Route : std::uint8_t { kNone, kShm, kUcx };

std::string default_node() {
  const ProcessIdentity self = ProcessIdentity::self();
  return "machine:" + std::string(self.boot_id) + "/" + std::to_string(self.pid_ns);
}

// A batch over the two halves: either may be absent.
class HybridBatch final : public Batch {
 public:
  HybridBatch(std::unique_ptr<Batch> near, std::unique_ptr<Batch> far)
      : near_(std::move(near)), far_(std::move(far)) {}

  Progress poll() override {
    // Both are polled every time (each must report its own failure); done when both are.
    const bool near_done = !near_ || near_->poll() == Progress::kDone;
    const bool far_done = !far_ || far_->poll() == Progress::kDone;
    return near_done && far_done ? Progress::kDone : Progress::kPending;
  }

  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // shm reads were copied inside post(): the near half only reports.
    if (near_) near_->wait(timeout);
    if (far_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      far_->wait(std::max(left, std::chrono::milliseconds(0)));
    }
  }

 private:
  std::unique_ptr<Batch> near_;
  std::unique_ptr<Batch> far_;
};

class HybridTransport final : public Transport {
 public:
  explicit HybridTransport(const Options& options)
      : rank_(options.rank),
        node_(options.node.empty() ? default_node() : options.node),
        near_(shm::create(options)),
        far_(ucx::create(options)) {
    if (node_.size() > 1024) {
      fail<InvalidArgument>("node name of ", node_.size(), " bytes is too long (at most 1024)");
    }
  }

  ~HybridTransport() override { close(); }

  std::string_view backend() const override { return kBackend; }
  int rank() const override { return rank_; }
  Capabilities capabilities() const override {
    return {.device_memory = false, .one_sided = false, .register_memory = true,
            .cross_node = true};
  }

  Region allocate(std::size_t bytes) override {
    return add_region([&] { return near_->allocate(bytes); });
  }

  // Both halves register the caller's memory: peers of the node read it through shm (mapped
  // when it is shareable memory, by cross-memory attach otherwise), the others through UCX's
  // mapping of it.
  Region register_memory(void* data, std::size_t bytes) override {
    return add_region([&] { return near_->register_memory(data, bytes); });
  }

  // A region made by the shm half (`make_near`), registered with the UCX half too.
  template <typename F>
  Region add_region(F&& make_near) {
    EPLB_CHECK(!closed_, "a new region after close()");
    if (!broken_.empty()) fail<IoError>("hybrid: no more regions: ", broken_);
    const Region region = make_near();
    Region registered;
    try {
      registered = far_->register_memory(region.data, region.bytes);
    } catch (const std::exception& e) {
      // The shm region exists and cannot be taken back: the two halves' region ids would
      // disagree from now on.
      broken_ = detail::concat("registering region ", region.id, " (", region.bytes,
                               " bytes) with UCX failed: ", e.what());
      throw;
    }
    // Both backends number regions in order of creation; they stay in step because every
    // region goes through here.
    EPLB_CHECK_EQ(registered.id, region.id, "hybrid: the UCX region id must match the shm one");
    region_bytes_.push_back(region.bytes);
    return region;
  }

  std::vector<std::byte> export_descriptor() const override {
    const std::vector<std::byte> near = near_->export_descriptor();
    const std::vector<std::byte> far = far_->export_descriptor();
    DescriptorWriter w(kBackend, kVersion, rank_);
    const auto put_field = [&](const void* data, std::size_t bytes) {
      w.put(static_cast<std::uint32_t>(bytes));
      w.put_bytes(data, bytes);
    };
    put_field(node_.data(), node_.size());
    w.put(static_cast<std::uint32_t>(region_bytes_.size()));
    for (const std::uint64_t b : region_bytes_) w.put(b);
    put_field(near.data(), near.size());
    put_field(far.data(), far.size());
    return std::move(w).finish();
  }

  void import_descriptor(int peer, std::span<const std::byte> descriptor) override {
    EPLB_CHECK(!closed_, "import_descriptor() after close()");
    if (peer < 0) fail<InvalidArgument>("import_descriptor(): peer ", peer, " is negative");
    DescriptorReader r(descriptor, kBackend, kVersion);
    if (r.rank() != peer) {
      fail<InvalidArgument>("descriptor of rank ", r.rank(), " imported as peer ", peer,
                            ": hand each rank's descriptor to its own slot");
    }
    const auto get_field = [&](const char* what) {
      const auto bytes = r.get<std::uint32_t>(what);
      if (bytes > kMaxField) fail<InvalidArgument>("descriptor: ", what, " of ", bytes, " bytes");
      return r.get_span(bytes, what);
    };
    const auto node_bytes = get_field("node name");
    const std::string node(reinterpret_cast<const char*>(node_bytes.data()), node_bytes.size());
    const auto regions = r.get_count("region count", sizeof(std::uint64_t));
    std::vector<std::uint64_t> sizes(regions);
    for (auto& s : sizes) s = r.get<std::uint64_t>("region size");
    const auto near = get_field("shm descriptor");
    const auto far = get_field("ucx descriptor");
    r.expect_end();
    // Only one half is imported; both must at least be their backend's descriptors of `peer`.
    check_half(near, "shm", peer);
    check_half(far, "ucx", peer);

    const auto slot = static_cast<std::size_t>(peer);
    if (routes_.size() <= slot) {
      routes_.resize(slot + 1, Route::kNone);
      peer_region_bytes_.resize(slot + 1);
    }
    const Route route = node == node_ ? Route::kShm : Route::kUcx;
    (route == Route::kShm ? near_ : far_)->import_descriptor(peer, route == Route::kShm ? near
                                                                                         : far);
    routes_[slot] = route;
    peer_region_bytes_[slot] = std::move(sizes);
  }

  bool one_sided_to(int peer) const override {
    if (peer == rank_) return true;
    const Route route = route_of(peer);
    if (route == Route::kNone) {
      fail<InvalidArgument>("one_sided_to(", peer, "): that peer was not imported");
    }
    return route == Route::kShm || far_->one_sided_to(peer);
  }

  std::unique_ptr<Batch> post(std::span<const Read> reads) override {
    EPLB_CHECK(!closed_, "post() after close()");
    // Every read is checked here, before either half starts one.
    std::vector<Read> near, far;
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const Read& read = reads[i];
      const bool self = read.peer == rank_;
      const Route route = self ? Route::kShm : route_of(read.peer);
      if (route == Route::kNone) fail_unknown_peer(read, i, routes_.size());
      check_read(read, i, self ? region_bytes_ : peer_region_bytes_[read.peer]);
      (route == Route::kShm ? near : far).push_back(read);
    }
    std::unique_ptr<Batch> far_batch = far.empty() ? nullptr : far_->post(far);
    std::unique_ptr<Batch> near_batch = near.empty() ? nullptr : near_->post(near);
    return std::make_unique<HybridBatch>(std::move(near_batch), std::move(far_batch));
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    far_->close();
    near_->close();
  }

 private:
  // The envelope of one half (descriptor.h): magic, backend name, and the rank.
  static void check_half(std::span<const std::byte> half, std::string_view backend, int peer) {
    char name[8] = {};
    std::int32_t rank = -1;
    const bool sized = half.size() >= kDescriptorHeaderBytes;
    if (sized) {
      std::memcpy(name, half.data() + 4, sizeof name);
      std::memcpy(&rank, half.data() + 20, sizeof rank);
    }
    if (!sized || std::memcmp(half.data(), "EPLB", 4) != 0 ||
        std::string_view(name, strnlen(name, sizeof name)) != backend || rank != peer) {
      fail<InvalidArgument>("'hybrid' transport descriptor of rank ", peer, " is malformed: its ",
                            backend, " half is not a ", backend, " descriptor of that rank");
    }
  }

  Route route_of(int peer) const {
    if (peer < 0 || static_cast<std::size_t>(peer) >= routes_.size()) return Route::kNone;
    return routes_[static_cast<std::size_t>(peer)];
  }

  int rank_;
  std::string node_;
  std::unique_ptr<Transport> near_;  // shm
  std::unique_ptr<Transport> far_;   // ucx
  std::vector<std::uint64_t> region_bytes_;                    // own regions, by id
  std::vector<Route> routes_;                                  // [peer]
  std::vector<std::vector<std::uint64_t>> peer_region_bytes_;  // [peer][region]
  bool closed_ = false;
  std::string broken_;  // why allocate() can no longer keep the halves in step
};

}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<HybridTransport>(options);
}

}  // namespace eplb::transport::hybrid
