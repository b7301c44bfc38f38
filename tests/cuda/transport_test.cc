// The Transport contract (include/eplb/transport/transport.h) on the cuda backend, ranks as
// forked processes sharing one GPU (CUDA IPC works between processes on the same device), world
// sizes 1, 2 and 4. Regions are device memory: they are filled and checked with cudaMemcpy, and
// destinations are device, pinned host and pageable host memory in turn.
//
// With no CUDA device every test skips, with the reason; under EPLB_REQUIRE_GPU=1 it fails.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_testing.h"
#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "transport/multi_rank.h"

namespace eplb::transport {
namespace {

using namespace std::chrono_literals;
using cuda_testing::ok;
using testing::Bytes;
using testing::Fate;
using testing::RankContext;
using testing::RunOptions;

// Generous: only a bound that turns a hang into a failure, never a measure of speed.
constexpr auto kWaitTimeout = 60s;

// `copy`: the transport's copy path (EPLB_CUDA_COPY) in every rank, "" for the default.
RunOptions processes(int world, const std::string& copy = "") {
  RunOptions o;
  o.world = world;
  o.processes = true;
  if (!copy.empty()) o.env.emplace_back("EPLB_CUDA_COPY", copy);
  return o;
}


// The byte at `offset` of region `region` of rank `rank`: every rank can compute any peer's.
std::uint64_t word_of(int rank, int region, std::uint64_t word) {
  std::uint64_t x = word + 0x9e3779b97f4a7c15ull * (static_cast<std::uint64_t>(rank) * 131 +
                                                    static_cast<std::uint64_t>(region) + 1);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
std::byte pattern(int rank, int region, std::uint64_t offset) {
  return static_cast<std::byte>(word_of(rank, region, offset / 8) >> (8 * (offset % 8)));
}

// Sizes of a rank's regions: distinct per rank, odd, and one larger than the 2 MiB granule.
std::vector<std::size_t> region_sizes(int rank) {
  const auto r = static_cast<std::size_t>(rank);
  return {1 + 7 * r,  64 * 1024 + 13 * r, 3,
          256 * 1024, 4096 + 1,           (std::size_t{3} << 20) + 4099 * r};
}

std::vector<std::byte> device_bytes(const void* data, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  if (bytes > 0) EPLB_TEST_CUDA(cudaMemcpy(out.data(), data, bytes, cudaMemcpyDeviceToHost));
  return out;
}

struct Rank {
  std::unique_ptr<Transport> transport;
  std::vector<Region> regions;
};

// Step 1: create, allocate, check the zero fill, fill with the pattern. Step 2: exchange and
// import descriptors (this rank's own too). Step 3: one small read from every peer.
Rank set_up(RankContext& ctx) {
  Rank r;
  r.transport = cuda_testing::create_transport(ctx);
  const auto sizes = region_sizes(ctx.rank);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const Region region = r.transport->allocate(sizes[i]);
    EXPECT_EQ(region.id, static_cast<int>(i));
    EXPECT_EQ(region.bytes, sizes[i]);
    const auto zeros = device_bytes(region.data, region.bytes);
    EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](std::byte b) {
      return b == std::byte{0};
    })) << "allocate() must zero-fill";
    std::vector<std::byte> host(region.bytes);
    for (std::size_t off = 0; off < host.size(); ++off) {
      host[off] = pattern(ctx.rank, static_cast<int>(i), off);
    }
    EPLB_TEST_CUDA(cudaMemcpy(region.data, host.data(), host.size(), cudaMemcpyHostToDevice));
    r.regions.push_back(region);
  }
  EPLB_TEST_CUDA(cudaDeviceSynchronize());  // the fills have landed before any peer reads
  const auto descriptors = ctx.all_gather("descriptors", r.transport->export_descriptor());
  for (int peer = 0; peer < ctx.world; ++peer) {
    r.transport->import_descriptor(peer, descriptors[peer]);
  }
  std::vector<std::byte> probe(static_cast<std::size_t>(ctx.world));
  std::vector<Read> reads;
  for (int peer = 0; peer < ctx.world; ++peer) reads.push_back({peer, 2, 1, &probe[peer], 1});
  r.transport->post(reads)->wait(kWaitTimeout);
  for (int peer = 0; peer < ctx.world; ++peer) EXPECT_EQ(probe[peer], pattern(peer, 2, 1));
  ctx.barrier("connected");
  return r;
}

