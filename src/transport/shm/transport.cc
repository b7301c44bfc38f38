#include "transport/shm/transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "transport/checks.h"
#include "transport/descriptor.h"
#include "transport/memfd.h"
#include "transport/process.h"

namespace eplb::transport::shm {
namespace {

constexpr std::string_view kBackend = "shm";
constexpr std::uint16_t kVersion = 1;
constexpr std::uint64_t kControlMagic = 0x4c54435f42504c45ull;  // "EPLB_CTL"

struct Peer {
  bool imported = false;
  bool self = false;
  Segment control;
  std::vector<Segment> regions;        // [region id]
  std::vector<std::uint64_t> bytes;    // [region id]
  PeerProcess process;

  const ControlPage* page() const { return control_page(control); }
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const Options& options)
      : rank_(options.rank), identity_(ProcessIdentity::self()) {
    EPLB_CHECK_GE(options.rank, 0, "transport rank must be >= 0");
    control_ = create_segment(kBackend, "eplb-shm-control", sizeof(ControlPage));
    new (control_.data) ControlPage{kControlMagic, {1}};
  }
  ~ShmTransport() override { close(); }

  std::string_view backend() const override { return kBackend; }
  int rank() const override { return rank_; }
  Capabilities capabilities() const override {
    return {.device_memory = false, .one_sided = true, .register_memory = false,
            .cross_node = false};
  }

  Region allocate(std::size_t bytes) override {
    EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate() needs a positive size");
    check_open();
    regions_.push_back(create_segment(kBackend, "eplb-shm-region", bytes));
    const Segment& s = regions_.back();
    return {static_cast<int>(regions_.size()) - 1, s.data, s.bytes};
  }

  Region register_memory(void*, std::size_t) override {
    fail<NotSupported>("shm cannot serve reads from caller memory (peers can map only memory ",
                       "shm allocated): use allocate() and place the data there");
  }

  std::vector<std::byte> export_descriptor() const override {
    check_open();
    DescriptorWriter out(kBackend, kVersion, rank_);
    out.put(identity_);
    out.put(static_cast<std::int32_t>(control_.fd));
    out.put(control_.inode);
    out.put(static_cast<std::uint32_t>(regions_.size()));
    for (const Segment& s : regions_) {
      out.put(static_cast<std::int32_t>(s.fd));
      out.put(s.inode);
      out.put(static_cast<std::uint64_t>(s.bytes));
    }
    return std::move(out).finish();
  }

  void import_descriptor(int peer, std::span<const std::byte> descriptor) override {
    EPLB_CHECK_GE(peer, 0, "import_descriptor(): peer rank must be >= 0");
    check_open();
    DescriptorReader in(descriptor, kBackend, kVersion);
    if (in.rank() != peer) {
      fail<InvalidArgument>("descriptor of rank ", in.rank(), " imported as peer ", peer,
                            ": hand each rank's descriptor to its own slot");
    }
    const auto identity = in.get<ProcessIdentity>("process identity");
    const auto control_fd = in.get<std::int32_t>("control fd");
    const auto control_inode = in.get<std::uint64_t>("control inode");
    const auto count = in.get_count("region count", 20);
    struct Entry {
      std::int32_t fd;
      std::uint64_t inode, bytes;
    };
    std::vector<Entry> entries(count);
    for (auto& e : entries) {
      e.fd = in.get<std::int32_t>("region fd");
      e.inode = in.get<std::uint64_t>("region inode");
      e.bytes = in.get<std::uint64_t>("region size");
    }
    in.expect_end();
    if (!identity.same_machine_as(identity_)) {
      fail<InvalidArgument>("shm descriptor of rank ", peer, " comes from another machine or pid ",
                            "namespace: shm connects processes of one machine; use ucx");
    }
    Peer p;
    p.imported = true;
    p.bytes.reserve(count);
    for (const Entry& e : entries) p.bytes.push_back(e.bytes);
    if (identity == identity_) {
      if (peer != rank_) {
        fail<InvalidArgument>("shm descriptor imported as peer ", peer, " comes from this ",
                              "process, which is rank ", rank_);
      }
      p.self = true;
    } else {
      p.process = PeerProcess(identity);
      p.control = map_peer_segment(kBackend, peer, identity.pid, control_fd, control_inode,
                                   sizeof(ControlPage));
      if (p.page()->magic != kControlMagic) {
        fail<InvalidArgument>("shm descriptor of rank ", peer, " points at memory that is not ",
                              "an eplb control page");
      }
      for (const Entry& e : entries) {
        p.regions.push_back(map_peer_segment(kBackend, peer, identity.pid, e.fd, e.inode, e.bytes));
      }
    }
    if (peers_.size() <= static_cast<std::size_t>(peer)) peers_.resize(peer + 1);
    peers_[peer] = std::move(p);
  }

