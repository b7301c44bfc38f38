#include "transport/inproc/transport.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/descriptor.h"

namespace eplb::transport::inproc {
namespace {

constexpr std::string_view kBackend = "inproc";
constexpr std::uint16_t kVersion = 1;

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

struct OwnedRegion {
  std::unique_ptr<std::byte, FreeDeleter> storage;  // null for registered memory
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

// What a rank shares with its readers; kept alive by them after the rank closes, so a late read
// copies valid (if stale) memory and then fails on `open`.
struct Owner {
  int rank = 0;
  std::atomic<bool> open{true};
  std::mutex mu;                     // guards regions
  std::vector<OwnedRegion> regions;  // [region id]
};

// Descriptors name owners by a number looked up here, never by a raw pointer.
struct Directory {
  std::mutex mu;
  std::uint64_t next_id = 1;
  std::map<std::uint64_t, std::weak_ptr<Owner>> owners;
};

Directory& directory() {
  static Directory d;
  return d;
}

struct PeerView {
  std::shared_ptr<Owner> owner;
  std::vector<std::byte*> data;         // [region id]
  std::vector<std::uint64_t> bytes;     // [region id]
};

class InprocTransport final : public Transport {
 public:
  explicit InprocTransport(const Options& options) : owner_(std::make_shared<Owner>()) {
    EPLB_CHECK_GE(options.rank, 0, "transport rank must be >= 0");
    owner_->rank = options.rank;
    auto& dir = directory();
    std::lock_guard lock(dir.mu);
    id_ = dir.next_id++;
    dir.owners[id_] = owner_;
  }
  ~InprocTransport() override { close(); }

  std::string_view backend() const override { return kBackend; }
  int rank() const override { return owner_->rank; }
  Capabilities capabilities() const override {
    return {.device_memory = false, .one_sided = true, .register_memory = true,
            .cross_node = false};
  }

  Region allocate(std::size_t bytes) override {
    EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate() needs a positive size");
    check_open();
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    auto* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
    if (p == nullptr) fail<IoError>("inproc: cannot allocate ", bytes, " bytes");
    std::memset(p, 0, rounded);
    return add_region({std::unique_ptr<std::byte, FreeDeleter>(p), p, bytes});
  }

  Region register_memory(void* data, std::size_t bytes) override {
    EPLB_CHECK(data != nullptr || bytes == 0, "register_memory() of a null pointer");
    EPLB_CHECK_GT(bytes, std::size_t{0}, "register_memory() needs a positive size");
    check_open();
    return add_region({nullptr, static_cast<std::byte*>(data), bytes});
  }

  std::vector<std::byte> export_descriptor() const override {
    DescriptorWriter out(kBackend, kVersion, owner_->rank);
    out.put(id_);
    out.put(static_cast<std::int32_t>(::getpid()));
    std::lock_guard lock(owner_->mu);
    out.put(static_cast<std::uint32_t>(owner_->regions.size()));
    for (const auto& r : owner_->regions) out.put(r.bytes);
    return std::move(out).finish();
  }