// A destination of one of three kinds, with guard bytes on both sides to catch a read writing
// out of bounds.
enum class Kind { kDevice, kPinned, kPageable };

class Destination {
 public:
  static constexpr std::size_t kGuard = 16;
  static constexpr std::byte kFill{0xa5};

  Destination(Kind kind, std::size_t bytes) : kind_(kind), total_(bytes + 2 * kGuard) {
    switch (kind_) {
      case Kind::kDevice:
        EPLB_TEST_CUDA(cudaMalloc(&base_, total_));
        EPLB_TEST_CUDA(cudaMemset(base_, static_cast<int>(kFill), total_));
        EPLB_TEST_CUDA(cudaDeviceSynchronize());
        break;
      case Kind::kPinned:
        EPLB_TEST_CUDA(cudaHostAlloc(&base_, total_, cudaHostAllocDefault));
        std::memset(base_, static_cast<int>(kFill), total_);
        break;
      case Kind::kPageable:
        pageable_.assign(total_, kFill);
        base_ = pageable_.data();
        break;
    }
  }
  Destination(Destination&& o) noexcept
      : kind_(o.kind_), total_(o.total_), base_(o.base_), pageable_(std::move(o.pageable_)) {
    o.base_ = nullptr;
    if (kind_ == Kind::kPageable) base_ = pageable_.data();
  }
  Destination(const Destination&) = delete;
  Destination& operator=(const Destination&) = delete;
  Destination& operator=(Destination&&) = delete;
  ~Destination() {
    if (base_ == nullptr) return;
    if (kind_ == Kind::kDevice) (void)cudaFree(base_);
    if (kind_ == Kind::kPinned) (void)cudaFreeHost(base_);
  }

  Kind kind() const { return kind_; }
  std::byte* data() { return static_cast<std::byte*>(base_) + kGuard; }
  // Everything, guards included, as host bytes.
  std::vector<std::byte> contents() const {
    if (kind_ == Kind::kDevice) return device_bytes(base_, total_);
    const auto* p = static_cast<const std::byte*>(base_);
    return {p, p + total_};
  }

 private:
  Kind kind_;
  std::size_t total_;
  void* base_ = nullptr;
  std::vector<std::byte> pageable_;
};

const char* name_of(Kind kind) {
  return kind == Kind::kDevice ? "device" : kind == Kind::kPinned ? "pinned host" : "pageable host";
}

void expect_read(const Read& read, const Destination& dst, const std::string& what) {
  const auto bytes = dst.contents();
  const std::string where = what + " (" + name_of(dst.kind()) + " destination)";
  for (std::size_t i = 0; i < Destination::kGuard; ++i) {
    ASSERT_EQ(bytes[i], Destination::kFill) << where << ": wrote before its destination";
    ASSERT_EQ(bytes[bytes.size() - 1 - i], Destination::kFill)
        << where << ": wrote past its destination";
  }
  for (std::size_t i = 0; i < read.bytes; ++i) {
    ASSERT_EQ(bytes[Destination::kGuard + i], pattern(read.peer, read.region, read.offset + i))
        << where << ": byte " << i << " of " << read.bytes << " from rank " << read.peer
        << " region " << read.region << " offset " << read.offset;
  }
}

struct Param {
  int world = 1;
  std::string copy;  // EPLB_CUDA_COPY, "" for the default path
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << "world " << p.world << (p.copy.empty() ? "" : " EPLB_CUDA_COPY=" + p.copy);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return "w" + std::to_string(info.param.world) +
         (info.param.copy.empty() ? "" : "_" + info.param.copy);
}

class CudaTransport : public ::testing::TestWithParam<Param> {};

