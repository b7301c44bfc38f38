#include "control/inproc/communicator.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "control/protocol.h"
#include "eplb/core/error.h"

namespace eplb::control::inproc {
namespace {

using detail::Call;
using detail::Kind;

struct Message {
  Call call;
  Bytes data;
};

// The state the threads of one group share. A round: each rank deposits its message in the
// buffer of the round's parity and counts itself in; once `arrived_` reaches round * size,
// every rank has deposited and each copies what it needs. A rank can be at most one round ahead
// of the slowest (it cannot finish a round before everyone has entered it), so two buffers
// suffice: the one a rank writes was last read in the round before the previous one.
class World {
 public:
  explicit World(int size) : size_(size), rounds_(size, 0), joined_(size, false),
                             left_(size, false) {
    buffers_[0].resize(size);
    buffers_[1].resize(size);
  }

  int size() const { return size_; }

  // Under the registry's lock: claims `rank`, or says why it cannot.
  void claim(int rank, const std::string& name) {
    std::lock_guard lock(mu_);
    if (joined_[rank]) {
      fail<InvalidArgument>("inproc: rank ", rank, " of group '", name,
                            "' has already joined (each rank joins once; use another "
                            "rendezvous or group for a new communicator)");
    }
    joined_[rank] = true;
  }

  // The round's messages, by reference: the buffer stays as it is until this rank has entered
  // the next round (a rank cannot write this parity again before every rank has done so), so
  // the caller reads it without the lock and without a copy (a copy per rank was N^2 messages
  // per collective, under the lock: most of the agreement's time at 128 thread ranks).
  const std::vector<Message>& exchange(int rank, Message mine, Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    const std::uint64_t round = ++rounds_[rank];
    buffers_[round & 1][rank] = std::move(mine);
    ++arrived_;
    const std::uint64_t target = round * static_cast<std::uint64_t>(size_);
    if (arrived_ == target) cv_.notify_all();
    while (arrived_ < target) {
      for (int r = 0; r < size_; ++r) {
        if (left_[r] && rounds_[r] < round) {
          fail<IoError>("rank ", r, " left the group (its communicator was destroyed) "
                        "before joining this collective");
        }
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && arrived_ < target) {
        std::string missing;
        for (int r = 0; r < size_; ++r) {
          if (rounds_[r] < round) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        fail<Timeout>("timed out waiting for rank(s) ", missing,
                      " (stopped, hung or too slow)");
      }
    }
    return buffers_[round & 1];
  }

  void leave(int rank) {
    std::lock_guard lock(mu_);
    left_[rank] = true;
    cv_.notify_all();
  }

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t arrived_ = 0;
  std::vector<std::uint64_t> rounds_;  // [rank] rounds entered
  std::vector<bool> joined_;           // [rank]
  std::vector<bool> left_;             // [rank]
  std::vector<Message> buffers_[2];    // [parity][rank]
};

// The groups of this process, by name. Entries expire with the last communicator of a group.
std::shared_ptr<World> find_or_create(const std::string& name, int rank, int size) {
  static std::mutex mu;
  static auto* worlds = new std::map<std::string, std::weak_ptr<World>>;
  std::lock_guard lock(mu);
  std::shared_ptr<World> world = (*worlds)[name].lock();
  if (!world) {
    world = std::make_shared<World>(size);
    (*worlds)[name] = world;
  } else if (world->size() != size) {
    fail<InvalidArgument>("inproc: rank ", rank, " joins group '", name, "' with size ", size,
                          " but the group has size ", world->size(),
                          " (every rank must pass the same size)");
  }
  world->claim(rank, name);
  // Drop expired entries so that the table does not grow with every group ever made.
  for (auto it = worlds->begin(); it != worlds->end();) {
    it = it->second.expired() ? worlds->erase(it) : std::next(it);
  }
  return world;
}

class InprocCommunicator final : public Communicator {
 public:
  InprocCommunicator(const Options& options, std::shared_ptr<World> world)
      : Communicator(options.rank, options.size, options.timeout), world_(std::move(world)) {}

  ~InprocCommunicator() override { world_->leave(rank()); }

  std::string_view backend() const override { return "inproc"; }

  void join(Clock::time_point deadline) { round(Call{Kind::kJoin, 0, 0}, {}, deadline); }

 protected:
  void do_barrier(Clock::time_point deadline) override {
    round(Call{Kind::kBarrier, 0, 0}, {}, deadline);
  }

  void do_all_reduce(std::span<std::int64_t> values, ReduceOp op,
                     Clock::time_point deadline) override {
    Bytes mine(values.size_bytes());
    if (!values.empty()) std::memcpy(mine.data(), values.data(), values.size_bytes());
    const auto& all = round(Call{Kind::kAllReduce, static_cast<std::uint32_t>(op), values.size()},
                            std::move(mine), deadline);
    // Rank order, the same on every rank.
    std::vector<std::int64_t> acc(values.size()), in(values.size());
    for (int r = 0; r < size(); ++r) {
      auto& target = r == 0 ? acc : in;
      if (!target.empty()) std::memcpy(target.data(), all[r].data.data(), values.size_bytes());
      if (r > 0) reduce_into(acc, in, op);
    }
    std::copy(acc.begin(), acc.end(), values.begin());
  }

  void do_broadcast(Bytes& data, int root, Clock::time_point deadline) override {
    const auto& all = round(Call{Kind::kBroadcast, static_cast<std::uint32_t>(root), 0},
                            rank() == root ? data : Bytes{}, deadline);
    if (rank() != root) data = all[root].data;  // a copy: every rank reads the root's message
  }

  std::vector<Bytes> do_all_gather(std::span<const std::byte> data,
                                   Clock::time_point deadline) override {
    const auto& all =
        round(Call{Kind::kAllGather, 0, 0}, Bytes(data.begin(), data.end()), deadline);
    std::vector<Bytes> out;
    out.reserve(all.size());
    for (const auto& message : all) out.push_back(message.data);
    return out;
  }

 private:
  // Valid until this rank's next collective.
  const std::vector<Message>& round(Call call, Bytes data, Clock::time_point deadline) {
    const auto& all = world_->exchange(rank(), Message{call, std::move(data)}, deadline);
    for (int r = 0; r < size(); ++r) detail::check_same_call(call, all[r].call, r);
    return all;
  }

  std::shared_ptr<World> world_;
};

}  // namespace

std::unique_ptr<Communicator> connect(const Options& options) {
  const std::string name = options.rendezvous + "/" + options.group;
  auto comm = std::make_unique<InprocCommunicator>(
      options, find_or_create(name, options.rank, options.size));
  const auto prefix = ::eplb::detail::concat("control connect (inproc, rank ", options.rank,
                                             " of ", options.size, ", group '", name, "'): ");
  try {
    comm->join(Clock::now() + options.timeout);
  } catch (const Timeout& e) {
    fail<Timeout>(prefix, e.what());
  } catch (const IoError& e) {
    fail<IoError>(prefix, e.what());
  }
  return comm;
}

}  // namespace eplb::control::inproc
