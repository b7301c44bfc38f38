#include "transport/shm/transport.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/transport/shareable.h"
#include "transport/checks.h"
#include "transport/descriptor.h"
#include "transport/memfd.h"
#include "transport/process.h"

namespace eplb::transport::shm {
namespace {

constexpr std::string_view kBackend = "shm";
constexpr std::uint16_t kVersion = 2;
constexpr std::uint64_t kControlMagic = 0x4c54435f42504c45ull;  // "EPLB_CTL"

// A region is a memfd this transport allocated (peers map it), caller memory inside a memfd
// of allocate_shareable() (peers map that memfd and copy from the offset), or other caller
// memory it registered (peers read it with process_vm_readv, cross-memory attach).
enum class Kind : std::uint8_t { kSegment = 0, kRegistered = 1, kShareable = 2 };

struct OwnRegion {
  Segment segment;  // kSegment only
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  Kind kind = Kind::kSegment;
  ShareableSlice slice;  // kShareable only (the memfd stays allocate_shareable()'s)
};

struct Peer {
  bool imported = false;
  bool self = false;
  std::int32_t pid = 0;
  Segment control;
  // The peer's memfds mapped here, each once (many shareable regions may share one memfd).
  std::vector<Segment> mappings;
  std::vector<const std::byte*> starts;  // [region id]: its first byte here; null: registered
  std::vector<std::uint64_t> addresses;  // [region id]: the owner's address of a kRegistered one
  std::vector<Kind> kinds;               // [region id]
  std::vector<std::uint64_t> bytes;      // [region id]
  PeerProcess process;