TEST_P(CudaTransport, RandomReadsReturnThePeersBytes) {
  const Param p = GetParam();
  EPLB_RUN_RANKS(processes(p.world, p.copy), [&](RankContext& ctx) {
    Rank r = set_up(ctx);
    const std::uint32_t seed = 20240711u + static_cast<std::uint32_t>(ctx.rank);
    SCOPED_TRACE("rank " + std::to_string(ctx.rank) + " seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    // Three batches in flight at once, each spanning every peer and region: random ranges,
    // zero-length reads, whole-region reads, into every kind of destination.
    std::vector<std::vector<Read>> batches(3);
    std::vector<std::vector<Destination>> dsts(3);
    for (int b = 0; b < 3; ++b) {
      for (int i = 0; i < 48; ++i) {
        Read read;
        read.peer = static_cast<int>(rng() % static_cast<unsigned>(ctx.world));
        const auto sizes = region_sizes(read.peer);
        read.region = static_cast<int>(rng() % sizes.size());
        const std::size_t size = sizes[static_cast<std::size_t>(read.region)];
        switch (rng() % 5) {
          case 0:  // zero-length, anywhere including the very end
            read.offset = rng() % (size + 1);
            read.bytes = 0;
            break;
          case 1:  // the whole region
            read.offset = 0;
            read.bytes = size;
            break;
          default:
            read.offset = rng() % size;
            read.bytes = 1 + rng() % (size - read.offset);
        }
        dsts[b].emplace_back(static_cast<Kind>(rng() % 3), read.bytes);
        batches[b].push_back(read);
      }
      for (std::size_t i = 0; i < batches[b].size(); ++i) {
        batches[b][i].dst = batches[b][i].bytes == 0 && i % 2 ? nullptr : dsts[b][i].data();
      }
    }
    std::vector<std::unique_ptr<Batch>> posted;
    for (auto& batch : batches) posted.push_back(r.transport->post(batch));
    for (int b = 2; b >= 0; --b) {
      ASSERT_NO_THROW(posted[b]->wait(kWaitTimeout));
      EXPECT_EQ(posted[b]->poll(), Progress::kDone) << "done stays done";
      for (std::size_t i = 0; i < batches[b].size(); ++i) {
        expect_read(batches[b][i], dsts[b][i],
                    "batch " + std::to_string(b) + " read " + std::to_string(i));
      }
    }
    posted.clear();
    ctx.barrier("done");  // nobody closes while a peer may still read from it
  });
}

class CudaTransportKilled : public ::testing::TestWithParam<Param> {};

TEST_P(CudaTransportKilled, OwnerFailsReadsWithIoError) {
  const Param p = GetParam();
  const int victim = p.world - 1;
  RunOptions options = processes(p.world, p.copy);
  options.fate = [victim](int rank) { return rank == victim ? Fate::kKilled : Fate::kExits; };
  EPLB_RUN_RANKS(options, [&](RankContext& ctx) {
    Rank r = set_up(ctx);
    ctx.barrier("ready");
    if (ctx.rank == victim) ::raise(SIGKILL);
    // Survivors keep reading from everyone until the victim's death shows up as IoError: never
    // as a read that succeeds after the owner is gone, never as a hang.
    std::vector<Destination> dsts;
    std::vector<Read> reads;
    for (int peer = 0; peer < ctx.world; ++peer) {
      dsts.emplace_back(Kind::kDevice, 1024);
      reads.push_back({peer, 1, 100, dsts.back().data(), 1024});
    }
    bool failed = false;
    const auto deadline = std::chrono::steady_clock::now() + kWaitTimeout;
    while (!failed && std::chrono::steady_clock::now() < deadline) {
      try {
        r.transport->post(reads)->wait(kWaitTimeout);
      } catch (const IoError& e) {
        failed = true;
        EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(victim)), std::string::npos)
            << "the error should name the rank that is gone: " << e.what();
      }
    }
    EXPECT_TRUE(failed) << "reads from a killed rank never failed";
    // The survivors still read each other, and themselves.
    std::vector<int> survivors;
    for (int peer = 0; peer < ctx.world; ++peer) {
      if (peer != victim) survivors.push_back(peer);
    }
    reads.pop_back();
    ASSERT_NO_THROW(r.transport->post(reads)->wait(kWaitTimeout));
    for (std::size_t i = 0; i < reads.size(); ++i) expect_read(reads[i], dsts[i], "after");
    ctx.rendezvous->all_gather("survivors-done", ctx.rank, survivors, {});
  });
}

