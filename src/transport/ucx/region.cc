// The ucx transport's regions and descriptors: memory mapped (and allocated) by UCX with its
// packed rkey, the descriptor that carries the worker address and one rkey per region, and its
// import, which unpacks a peer's rkeys (mapping them where UCX can) and connects to the peer.
// The Transport owns its regions until close() unmaps them (memory given to register_memory()
// stays the caller's); an imported Peer owns its rkeys. All of it runs on the reading side.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "eplb/core/error.h"
#include "transport/descriptor.h"
#include "transport/process.h"
#include "transport/ucx/ucx_transport.h"

namespace eplb::transport::ucx {
namespace {

constexpr std::uint16_t kVersion = 1;

}  // namespace

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

bool UcxTransport::one_sided_to(int peer_rank) const {
  if (peer_rank == rank_) return true;
  if (peer_rank < 0 || static_cast<std::size_t>(peer_rank) >= peers_.size() ||
      !peers_[peer_rank]) {
    fail<InvalidArgument>("one_sided_to(", peer_rank, "): that peer was not imported");
  }
  return peers_[peer_rank]->self || peers_[peer_rank]->one_sided();
}

}  // namespace eplb::transport::ucx