  const ControlPage* page() const { return control_page(control); }
};

std::string yama_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  std::string scope;
  if (!(in >> scope)) return "";
  return scope;
}

// Why a cross-memory read of rank `peer` failed, and what would make it work.
[[noreturn]] void fail_cross_memory(int peer, int err, const char* when) {
  if (err == ESRCH) {
    fail<IoError>("shm: rank ", peer, " is gone (its process exited) ", when);
  }
  if (err == EFAULT) {
    fail<IoError>("shm: rank ", peer, "'s registered memory is no longer mapped ", when,
                  " (its owner freed it while it was registered)");
  }
  if (err == EPERM || err == EACCES || err == ENOSYS) {
    const std::string scope = yama_scope();
    fail<NotSupported>(
        "shm: reading rank ", peer, "'s registered memory (process_vm_readv, cross-memory "
        "attach) was refused ", when, ": ", std::strerror(err), ". It needs ptrace permission "
        "between the ranks' processes (same user, and ",
        scope.empty() ? "no Yama ptrace_scope here"
                      : "kernel.yama.ptrace_scope " + scope + ": 0 or 1 allow it, 2 needs "
                        "CAP_SYS_PTRACE, 3 forbids it",
        "; in a container, CAP_SYS_PTRACE and a seccomp profile that allows process_vm_readv). "
        "Or allocate the engine's host tensors from shareable memory "
        "(eplb::transport::allocate_shareable; eplb.empty() in Python), which needs no "
        "permission and is read at memcpy speed");
  }
  fail<IoError>("shm: process_vm_readv from rank ", peer, " failed ", when, ": ",
                std::strerror(err));
}

// Copies `bytes` at `address` of process `pid` to `dst`; the errno of a failure, else 0.
int read_process(std::int32_t pid, std::uint64_t address, void* dst, std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<std::byte*>(dst) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<std::size_t>(n);
  }
  return 0;
}

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
    return {.device_memory = false, .one_sided = true, .register_memory = true,
            .cross_node = false};
  }

  Region allocate(std::size_t bytes) override {
    EPLB_CHECK_GT(bytes, std::size_t{0}, "allocate() needs a positive size");
    check_open();
    OwnRegion r;
    r.segment = create_segment(kBackend, "eplb-shm-region", bytes);
    r.data = r.segment.data;
    r.bytes = r.segment.bytes;
    regions_.push_back(std::move(r));
    return {static_cast<int>(regions_.size()) - 1, regions_.back().data, regions_.back().bytes};
  }

  // Caller memory: inside shareable memory, exported as its memfd and offset; otherwise peers
  // read it with process_vm_readv, one syscall per read and still no work of this process's
  // threads. Under Yama's ptrace_scope 1 only a process's ancestors may read it, and ranks are
  // siblings: this process names its parent, the launcher, whose descendants may read it.
  Region register_memory(void* data, std::size_t bytes) override {
    EPLB_CHECK(data != nullptr, "register_memory() of a null pointer");
    EPLB_CHECK_GT(bytes, std::size_t{0}, "register_memory() needs a positive size");
    check_open();
    OwnRegion r;
    r.data = static_cast<std::byte*>(data);
    r.bytes = bytes;
    r.kind = Kind::kRegistered;
    if (find_shareable(data, bytes, r.slice)) {
      r.kind = Kind::kShareable;
    } else if (!ptracer_set_) {
      // Yama ptrace_scope 1 lets only a declared tracer and its descendants read this process:
      // declare the launcher, whose descendants the sibling ranks are (EINVAL without Yama).
      (void)::prctl(PR_SET_PTRACER, static_cast<unsigned long>(::getppid()), 0, 0, 0);
      ptracer_set_ = true;
    }
    regions_.push_back(std::move(r));
    return {static_cast<int>(regions_.size()) - 1, regions_.back().data, regions_.back().bytes};
  }

  std::vector<std::byte> export_descriptor() const override {
    check_open();
    DescriptorWriter out(kBackend, kVersion, rank_);
    out.put(identity_);
    out.put(static_cast<std::int32_t>(control_.fd));
    out.put(control_.inode);
    out.put(static_cast<std::uint32_t>(regions_.size()));
    for (const OwnRegion& r : regions_) {
      out.put(static_cast<std::uint8_t>(r.kind));
      if (r.kind == Kind::kSegment) {
        out.put(static_cast<std::int32_t>(r.segment.fd));
        out.put(r.segment.inode);
      } else if (r.kind == Kind::kShareable) {
        out.put(static_cast<std::int32_t>(r.slice.fd));
        out.put(r.slice.inode);
        out.put(static_cast<std::uint64_t>(r.slice.segment_bytes));
        out.put(static_cast<std::uint64_t>(r.slice.offset));
      } else {
        out.put(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(r.data)));
      }
      out.put(static_cast<std::uint64_t>(r.bytes));
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
    const auto count = in.get_count("region count", 17);
    struct Entry {
      Kind kind = Kind::kSegment;
      std::int32_t fd = -1;
      std::uint64_t inode = 0, address = 0, bytes = 0, segment_bytes = 0, offset = 0;
    };
    std::vector<Entry> entries(count);
    for (auto& e : entries) {
      const auto kind = in.get<std::uint8_t>("region kind");
      if (kind > static_cast<std::uint8_t>(Kind::kShareable)) {
        fail<InvalidArgument>("shm descriptor of rank ", peer, ": region kind ", int{kind},
                              " is neither a segment (0), registered memory (1) nor shareable "
                              "memory (2)");
      }
      e.kind = static_cast<Kind>(kind);
      if (e.kind == Kind::kSegment) {
        e.fd = in.get<std::int32_t>("region fd");
        e.inode = in.get<std::uint64_t>("region inode");
      } else if (e.kind == Kind::kShareable) {
        e.fd = in.get<std::int32_t>("region fd");
        e.inode = in.get<std::uint64_t>("region inode");
        e.segment_bytes = in.get<std::uint64_t>("segment size");
        e.offset = in.get<std::uint64_t>("region offset");
      } else {
        e.address = in.get<std::uint64_t>("region address");
      }
      e.bytes = in.get<std::uint64_t>("region size");
      if (e.kind == Kind::kShareable &&
          (e.offset > e.segment_bytes || e.bytes > e.segment_bytes - e.offset)) {
        fail<InvalidArgument>("shm descriptor of rank ", peer, ": shareable region of ", e.bytes,
                              " bytes at offset ", e.offset, " does not fit its segment of ",
                              e.segment_bytes, " bytes");
      }
      if (e.kind == Kind::kRegistered && e.address + e.bytes < e.address) {
        fail<InvalidArgument>("shm descriptor of rank ", peer, ": registered region at ",
                              e.address, " of ", e.bytes, " bytes wraps the address space");
      }
    }
    in.expect_end();
    if (!identity.same_machine_as(identity_)) {
      fail<InvalidArgument>("shm descriptor of rank ", peer, " comes from another machine or pid ",
                            "namespace: shm connects processes of one machine; use ucx");
    }
    Peer p;
    p.imported = true;
    p.pid = identity.pid;
    p.bytes.reserve(count);
    for (const Entry& e : entries) {
      p.bytes.push_back(e.bytes);
      p.kinds.push_back(e.kind);
      p.addresses.push_back(e.address);
    }
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
      bool probed = false;
      std::map<std::uint64_t, std::size_t> mapped;  // inode -> index in p.mappings
      for (const Entry& e : entries) {
        if (e.kind == Kind::kSegment) {
          p.mappings.push_back(
              map_peer_segment(kBackend, peer, identity.pid, e.fd, e.inode, e.bytes));
          p.starts.push_back(p.mappings.back().data);
          continue;
        }
        if (e.kind == Kind::kShareable) {
          auto it = mapped.find(e.inode);
          if (it == mapped.end()) {
            p.mappings.push_back(map_peer_segment(kBackend, peer, identity.pid, e.fd, e.inode,
                                                  e.segment_bytes));
            it = mapped.emplace(e.inode, p.mappings.size() - 1).first;
          }
          const Segment& m = p.mappings[it->second];
          if (e.offset > m.bytes || e.bytes > m.bytes - e.offset) {
            fail<InvalidArgument>("shm descriptor of rank ", peer, ": shareable region of ",
                                  e.bytes, " bytes at offset ", e.offset, " is outside its ",
                                  m.bytes, "-byte segment");
          }
          p.starts.push_back(m.data + e.offset);
          continue;
        }
        p.starts.push_back(nullptr);
        // Whether cross-memory attach is allowed is known only by trying: once per peer, now,
        // rather than at the first rebalance.
        if (!probed) {
          std::byte one{};
          if (const int err = read_process(identity.pid, e.address, &one, 1); err != 0) {
            fail_cross_memory(peer, err, "when its descriptor was imported");
          }
          probed = true;
        }
      }
    }
    if (peers_.size() <= static_cast<std::size_t>(peer)) peers_.resize(peer + 1);
    peers_[peer] = std::move(p);
  }

  bool one_sided_to(int) const override { return true; }

  std::unique_ptr<Batch> post(std::span<const Read> reads) override {
    check_open();
    std::vector<std::uint64_t> own_bytes;
    for (const OwnRegion& r : regions_) own_bytes.push_back(r.bytes);
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
          std::memmove(r.dst, regions_[static_cast<std::size_t>(r.region)].data + r.offset,
                       r.bytes);
        }
        continue;
      }
      Peer& p = peers_[static_cast<std::size_t>(r.peer)];
      if (touched_.empty() || touched_.back() != r.peer) touched_.push_back(r.peer);
      if (r.bytes == 0) continue;
      const auto region = static_cast<std::size_t>(r.region);
      if (p.kinds[region] != Kind::kRegistered) {
        std::memcpy(r.dst, p.starts[region] + r.offset, r.bytes);
      } else if (const int err = read_process(p.pid, p.addresses[region] + r.offset, r.dst,
                                              r.bytes);
                 err != 0) {
        // A peer that died shows as ESRCH here; its liveness check below says the same.
        std::string owners = check_owners();
        if (!owners.empty()) return std::make_unique<SettledBatch>(std::move(owners));
        try {
          fail_cross_memory(r.peer, err, "in a batch");
        } catch (const Error& e) {
          return std::make_unique<SettledBatch>(e.what());
        }
      }
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
  bool ptracer_set_ = false;
  Segment control_;
  std::vector<OwnRegion> regions_;  // [region id]
  std::vector<Peer> peers_;       // [peer rank]
  std::vector<int> touched_;      // peers read by the batch being posted
};

}  // namespace

std::unique_ptr<Transport> create(const Options& options) {
  return std::make_unique<ShmTransport>(options);
}

}  // namespace eplb::transport::shm