// World sizes 1, 2 and 4 on the default copy path, and 2 with one cudaMemcpyAsync per read; a
// killed owner needs a survivor beside it.
INSTANTIATE_TEST_SUITE_P(Worlds, CudaTransport,
                         ::testing::Values(Param{1, ""}, Param{2, ""}, Param{4, ""},
                                           Param{2, "memcpy"}),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Worlds, CudaTransportKilled,
                         ::testing::Values(Param{2, ""}, Param{4, ""}, Param{2, "memcpy"}),
                         param_name);

char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

// One-sided: a stopped owner's memory is still readable, and reads from it need nothing of it.
TEST(CudaTransportFailures, StoppedOwnerStillServesReads) {
  RunOptions options = processes(2);
  options.fate = [](int rank) { return rank == 1 ? Fate::kStopped : Fate::kExits; };
  EPLB_RUN_RANKS(options, [&](RankContext& ctx) {
    Rank r = set_up(ctx);
    const pid_t me = ::getpid();
    const auto pids = ctx.all_gather("ready", Bytes(reinterpret_cast<const std::byte*>(&me),
                                                    reinterpret_cast<const std::byte*>(&me + 1)));
    if (ctx.rank == 1) {
      ::raise(SIGSTOP);
      return;  // never reached: the parent kills a stopped rank
    }
    pid_t victim;
    std::memcpy(&victim, pids[1].data(), sizeof victim);
    const auto deadline = std::chrono::steady_clock::now() + kWaitTimeout;
    while (process_state(victim) != 'T' && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(process_state(victim), 'T') << "the owner did not stop";
    EXPECT_TRUE(r.transport->one_sided_to(1));
    Destination dst(Kind::kDevice, 64 * 1024);
    const Read read{1, 1, 3, dst.data(), 64 * 1024};
    EXPECT_NO_THROW(r.transport->post(std::span(&read, 1))->wait(10s))
        << "a one-sided read needs nothing from the stopped owner";
    expect_read(read, dst, "read from a stopped owner");
  });
}

// close() of an owner fails its readers' next reads with IoError, and its descriptor no longer
// imports.
TEST(CudaTransportFailures, ClosedOwnerFailsReadsAndImports) {
  EPLB_RUN_RANKS(processes(2), [&](RankContext& ctx) {
    Rank r = set_up(ctx);
    const Bytes mine = r.transport->export_descriptor();
    const auto descriptors = ctx.all_gather("again", mine);
    if (ctx.rank == 1) r.transport->close();
    ctx.barrier("closed");
    if (ctx.rank == 0) {
      Destination dst(Kind::kDevice, 1024);
      const Read read{1, 1, 0, dst.data(), 1024};
      try {
        r.transport->post(std::span(&read, 1))->wait(kWaitTimeout);
        ADD_FAILURE() << "a read from a closed owner succeeded";
      } catch (const IoError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 closed"), std::string::npos) << e.what();
      }
      try {
        r.transport->import_descriptor(1, descriptors[1]);
        ADD_FAILURE() << "the descriptor of a closed owner imported";
      } catch (const IoError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      }
      const Read own{0, 1, 0, dst.data(), 1024};
      ASSERT_NO_THROW(r.transport->post(std::span(&own, 1))->wait(kWaitTimeout));
      expect_read(own, dst, "own region after a peer closed");
    }
    ctx.barrier("done");
  });
}

// wait() that times out leaves the batch pending; destroying a pending batch returns only once
// nothing more will be written to its destinations.
TEST(CudaTransportBatches, TimeoutLeavesPendingAndDestroyWaitsForTheCopies) {
  constexpr std::size_t kBig = std::size_t{512} << 20;
  EPLB_RUN_RANKS(processes(2), [&](RankContext& ctx) {
    auto t = cuda_testing::create_transport(ctx);
    const Region region = t->allocate(ctx.rank == 1 ? kBig : 4096);
    EPLB_TEST_CUDA(cudaMemset(region.data, 0x3c, region.bytes));
    EPLB_TEST_CUDA(cudaDeviceSynchronize());
    const auto descriptors = ctx.all_gather("descriptors", t->export_descriptor());
    if (ctx.rank == 0) {
      t->import_descriptor(1, descriptors[1]);
      void* dst = nullptr;
      EPLB_TEST_CUDA(cudaMalloc(&dst, kBig));
      auto sample = [&](std::byte expected, const char* what) {
        for (const std::size_t at : {std::size_t{0}, kBig / 2, kBig - 4096}) {
          const auto bytes = device_bytes(static_cast<std::byte*>(dst) + at, 4096);
          for (std::size_t i = 0; i < bytes.size(); ++i) {
            ASSERT_EQ(bytes[i], expected) << what << ": byte " << at + i;
          }
        }
      };
      const Read read{1, 0, 0, dst, kBig};
      // A zero timeout: Timeout (the copy has hardly started), and the batch stays usable.
      auto batch = t->post(std::span(&read, 1));
      try {
        batch->wait(0ms);
      } catch (const Timeout& e) {
        EXPECT_NE(std::string(e.what()).find("not done"), std::string::npos) << e.what();
      }
      ASSERT_NO_THROW(batch->wait(kWaitTimeout));
      EXPECT_EQ(batch->poll(), Progress::kDone);
      batch.reset();
      sample(std::byte{0x3c}, "after wait");
      // Destroyed while pending, then overwritten: the overwrite must stay.
      EPLB_TEST_CUDA(cudaMemset(dst, 0, kBig));
      EPLB_TEST_CUDA(cudaDeviceSynchronize());
      t->post(std::span(&read, 1)).reset();
      EPLB_TEST_CUDA(cudaMemset(dst, 0x5a, kBig));
      EPLB_TEST_CUDA(cudaDeviceSynchronize());
      std::this_thread::sleep_for(50ms);
      sample(std::byte{0x5a}, "written after its batch was destroyed");
      EPLB_TEST_CUDA(cudaFree(dst));
    }
    ctx.barrier("done");
  });
}

std::string invalid_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

TEST(CudaTransportInput, CapabilitiesAndDeviceMemory) {
  EPLB_RUN_RANKS(processes(1), [&](RankContext& ctx) {
    auto t = cuda_testing::create_transport(ctx);
    EXPECT_EQ(t->backend(), "cuda");
    EXPECT_EQ(t->rank(), 0);
    const Capabilities caps = t->capabilities();
    EXPECT_TRUE(caps.device_memory);
    EXPECT_TRUE(caps.one_sided);
    EXPECT_FALSE(caps.register_memory);
    EXPECT_FALSE(caps.cross_node);
    EXPECT_TRUE(t->one_sided_to(0));
    const Region a = t->allocate(10);
    const Region b = t->allocate((std::size_t{3} << 20) + 5);
    EXPECT_EQ(a.id, 0);
    EXPECT_EQ(b.id, 1);
    cudaPointerAttributes attributes{};
    EPLB_TEST_CUDA(cudaPointerGetAttributes(&attributes, b.data));
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice) << "regions are device memory";
    const auto zeros = device_bytes(b.data, b.bytes);
    EXPECT_TRUE(
        std::all_of(zeros.begin(), zeros.end(), [](std::byte x) { return x == std::byte{0}; }));
    EPLB_TEST_CUDA(cudaMemset(b.data, 0x77, b.bytes));
    EPLB_TEST_CUDA(cudaDeviceSynchronize());
    // The reading side may be any thread, one at a time: this one has no device chosen.
    std::vector<std::byte> dst(b.bytes);
    std::thread reader([&] {
      const Read read{0, 1, 0, dst.data(), b.bytes};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
    });
    reader.join();
    EXPECT_TRUE(
        std::all_of(dst.begin(), dst.end(), [](std::byte x) { return x == std::byte{0x77}; }));
    std::vector<std::byte> host(64);
    EXPECT_THROW(t->register_memory(host.data(), host.size()), NotSupported);
  });
}

