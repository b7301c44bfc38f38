#pragma once
// The results of an external agreement (Config::agreement = kExternal): the engine carries each
// step's agreement_contribution() on a collective of its own and hands the minimum in with
// agreement_result(), from any thread; the forward thread takes the result of step s at step
// s + lag. A ring of lag + 2 slots by step keeps the result of step s there until then.
//
// Threads: hand_in() any thread; take() the forward thread. The ring is guarded by the mutex.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace eplb::runtime {

class ExternalAgreement {
 public:
  explicit ExternalAgreement(int64_t lag) : slots_(static_cast<size_t>(lag + 2)) {}

  // The minimum of step `step`; a stale result never hides a newer one.
  void hand_in(int64_t step, int64_t value) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Slot& slot = slots_[static_cast<size_t>(step) % slots_.size()];
      if (step > slot.step) slot = {step, value};
    }
    cv_.notify_all();
  }

  // The result of `step`, waiting at most `timeout` for it; nothing when it did not come.
  std::optional<int64_t> take(int64_t step, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    Slot& slot = slots_[static_cast<size_t>(step) % slots_.size()];
    if (!cv_.wait_for(lock, timeout, [&] { return slot.step == step; })) return std::nullopt;
    return slot.value;
  }

 private:
  struct Slot {
    int64_t step = -1;
    int64_t value = 0;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;  // guarded by mu_
};

}  // namespace eplb::runtime
