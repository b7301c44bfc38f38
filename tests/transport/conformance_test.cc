// The Transport contract, checked on every built backend and world sizes 1, 2, 3, 4 and 8:
// inproc ranks are threads, every other backend's ranks are forked processes. UCX runs twice:
// with its default transports (shared memory on one machine) and with UCX_TLS=tcp, where reads
// are emulated with messages served by the owner's progress thread. hybrid runs with even and
// odd ranks on two emulated nodes and UCX_TLS=tcp: shm within a node, emulated reads across.
//
// What a stopped rank (SIGSTOP) means, per backend: its memory stays mapped, so shm reads (and
// UCX reads through a mapped key) succeed with the right bytes; an emulated read (UCX over TCP)
// needs the owner's CPU and must end in Timeout. inproc ranks are threads and cannot be stopped.

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <ostream>
#include <sstream>
#include <thread>

#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/shareable.h"
#include "multi_rank.h"

namespace eplb::transport {
namespace {

using testing::Bytes;
using testing::Fate;
using testing::RankContext;
using testing::RunOptions;
using testing::SkipRanks;
using namespace std::chrono_literals;

// Generous: only a bound that turns a hang into a failure, never a measure of speed.
constexpr auto kWaitTimeout = 60s;

struct Param {
  std::string backend;
  std::string tls;  // UCX_TLS for the ranks, "" for UCX's default
  int world = 1;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.backend << (p.tls.empty() ? "" : " UCX_TLS=" + p.tls) << " world " << p.world;
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return info.param.backend + (info.param.tls.empty() ? "" : "_" + info.param.tls) + "_w" +
         std::to_string(info.param.world);
}

std::vector<Param> variants() {
  std::vector<Param> out;
  for (const std::string& name : backend_names()) {
    // cuda regions are device memory, which this suite fills and checks from the host: its own
    // suite (tests/cuda/transport_test.cc) covers the same contract.
    if (name == "cuda") continue;
    out.push_back({name, "", 1});
    if (name == "ucx") out.push_back({name, "tcp", 1});
    if (name == "hybrid") out.back().tls = "tcp";
  }
  return out;
}

std::vector<Param> all_params() {
  std::vector<Param> out;
  for (const Param& v : variants()) {
    for (int world : {1, 2, 3, 4, 8}) out.push_back({v.backend, v.tls, world});
  }
  return out;
}

RunOptions run_options(const Param& p) {
  RunOptions o;
  o.world = p.world;
  o.processes = p.backend != "inproc";
  if (!p.tls.empty()) o.env.emplace_back("UCX_TLS", p.tls);
  return o;
}

std::unique_ptr<Transport> create_or_skip(const Param& p, int rank) {
  try {
    // hybrid: even and odd ranks on two nodes, so that every world > 1 has both kinds of peer.
    const std::string node = p.backend == "hybrid" ? "node" + std::to_string(rank % 2) : "";
    return create(p.backend, Options{.rank = rank, .node = node});
  } catch (const IoError& e) {
    throw SkipRanks{"backend " + p.backend + (p.tls.empty() ? "" : " with UCX_TLS=" + p.tls) +
                    " cannot start here: " + e.what()};
  }
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

// Sizes of a rank's regions (distinct per rank and odd on purpose); a last registered region
// where the backend can serve caller memory.
std::vector<std::size_t> region_sizes(int rank, bool with_registered) {
  std::vector<std::size_t> sizes{1 + 7 * static_cast<std::size_t>(rank), 64 * 1024 + 13 * static_cast<std::size_t>(rank),
                                 3, 256 * 1024, 4096 + 1};
  if (with_registered) sizes.push_back(32 * 1024 + 5 * static_cast<std::size_t>(rank));
  return sizes;
}

struct Rank {
  std::unique_ptr<Transport> transport;
  std::vector<Region> regions;
  std::vector<std::byte> registered;  // caller memory behind the registered region
  bool with_registered = false;
};

// Step 1: create, allocate, fill with the pattern. Step 2: exchange and import descriptors.
Rank set_up(const Param& p, RankContext& ctx) {
  Rank r;
  r.transport = create_or_skip(p, ctx.rank);
  r.with_registered = r.transport->capabilities().register_memory;
  const auto sizes = region_sizes(ctx.rank, r.with_registered);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const bool registered = r.with_registered && i + 1 == sizes.size();
    Region region;
    if (registered) {
      r.registered.resize(sizes[i]);
      region = r.transport->register_memory(r.registered.data(), sizes[i]);
    } else {
      region = r.transport->allocate(sizes[i]);
    }
    EXPECT_EQ(region.id, static_cast<int>(i));
    EXPECT_EQ(region.bytes, sizes[i]);
    for (std::size_t off = 0; off < sizes[i]; ++off) {
      EXPECT_EQ(region.data[off], std::byte{0}) << "allocate() must zero-fill";
      region.data[off] = pattern(ctx.rank, static_cast<int>(i), off);
      if (!registered && ::testing::Test::HasFailure()) break;
    }
    r.regions.push_back(region);
  }
  const auto descriptors = ctx.all_gather("descriptors", r.transport->export_descriptor());
  for (int peer = 0; peer < ctx.world; ++peer) {
    r.transport->import_descriptor(peer, descriptors[peer]);
  }
  // Step 3: one small read from every peer, as the runtime does at start-up, so every
  // connection is up before a test kills or stops anyone.
  std::vector<std::byte> probe(static_cast<std::size_t>(ctx.world));
  std::vector<Read> reads;
  for (int peer = 0; peer < ctx.world; ++peer) reads.push_back({peer, 2, 1, &probe[peer], 1});
  r.transport->post(reads)->wait(kWaitTimeout);
  for (int peer = 0; peer < ctx.world; ++peer) EXPECT_EQ(probe[peer], pattern(peer, 2, 1));
  ctx.barrier("connected");
  return r;
}

// A destination with guard bytes on both sides, to catch a read writing out of bounds.
struct Destination {
  static constexpr std::size_t kGuard = 16;
  std::vector<std::byte> bytes;
  explicit Destination(std::size_t n) : bytes(n + 2 * kGuard, std::byte{0xa5}) {}
  std::byte* data() { return bytes.data() + kGuard; }
};

void expect_read(const Read& read, Destination& dst, const std::string& what) {
  for (std::size_t i = 0; i < Destination::kGuard; ++i) {
    ASSERT_EQ(dst.bytes[i], std::byte{0xa5}) << what << ": wrote before its destination";
    ASSERT_EQ(dst.bytes[dst.bytes.size() - 1 - i], std::byte{0xa5})
        << what << ": wrote past its destination";
  }
  for (std::size_t i = 0; i < read.bytes; ++i) {
    ASSERT_EQ(dst.data()[i], pattern(read.peer, read.region, read.offset + i))
        << what << ": byte " << i << " of " << read.bytes << " from rank " << read.peer
        << " region " << read.region << " offset " << read.offset;
  }
}

class TransportConformance : public ::testing::TestWithParam<Param> {};

TEST_P(TransportConformance, RandomReadsReturnThePeersBytes) {
  const Param p = GetParam();
  std::string skip;
  const bool skipped = testing::run_ranks(run_options(p), [&](RankContext& ctx) {
    Rank r = set_up(p, ctx);
    const std::uint32_t seed = 20240601u + static_cast<std::uint32_t>(ctx.rank);
    SCOPED_TRACE("rank " + std::to_string(ctx.rank) + " seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    // Three batches in flight at once, each spanning every peer and region: random ranges,
    // zero-length reads, and whole-region (maximum-size) reads.
    std::vector<std::vector<Read>> batches(3);
    std::vector<std::vector<Destination>> dsts(3);
    for (int b = 0; b < 3; ++b) {
      for (int i = 0; i < 48; ++i) {
        Read read;
        read.peer = static_cast<int>(rng() % static_cast<unsigned>(ctx.world));
        const auto sizes = region_sizes(read.peer, r.with_registered);
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
        dsts[b].emplace_back(read.bytes);
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
        expect_read(batches[b][i], dsts[b][i], "batch " + std::to_string(b) + " read " +
                                                   std::to_string(i));
      }
    }
    posted.clear();
    ctx.barrier("done");  // nobody closes while a peer may still read from it
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

TEST_P(TransportConformance, KilledRankFailsSurvivorsReads) {
  const Param p = GetParam();
  if (p.world < 2) GTEST_SKIP() << "needs a survivor and a victim";
  const int victim = p.world - 1;
  RunOptions options = run_options(p);
  options.fate = [&](int rank) { return rank == victim ? Fate::kKilled : Fate::kExits; };
  if (!options.processes) options.fate = [](int) { return Fate::kExits; };
  std::string skip;
  const bool skipped = testing::run_ranks(options, [&](RankContext& ctx) {
    Rank r = set_up(p, ctx);
    ctx.barrier("ready");
    if (ctx.rank == victim) {
      // A thread cannot be killed alone: an inproc rank "dies" by closing its transport.
      if (ctx.processes) ::raise(SIGKILL);
      r.transport->close();
      return;
    }
    // Survivors keep reading from everyone until the victim's death shows up as IoError.
    std::vector<Destination> dsts;
    std::vector<Read> reads;
    for (int peer = 0; peer < ctx.world; ++peer) {
      dsts.emplace_back(1024);
      reads.push_back({peer, 1, 100, dsts.back().data(), 1024});
    }
    bool failed = false;
    const auto deadline = std::chrono::steady_clock::now() + kWaitTimeout;
    while (!failed && std::chrono::steady_clock::now() < deadline) {
      try {
        r.transport->post(reads)->wait(kWaitTimeout);
        for (std::size_t i = 0; i < reads.size(); ++i) expect_read(reads[i], dsts[i], "before");
      } catch (const IoError& e) {
        failed = true;
        EXPECT_NE(std::string(e.what()).find(std::to_string(victim)), std::string::npos)
            << "the error should name the rank that is gone: " << e.what();
      }
    }
    EXPECT_TRUE(failed) << "reads from a killed rank never failed";
    // The survivors still read each other.
    std::vector<int> survivors;
    for (int peer = 0; peer < ctx.world; ++peer) {
      if (peer != victim) survivors.push_back(peer);
    }
    reads.pop_back();
    ASSERT_NO_THROW(r.transport->post(reads)->wait(kWaitTimeout));
    for (std::size_t i = 0; i < reads.size(); ++i) expect_read(reads[i], dsts[i], "after");
    ctx.rendezvous->all_gather("survivors-done", ctx.rank, survivors, {});
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

TEST_P(TransportConformance, StoppedRankGivesBytesOrTimeoutNeverAHang) {
  const Param p = GetParam();
  if (p.world < 2) GTEST_SKIP() << "needs a reader and a stopped rank";
  if (p.backend == "inproc") GTEST_SKIP() << "inproc ranks are threads: one cannot be stopped";
  const int victim = p.world - 1;
  RunOptions options = run_options(p);
  options.fate = [&](int rank) { return rank == victim ? Fate::kStopped : Fate::kExits; };
  std::string skip;
  const bool skipped = testing::run_ranks(options, [&](RankContext& ctx) {
    Rank r = set_up(p, ctx);
    // Warm every connection up while everyone runs.
    std::vector<Destination> dsts;
    std::vector<Read> reads;
    for (int peer = 0; peer < ctx.world; ++peer) {
      dsts.emplace_back(512);
      reads.push_back({peer, 3, 7, dsts.back().data(), 512});
    }
    ASSERT_NO_THROW(r.transport->post(reads)->wait(kWaitTimeout));
    const pid_t me = ::getpid();
    const auto pids = ctx.all_gather("ready", Bytes(reinterpret_cast<const std::byte*>(&me),
                                                    reinterpret_cast<const std::byte*>(&me + 1)));
    if (ctx.rank == victim) {
      ::raise(SIGSTOP);
      return;  // never reached: the parent kills a stopped rank
    }
    pid_t victim_pid;
    std::memcpy(&victim_pid, pids[victim].data(), sizeof victim_pid);
    const auto deadline = std::chrono::steady_clock::now() + kWaitTimeout;
    while (process_state(victim_pid) != 'T' && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(process_state(victim_pid), 'T') << "the victim did not stop";

    Destination dst(64 * 1024);
    const Read read{victim, 1, 3, dst.data(), 64 * 1024};
    const bool one_sided = r.transport->one_sided_to(victim);
    bool timed_out = false;
    try {
      r.transport->post(std::span(&read, 1))->wait(2s);
    } catch (const Timeout&) {
      timed_out = true;
    }
    if (one_sided) {
      EXPECT_FALSE(timed_out) << "a one-sided read needs nothing from the stopped owner";
    }
    if (p.tls == "tcp" && !one_sided) {  // hybrid: only peers on another node go over TCP
      EXPECT_TRUE(timed_out) << "TCP emulates reads: a stopped owner stalls them";
    }
    if (!timed_out) expect_read(read, dst, "read from a stopped rank");

    std::vector<int> survivors;
    for (int peer = 0; peer < ctx.world; ++peer) {
      if (peer != victim) survivors.push_back(peer);
    }
    reads.pop_back();
    ASSERT_NO_THROW(r.transport->post(reads)->wait(kWaitTimeout));
    for (std::size_t i = 0; i < reads.size(); ++i) expect_read(reads[i], dsts[i], "survivors");
    ctx.rendezvous->all_gather("survivors-done", ctx.rank, survivors, {});
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

// Registered memory as engines have it: many small tensors at unaligned bases inside one
// allocation of the caller's (the last ten inside shareable memory, allocate_shareable(), which
// shm serves by mapping), read at odd offsets and lengths by every peer. Then (shm, whose
// readers use cross-memory attach) a registered region its owner unmaps: reads of it fail with
// IoError, nothing crashes, and the owner's other regions stay readable.
TEST_P(TransportConformance, RegisteredMemoryOfEveryShape) {
  const Param p = GetParam();
  constexpr int kTensors = 40;
  const auto tensor_bytes = [](int rank, int i) {
    return static_cast<std::size_t>(1 + (i * 37 + rank * 11) % 300);
  };
  std::string skip;
  const bool skipped = testing::run_ranks(run_options(p), [&](RankContext& ctx) {
    std::unique_ptr<Transport> transport = create_or_skip(p, ctx.rank);
    if (!transport->capabilities().register_memory) {
      throw SkipRanks{p.backend + " serves no caller memory (register_memory)"};
    }
    std::vector<std::byte> plain(64 * 1024);
    auto* shareable = static_cast<std::byte*>(allocate_shareable(32 * 1024));
    std::size_t at = 1 + static_cast<std::size_t>(ctx.rank % 7);  // unaligned from the start
    for (int i = 0; i < kTensors; ++i) {
      if (i == kTensors - 10) at = 3;  // the last ten in shareable memory
      std::byte* memory = i < kTensors - 10 ? plain.data() : shareable;
      const std::size_t bytes = tensor_bytes(ctx.rank, i);
      for (std::size_t b = 0; b < bytes; ++b) memory[at + b] = pattern(ctx.rank, i, b);
      const Region region = transport->register_memory(memory + at, bytes);
      EXPECT_EQ(region.id, i);
      EXPECT_EQ(region.data, memory + at);
      at += bytes + 1 + static_cast<std::size_t>(i % 5);  // odd gaps between them
    }
    // One more, in pages of its own, that its owner (rank 0) unmaps below.
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    void* pages = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                         -1, 0);
    ASSERT_NE(pages, MAP_FAILED);
    std::memset(pages, 0x3c, 2 * page);
    EXPECT_EQ(transport->register_memory(pages, 2 * page).id, kTensors);
    const auto descriptors = ctx.all_gather("descriptors", transport->export_descriptor());
    for (int peer = 0; peer < ctx.world; ++peer) {
      transport->import_descriptor(peer, descriptors[peer]);
    }
    std::mt19937 rng(977u + static_cast<std::uint32_t>(ctx.rank));
    std::vector<Read> reads;
    std::vector<Destination> dsts;
    for (int peer = 0; peer < ctx.world; ++peer) {
      for (int i = 0; i < kTensors; ++i) {
        const std::size_t size = tensor_bytes(peer, i);
        Read read{peer, i, rng() % size, nullptr, 0};
        read.bytes = 1 + rng() % (size - read.offset);
        if (i % 4 == 0) read = {peer, i, 0, nullptr, size};  // whole tensors too
        dsts.emplace_back(read.bytes);
        reads.push_back(read);
      }
    }
    for (std::size_t i = 0; i < reads.size(); ++i) reads[i].dst = dsts[i].data();
    ASSERT_NO_THROW(transport->post(reads)->wait(kWaitTimeout));
    for (std::size_t i = 0; i < reads.size(); ++i) {
      expect_read(reads[i], dsts[i], "registered read " + std::to_string(i));
    }
    ctx.barrier("read");
    if (p.backend == "shm" && ctx.world > 1) {
      if (ctx.rank == 0) {
        ASSERT_EQ(::munmap(pages, 2 * page), 0);
      }
      ctx.barrier("unmapped");
      if (ctx.rank != 0) {
        std::vector<std::byte> dst(page);
        const Read gone{0, kTensors, page / 2, dst.data(), page};
        std::unique_ptr<Batch> batch = transport->post(std::span<const Read>(&gone, 1));
        EXPECT_THROW(batch->wait(kWaitTimeout), IoError);
        // The owner's other registered memory is still there.
        Destination still(tensor_bytes(0, 1));
        const Read fine{0, 1, 0, still.data(), tensor_bytes(0, 1)};
        ASSERT_NO_THROW(transport->post(std::span<const Read>(&fine, 1))->wait(kWaitTimeout));
        expect_read(fine, still, "after the unmap");
      }
    } else {
      ctx.barrier("unmapped");
    }
    ctx.barrier("done");
    transport->close();  // before its memory goes (UCX unmaps what it mapped)
    if (!(p.backend == "shm" && ctx.world > 1 && ctx.rank == 0)) ::munmap(pages, 2 * page);
    free_shareable(shareable);
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportConformance, ::testing::ValuesIn(all_params()),
                         param_name);

// Single-rank checks of bad input, once per backend variant.
class TransportInput : public ::testing::TestWithParam<Param> {};

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

TEST_P(TransportInput, BadDescriptorsAreInvalidArgumentsWithAReason) {
  const Param p = GetParam();
  Param two = p;
  two.world = 2;
  std::string skip;
  const bool skipped = testing::run_ranks(run_options(two), [&](RankContext& ctx) {
    auto t = create_or_skip(p, ctx.rank);
    t->allocate(4096);
    const Bytes mine = t->export_descriptor();
    const auto descriptors = ctx.all_gather("descriptors", mine);
    if (ctx.rank == 0) {
      const Bytes& good = descriptors[1];
      auto import = [&](const Bytes& d, int peer = 1) {
        return invalid_message([&] { t->import_descriptor(peer, d); });
      };
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
      const char* foreign = p.backend == "shm" ? "ucx" : "shm";
      std::memset(other.data() + 4, 0, 8);
      std::memcpy(other.data() + 4, foreign, std::strlen(foreign));
      EXPECT_NE(import(other).find("comes from backend '" + std::string(foreign) + "'"),
                std::string::npos)
          << import(other);
      Bytes version = good;
      version[12] = std::byte{0x7f};
      EXPECT_NE(import(version).find("version"), std::string::npos) << import(version);
      EXPECT_NE(import(good, 0).find("descriptor of rank 1 imported as peer 0"), std::string::npos)
          << import(good, 0);
      // A payload cut short, with a header that agrees with the new length.
      Bytes cut(good.begin(), good.end() - 3);
      const auto length = static_cast<std::uint32_t>(cut.size());
      std::memcpy(cut.data() + 16, &length, sizeof length);
      EXPECT_NE(import(cut).find("malformed"), std::string::npos) << import(cut);
      // A real descriptor of another backend.
      auto inproc_transport = create("inproc", Options{.rank = 1});
      if (p.backend != "inproc") {
        const std::string m = import(inproc_transport->export_descriptor());
        EXPECT_NE(m.find("comes from backend 'inproc'"), std::string::npos) << m;
      }
      // The good descriptor still imports after all that, and serves a read.
      EXPECT_NO_THROW(t->import_descriptor(1, good));
      std::byte probe{0x7f};
      const Read read{1, 0, 0, &probe, 1};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
      EXPECT_EQ(probe, std::byte{0});
    } else {
      // Connections are made both ways and at the same moment, as the runtime makes them; each
      // import completes its handshake, so either rank may then exit first.
      t->import_descriptor(0, descriptors[0]);
      std::byte probe{0x7f};
      const Read read{0, 0, 0, &probe, 1};
      EXPECT_NO_THROW(t->post(std::span(&read, 1))->wait(kWaitTimeout));
    }
    ctx.barrier("done");
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

TEST_P(TransportInput, BadReadsAreRejectedBeforeAnyStarts) {
  const Param p = GetParam();
  std::string skip;
  const bool skipped = testing::run_ranks(run_options(p), [&](RankContext& ctx) {
    auto t = create_or_skip(p, ctx.rank);
    EXPECT_NE(invalid_message([&] { t->allocate(0); }).find("positive"), std::string::npos);
    const Region region = t->allocate(1000);
    std::memset(region.data, 0x11, region.bytes);
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
    if (!t->capabilities().register_memory) {
      EXPECT_THROW(t->register_memory(dst.data(), dst.size()), NotSupported);
    }
    const Read end{0, 0, 1000, nullptr, 0};  // zero bytes at the very end: valid
    EXPECT_NO_THROW(t->post(std::span(&end, 1))->wait(kWaitTimeout));
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

TEST(TransportRegistry, NamesTheBuiltBackendsForAnUnknownOne) {
  const auto names = backend_names();
  ASSERT_GE(names.size(), 2u);
  EXPECT_EQ(names[0], "inproc");
  EXPECT_EQ(names[1], "shm");
  const std::string m = invalid_message([] { create("rdma", Options{}); });
  EXPECT_NE(m.find("unknown transport backend 'rdma'"), std::string::npos) << m;
  EXPECT_NE(m.find("inproc|shm"), std::string::npos) << m;
}

// Found by fuzz_descriptor: an inproc descriptor whose region count (0xff000002) is far more
// than its bytes hold must be refused before anything is sized by it.
TEST(TransportDescriptors, HugeRegionCountIsMalformedNotAnAllocation) {
  const unsigned char bytes[] = {
      'E', 'P', 'L', 'B', 'i', 'n', 'p', 'r', 'o', 'c', 0, 0, 1, 0, 0, 0, 56, 0, 0, 0,
      1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 50, 41, 0, 0, 2, 0, 0, 0xff, 0xff, 0xef, 0xff,
      0, 0, 0, 0, 0, 100, 0, 0, 0, 0, 0, 0, 0};
  auto t = create("inproc", Options{.rank = 0});
  const std::string m = invalid_message([&] {
    t->import_descriptor(1, std::as_bytes(std::span(bytes)));
  });
  EXPECT_NE(m.find("malformed"), std::string::npos) << m;
}

// hybrid imports one half of a peer's descriptor; the other must still be what it claims.
// In a forked rank: a UCX context must never exist in the process that forks the others.
TEST(TransportDescriptors, HybridChecksBothHalves) {
  if (!has_backend("hybrid")) GTEST_SKIP() << "hybrid needs UCX";
  RunOptions options;
  options.world = 1;
  options.processes = true;
  std::string skip;
  const bool skipped = testing::run_ranks(options, [&](RankContext&) {
    std::unique_ptr<Transport> t;
    try {
      t = create("hybrid", Options{.rank = 0, .node = "a"});
    } catch (const IoError& e) {
      throw SkipRanks{std::string("UCX cannot start here: ") + e.what()};
    }
    t->allocate(4096);
    const Bytes good = t->export_descriptor();
    // Walk the payload: node name, region sizes, then the shm and the ucx halves.
    std::size_t at = 24;  // the envelope every descriptor starts with
    const auto u32 = [&] {
      std::uint32_t v;
      std::memcpy(&v, good.data() + at, sizeof v);
      at += sizeof v;
      return v;
    };
    at += u32();                      // node name
    at += 8 * std::size_t{u32()};     // region sizes
    const std::size_t near = at + 4;  // the shm half
    at += u32();
    const std::size_t far = at + 4;   // the ucx half
    for (const auto& [offset, name] : {std::pair{near, "shm"}, std::pair{far, "ucx"}}) {
      Bytes bad = good;
      bad[offset] = std::byte{'X'};
      const std::string m = invalid_message([&] { t->import_descriptor(0, bad); });
      EXPECT_NE(m.find(std::string("its ") + name + " half"), std::string::npos) << m;
    }
    EXPECT_NO_THROW(t->import_descriptor(0, good));
  }, &skip);
  if (skipped) GTEST_SKIP() << skip;
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportInput, ::testing::ValuesIn(variants()), param_name);

}  // namespace
}  // namespace eplb::transport