TEST(CudaTransportInput, BadReadsAreRejectedBeforeAnyStarts) {
  EPLB_RUN_RANKS(processes(1), [&](RankContext& ctx) {
    auto t = cuda_testing::create_transport(ctx);
    EXPECT_NE(invalid_message([&] { t->allocate(0); }).find("positive"), std::string::npos);
    const Region region = t->allocate(1000);
    EPLB_TEST_CUDA(cudaMemset(region.data, 0x11, region.bytes));
    EPLB_TEST_CUDA(cudaDeviceSynchronize());
    t->import_descriptor(0, t->export_descriptor());
    std::vector<std::byte> dst(2000, std::byte{0});
    const Read good{0, 0, 0, dst.data(), 10};
    auto rejected = [&](Read bad) {
      const Read reads[] = {good, bad};
      return invalid_message([&] { t->post(reads); });
    };
    EXPECT_NE(rejected({1, 0, 0, dst.data(), 1}).find("not imported"), std::string::npos);
    EXPECT_NE(rejected({-1, 0, 0, dst.data(), 1}).find("peer -1"), std::string::npos);
    EXPECT_NE(rejected({0, 1, 0, dst.data(), 1}).find("region 1"), std::string::npos);
    EXPECT_NE(rejected({0, 0, 1000, dst.data(), 1}).find("runs past the end"), std::string::npos);
    EXPECT_NE(rejected({0, 0, 999, dst.data(), 2}).find("runs past the end"), std::string::npos);
    EXPECT_NE(rejected({0, 0, 0, dst.data(), 1001}).find("runs past the end"), std::string::npos);
    EXPECT_NE(rejected({0, 0, ~0ull, dst.data(), 2}).find("runs past the end"), std::string::npos);
    EXPECT_NE(rejected({0, 0, 0, nullptr, 1}).find("null destination"), std::string::npos);
    EXPECT_EQ(dst[0], std::byte{0}) << "a rejected batch must not start its good reads";
    EXPECT_THROW(t->register_memory(dst.data(), dst.size()), NotSupported);
    const Read end{0, 0, 1000, nullptr, 0};  // zero bytes at the very end: valid
    EXPECT_NO_THROW(t->post(std::span(&end, 1))->wait(kWaitTimeout));
    EXPECT_NO_THROW(t->post(std::span(&good, 1))->wait(kWaitTimeout));
    EXPECT_EQ(dst[9], std::byte{0x11});
    t->close();
    EXPECT_NE(invalid_message([&] { t->post(std::span(&good, 1)); }).find("closed"),
              std::string::npos);
  });
}