  void import_descriptor(int peer, std::span<const std::byte> descriptor) override {
    EPLB_CHECK_GE(peer, 0, "import_descriptor(): peer rank must be >= 0");
    DescriptorReader in(descriptor, kBackend, kVersion);
    if (in.rank() != peer) {
      fail<InvalidArgument>("descriptor of rank ", in.rank(), " imported as peer ", peer,
                            ": hand each rank's descriptor to its own slot");
    }
    const auto id = in.get<std::uint64_t>("owner id");
    const auto pid = in.get<std::int32_t>("process id");
    const auto count = in.get_count("region count", sizeof(std::uint64_t));
    std::vector<std::uint64_t> sizes(count);
    for (auto& s : sizes) s = in.get<std::uint64_t>("region size");
    in.expect_end();
    if (pid != ::getpid()) {
      fail<InvalidArgument>("inproc descriptor of rank ", peer, " comes from process ", pid,
                            ", not this one (", ::getpid(),
                            "): inproc connects threads of one process; use shm or ucx");
    }
    std::shared_ptr<Owner> owner;
    {
      auto& dir = directory();
      std::lock_guard lock(dir.mu);
      if (auto it = dir.owners.find(id); it != dir.owners.end()) owner = it->second.lock();
    }
    if (!owner || !owner->open.load()) {
      fail<IoError>("inproc: rank ", peer, " has closed its transport");
    }
    PeerView view{owner, {}, sizes};
    {
      std::lock_guard lock(owner->mu);
      if (owner->rank != peer || count > owner->regions.size()) {
        fail<InvalidArgument>("inproc descriptor of rank ", peer,
                              " does not match that rank's transport");
      }
      for (std::uint32_t i = 0; i < count; ++i) {
        if (owner->regions[i].bytes != sizes[i]) {
          fail<InvalidArgument>("inproc descriptor of rank ", peer, " gives region ", i, " ",
                                sizes[i], " bytes, the rank has ", owner->regions[i].bytes);
        }
        view.data.push_back(owner->regions[i].data);
      }
    }
    if (peers_.size() <= static_cast<std::size_t>(peer)) peers_.resize(peer + 1);
    peers_[peer] = std::move(view);
  }

  bool one_sided_to(int) const override { return true; }

  std::unique_ptr<Batch> post(std::span<const Read> reads) override {
    check_open();
    PeerView self;
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const PeerView& view = view_of(reads[i], i, self);
      check_read(reads[i], i, view.bytes);
    }
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const Read& r = reads[i];
      if (r.bytes == 0) continue;
      const PeerView& view = view_of(r, i, self);
      std::memcpy(r.dst, view.data[static_cast<std::size_t>(r.region)] + r.offset, r.bytes);
    }
    // The copies are done; they count only if every owner was still open afterwards.
    for (const Read& r : reads) {
      const PeerView& view = view_of(r, 0, self);
      if (!view.owner->open.load(std::memory_order_acquire)) {
        return std::make_unique<SettledBatch>("inproc: rank " + std::to_string(r.peer) +
                                             " closed its transport during the batch");
      }
    }
    return std::make_unique<SettledBatch>("");
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    owner_->open.store(false, std::memory_order_release);
    peers_.clear();
    auto& dir = directory();
    std::lock_guard lock(dir.mu);
    dir.owners.erase(id_);
  }

 private:
  void check_open() const {
    if (closed_) fail<InvalidArgument>("inproc transport of rank ", owner_->rank, " is closed");
  }

  Region add_region(OwnedRegion region) {
    std::lock_guard lock(owner_->mu);
    Region out{static_cast<int>(owner_->regions.size()), region.data, region.bytes};
    owner_->regions.push_back(std::move(region));
    return out;
  }

  // The view of the read's peer; this rank's own regions need no import (`self` is filled once).
  const PeerView& view_of(const Read& r, std::size_t index, PeerView& self) const {
    if (r.peer >= 0 && static_cast<std::size_t>(r.peer) < peers_.size() &&
        peers_[r.peer].owner) {
      return peers_[r.peer];
    }
    if (r.peer == owner_->rank) {
      if (!self.owner) {
        self.owner = owner_;
        std::lock_guard lock(owner_->mu);
        for (const auto& region : owner_->regions) {
          self.data.push_back(region.data);
          self.bytes.push_back(region.bytes);
        }
      }
      return self;
    }
    fail_unknown_peer(r, index, peers_.size());
  }

  std::shared_ptr<Owner> owner_;
  std::uint64_t id_ = 0;
  bool closed_ = false;
  std::vector<PeerView> peers_;  // [peer rank]; empty owner where not imported
};

}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<InprocTransport>(options);
}

}  // namespace eplb::transport::inproc