  bool one_sided_to(int) const override { return true; }

  std::unique_ptr<Batch> post(std::span<const Read> reads) override {
    check_open();
    std::vector<std::uint64_t> own_bytes;
    for (const Segment& s : regions_) own_bytes.push_back(s.bytes);
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const Read& r = reads[i];
      if (is_self(r.peer)) {
        check_read(r, i, own_bytes);
      } else {
        check_read(r, i, peer_of(r, i).bytes);
      }
    }
    touched_.clear();
    for (const Read& r : reads) {
      if (is_self(r.peer)) {
        if (r.bytes > 0) {
          std::memcpy(r.dst, regions_[static_cast<std::size_t>(r.region)].data + r.offset,
                      r.bytes);
        }
        continue;
      }
      Peer& p = peers_[static_cast<std::size_t>(r.peer)];
      if (r.bytes > 0) {
        std::memcpy(r.dst, p.regions[static_cast<std::size_t>(r.region)].data + r.offset,
                    r.bytes);
      }
      if (touched_.empty() || touched_.back() != r.peer) touched_.push_back(r.peer);
    }
    return std::make_unique<SettledBatch>(check_owners());
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    if (control_.data != nullptr) {
      control_page(control_)->open.store(0, std::memory_order_release);
    }
    peers_.clear();
    regions_.clear();
    control_ = Segment();
  }

 private:
  void check_open() const {
    if (closed_) fail<InvalidArgument>("shm transport of rank ", rank_, " is closed");
  }

  bool is_self(int peer) const {
    return peer == rank_ && (static_cast<std::size_t>(peer) >= peers_.size() ||
                             !peers_[peer].imported || peers_[peer].self);
  }

  const Peer& peer_of(const Read& r, std::size_t index) const {
    if (r.peer < 0 || static_cast<std::size_t>(r.peer) >= peers_.size() ||
        !peers_[r.peer].imported) {
      fail_unknown_peer(r, index, peers_.size());
    }
    return peers_[r.peer];
  }

  // After the copies: every owner read from must still be open and alive. "" when they are.
  std::string check_owners() {
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
    std::vector<const PeerProcess*> watched;
    for (int peer : touched_) {
      const Peer& p = peers_[static_cast<std::size_t>(peer)];
      if (p.page()->open.load(std::memory_order_acquire) == 0) {
        return "shm: rank " + std::to_string(peer) + " closed its transport";
      }
      watched.push_back(&p.process);
    }
    if (all_alive(watched)) return "";
    for (int peer : touched_) {
      if (!peers_[static_cast<std::size_t>(peer)].process.alive()) {
        return "shm: rank " + std::to_string(peer) + " is gone (its process exited)";
      }
    }
    return "";
  }

  int rank_;
  ProcessIdentity identity_;
  bool closed_ = false;
  Segment control_;
  std::vector<Segment> regions_;  // [region id]
  std::vector<Peer> peers_;       // [peer rank]
  std::vector<int> touched_;      // peers read by the batch being posted
};

}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<ShmTransport>(options);
}

}  // namespace eplb::transport::shm