std::size_t find(const Bytes& haystack, const void* needle, std::size_t bytes) {
  const auto* n = static_cast<const std::byte*>(needle);
  const auto at = std::search(haystack.begin(), haystack.end(), n, n + bytes);
  return at == haystack.end() ? std::string::npos : static_cast<std::size_t>(at - haystack.begin());
}

TEST(CudaTransportInput, BadDescriptorsAreInvalidArgumentsWithAReason) {
  EPLB_RUN_RANKS(processes(2), [&](RankContext& ctx) {
    auto t = cuda_testing::create_transport(ctx);
    t->allocate(4096);
    const Bytes mine = t->export_descriptor();
    const auto descriptors = ctx.all_gather("descriptors", mine);
    if (ctx.rank == 0) {
      const Bytes& good = descriptors[1];
      auto import = [&](const Bytes& d, int peer = 1) {
        return invalid_message([&] { t->import_descriptor(peer, d); });
      };
      // The shared envelope.
      for (std::size_t n = 0; n < good.size(); ++n) {
        const std::string m = import(Bytes(good.begin(), good.begin() + n));
        ASSERT_NE(m.find("truncated"), std::string::npos) << n << " bytes: " << m;
      }
      Bytes longer = good;
      longer.push_back(std::byte{0});
      EXPECT_NE(import(longer).find("extra bytes"), std::string::npos) << import(longer);
      Bytes garbage = good;
      garbage[0] = std::byte{'X'};
      EXPECT_NE(import(garbage).find("magic"), std::string::npos) << import(garbage);
      Bytes other = good;
      std::memset(other.data() + 4, 0, 8);
      std::memcpy(other.data() + 4, "shm", 3);
      EXPECT_NE(import(other).find("comes from backend 'shm'"), std::string::npos) << import(other);
      Bytes version = good;
      version[12] = std::byte{0x7f};
      EXPECT_NE(import(version).find("version"), std::string::npos) << import(version);
      EXPECT_NE(import(good, 0).find("descriptor of rank 1 imported as peer 0"), std::string::npos)
          << import(good, 0);
      Bytes cut(good.begin(), good.end() - 3);
      const auto length = static_cast<std::uint32_t>(cut.size());
      std::memcpy(cut.data() + 16, &length, sizeof length);
      EXPECT_NE(import(cut).find("malformed"), std::string::npos) << import(cut);
      const std::string from_inproc =
          import(create("inproc", Options{.rank = 1})->export_descriptor());
      EXPECT_NE(from_inproc.find("comes from backend 'inproc'"), std::string::npos) << from_inproc;

      // Another machine: the boot id differs.
      std::string boot_id;
      std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot_id);
      const std::size_t boot_at = find(good, boot_id.data(), boot_id.size());
      ASSERT_NE(boot_at, std::string::npos) << "the descriptor should carry the boot id";
      Bytes machine = good;
      machine[boot_at] = machine[boot_at] == std::byte{'0'} ? std::byte{'1'} : std::byte{'0'};
      EXPECT_NE(import(machine).find("another machine"), std::string::npos) << import(machine);

      // Another GPU, one this process cannot see: the UUID differs.
      int device = 0;
      EPLB_TEST_CUDA(cudaGetDevice(&device));
      cudaDeviceProp prop{};
      EPLB_TEST_CUDA(cudaGetDeviceProperties(&prop, device));
      const std::size_t uuid_at = find(good, &prop.uuid, sizeof prop.uuid);
      ASSERT_NE(uuid_at, std::string::npos) << "the descriptor should carry the GPU's UUID";
      Bytes gpu = good;
      gpu[uuid_at] ^= std::byte{0xff};
      const std::string m = import(gpu);
      EXPECT_NE(m.find("cannot see"), std::string::npos) << m;
      EXPECT_NE(m.find("GPU-"), std::string::npos) << "the message should name the GPU: " << m;

      // A region count that promises more than the descriptor holds.
      Bytes count = good;
      const std::size_t count_at = uuid_at + 16 + 32;
      std::uint32_t regions;
      std::memcpy(&regions, count.data() + count_at, sizeof regions);
      ASSERT_EQ(regions, 1u) << "the region count follows the GPU identity";
      regions = 1000000;
      std::memcpy(count.data() + count_at, &regions, sizeof regions);
      EXPECT_NE(import(count).find("malformed"), std::string::npos) << import(count);

      // This process's own descriptor under another rank.
      Bytes own = mine;
      const std::int32_t one = 1;
      std::memcpy(own.data() + 20, &one, sizeof one);
      EXPECT_NE(import(own).find("comes from this process"), std::string::npos) << import(own);

      // The good descriptor still imports after all that, and serves a read.
      EXPECT_NO_THROW(t->import_descriptor(1, good));
      std::byte probe{0x7f};
      const Read read{1, 0, 0, &probe, 1};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
      EXPECT_EQ(probe, std::byte{0});
      // Importing again replaces the view (the same IPC handles open twice in one process).
      EXPECT_NO_THROW(t->import_descriptor(1, good));
      probe = std::byte{0x7f};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
      EXPECT_EQ(probe, std::byte{0});
    } else {
      t->import_descriptor(0, descriptors[0]);
      std::byte probe{0x7f};
      const Read read{0, 0, 0, &probe, 1};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
    }
    ctx.barrier("done");
  });
}

TEST(CudaTransportRegistry, CudaIsABuiltBackend) {
  EXPECT_TRUE(has_backend("cuda"));
  const auto names = backend_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "cuda"), names.end());
}

}  // namespace
}  // namespace eplb::transport
