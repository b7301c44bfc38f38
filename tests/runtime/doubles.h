#pragma once
// The harness's test doubles, each standing in for what an engine or a fault would do: a
// transport that counts allocations, random delays and injected failures at the runtime's
// delay points, and an engine's min-reduction with its delivery thread
// (Carrier::kSharedMemory). Used by run_rank() (harness.cc) only.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/transport/transport.h"
#include "runtime/harness.h"
#include "runtime/testing.h"

namespace eplb::runtime::testing {

// splitmix64 (with its increment; core/hash.h's mix64 is the finalizer alone): the harness's
// seeds and synthetic loads are derived with it.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A transport that forwards everything and counts what allocates or connects, so a test can
// check that nothing is allocated or connected after connect().
class CountingTransport final : public transport::Transport {
 public:
  explicit CountingTransport(std::unique_ptr<transport::Transport> inner)
      : inner_(std::move(inner)) {}
  std::string_view backend() const override { return inner_->backend(); }
  int rank() const override { return inner_->rank(); }
  transport::Capabilities capabilities() const override { return inner_->capabilities(); }
  transport::Region allocate(std::size_t bytes) override {
    allocations_.fetch_add(1);
    allocated_bytes_.fetch_add(static_cast<int64_t>(bytes));
    return inner_->allocate(bytes);
  }
  // Registered memory is the engine's, not what eplb holds: counted apart.
  transport::Region register_memory(void* data, std::size_t bytes) override {
    allocations_.fetch_add(1);
    registered_bytes_.fetch_add(static_cast<int64_t>(bytes));
    return inner_->register_memory(data, bytes);
  }
  std::vector<std::byte> export_descriptor() const override {
    return inner_->export_descriptor();
  }
  void import_descriptor(int peer, std::span<const std::byte> descriptor) override {
    imports_.fetch_add(1);
    inner_->import_descriptor(peer, descriptor);
  }
  bool one_sided_to(int peer) const override { return inner_->one_sided_to(peer); }
  std::unique_ptr<transport::Batch> post(std::span<const transport::Read> reads) override {
    // Every read of this rank lands in its staging buffer (or the start-up probe).
    if (before_post_) before_post_();
    return inner_->post(reads);
  }
  void close() override { inner_->close(); }
  // Called before every post(), from the thread that posts.
  void set_before_post(std::function<void()> f) { before_post_ = std::move(f); }

  int64_t allocations() const { return allocations_.load(); }
  int64_t allocated_bytes() const { return allocated_bytes_.load(); }
  int64_t registered_bytes() const { return registered_bytes_.load(); }
  int64_t imports() const { return imports_.load(); }

 private:
  std::unique_ptr<transport::Transport> inner_;
  std::function<void()> before_post_;
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> allocated_bytes_{0};
  std::atomic<int64_t> registered_bytes_{0};
  std::atomic<int64_t> imports_{0};
};

// Random sleeps (and the injected failure) at the runtime's delay points. Called from three
// threads, hence the mutex.
class DelayHook {
 public:
  DelayHook(const Scenario& s, int rank)
      : rng_(mix64(s.seed * 1000003 + static_cast<uint64_t>(rank))),
        delays_(s.delays),
        max_us_(s.delay_max_us),
        fail_(s.fail_rank == rank),
        fail_at_(s.fail_at),
        fail_not_std_(s.fail_not_std),
        fail_placement_(s.fail_placement),
        slow_placement_(s.slow_placement_rank == rank),
        slow_placement_us_(int64_t{s.slow_placement_ms} * 1000) {}

  void operator()(DelayPoint point) {
    int64_t sleep_us = 0;
    bool fail_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (point == DelayPoint::kRead && fail_ && !fail_placement_ && ++reads_ == fail_at_) {
        fail_now = true;
      }
      if (point == DelayPoint::kPlacement && fail_ && fail_placement_ && ++placements_ == 1) {
        fail_now = true;
      }
      if (point == DelayPoint::kPlacement && slow_placement_) sleep_us += slow_placement_us_;
      if (delays_) {
        std::uniform_int_distribution<int> coin(0, 3);
        std::uniform_int_distribution<int64_t> us(0, max_us_);
        if (coin(rng_) == 0) sleep_us += us(rng_);
      }
    }
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    if (fail_now && fail_not_std_) throw 42;  // what a foreign library might throw
    if (fail_now) fail<IoError>("injected read failure (test)");
  }

 private:
  std::mutex mu_;
  std::mt19937_64 rng_;
  bool delays_;
  int max_us_;
  bool fail_;
  int fail_at_;
  bool fail_not_std_;
  bool fail_placement_;
  bool slow_placement_;
  int64_t slow_placement_us_;
  int reads_ = 0;
  int placements_ = 0;
};

// The engine's collective for Carrier::kSharedMemory: rank threads post their contribution of
// each step; once every rank has, the minimum is ready for each rank's delivery thread.
class SharedMinReduction {
 public:
  explicit SharedMinReduction(int ranks) : ranks_(ranks), stopped_(ranks, false) {}

  void contribute(int64_t step, int64_t value) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Entry& e = entries_[step];
      ++e.count;
      e.min = std::min(e.min, value);
    }
    cv_.notify_all();
  }

  // The minimum of `step` once every rank contributed to it; nothing once `rank` stopped.
  std::optional<int64_t> take(int rank, int64_t step) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      if (stopped_[rank]) return true;
      const auto it = entries_.find(step);
      return it != entries_.end() && it->second.count == ranks_;
    });
    if (stopped_[rank]) return std::nullopt;
    Entry& e = entries_[step];
    const int64_t min = e.min;
    if (++e.taken == ranks_) entries_.erase(step);
    return min;
  }

  void stop(int rank) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_[rank] = true;
    }
    cv_.notify_all();
  }

 private:
  struct Entry {
    int count = 0;
    int taken = 0;
    int64_t min = kNoAgreement;
  };
  const int ranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Entry> entries_;  // guarded by mu_
  std::vector<bool> stopped_;         // guarded by mu_
};

// One rank's delivery thread of Carrier::kSharedMemory: hands the result of every step to the
// Rebalancer in step order, after a random delay, from a thread that is not the forward
// thread. Stopped and joined before the Rebalancer shuts down.
class Delivery {
 public:
  Delivery(const Scenario& s, int rank, SharedMinReduction& reduction, Rebalancer& rb)
      : reduction_(reduction), rank_(rank) {
    thread_ = std::thread([this, &s, &rb] {
      std::mt19937_64 rng(mix64(s.seed * 7919 + static_cast<uint64_t>(rank_)));
      try {
        for (int64_t step = 0;; ++step) {
          const std::optional<int64_t> min = reduction_.take(rank_, step);
          if (!min) return;
          if (s.delays && std::uniform_int_distribution<int>(0, 1)(rng) == 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(
                std::uniform_int_distribution<int>(0, 2 * s.delay_max_us)(rng)));
          }
          if (s.drop_results_from >= 0 && step >= s.drop_results_from) continue;
          rb.agreement_result(step, *min);
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = e.what();
      }
    });
  }
  ~Delivery() { stop(); }

  void stop() {
    reduction_.stop(rank_);
    if (thread_.joinable()) thread_.join();
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  SharedMinReduction& reduction_;
  int rank_;
  std::mutex mu_;
  std::string error_;  // guarded by mu_
  std::thread thread_;
};

}  // namespace eplb::runtime::testing
