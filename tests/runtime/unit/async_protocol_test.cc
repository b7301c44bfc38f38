// The async step protocol and the external agreement's results on their own: what is
// contributed each step, when an agreement is due and what it says, the checks on results
// handed in, and the hand-over of installed layers to the worker. External agreement, so no
// control plane runs: results are handed in by hand (from other threads too).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "eplb/core/error.h"
#include "runtime/async_protocol.h"
#include "runtime/external_agreement.h"

namespace eplb::runtime {
namespace {

Config external(int64_t lag) {
  Config c;
  c.lag = lag;
  c.agreement = Agreement::kExternal;
  c.timeout = std::chrono::milliseconds(200);  // how long a missing result is waited for
  return c;
}

TEST(ExternalAgreement, AResultWaitsInItsSlotUntilTakenAndAStaleOneNeverHidesANewerOne) {
  ExternalAgreement ring(2);  // 4 slots
  ring.hand_in(3, 7);
  ring.hand_in(7, 9);  // the same slot as step 3, newer
  ring.hand_in(3, 1);  // stale: ignored
  EXPECT_EQ(ring.take(7, std::chrono::milliseconds(0)).value_or(-1), 9);
  EXPECT_FALSE(ring.take(3, std::chrono::milliseconds(0)).has_value());
  EXPECT_FALSE(ring.take(5, std::chrono::milliseconds(1)).has_value());  // never handed in
}

TEST(ExternalAgreement, TakeWaitsForAResultHandedInOnAnotherThread) {
  ExternalAgreement ring(1);
  {
    // Handed in only after the take has begun (and, but for a very slow start, waits): a take
    // that did not wait would find nothing.
    std::atomic<bool> taking{false};
    std::thread late([&] {
      while (!taking.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ring.hand_in(0, 100);
    });
    taking.store(true);
    EXPECT_EQ(ring.take(0, std::chrono::minutes(1)).value_or(-1), 100);
    late.join();
  }
  std::thread engine([&] {
    for (int64_t s = 0; s < 50; ++s) ring.hand_in(s, 100 + s);
  });
  for (int64_t s = 0; s < 50; ++s) {
    // A slot is reused every lag + 2 steps: a result is taken before the engine is that far
    // ahead only if the engine waits, so this checks what a take can see, not when.
    const std::optional<int64_t> v = ring.take(s, std::chrono::milliseconds(0));
    if (v) {
      EXPECT_EQ(*v, 100 + s);
    }
  }
  engine.join();
  EXPECT_EQ(ring.take(49, std::chrono::minutes(1)).value_or(-1), 149);
}

TEST(AsyncProtocol, NoRebalanceContributesNoAgreement) {
  const Config config = external(2);
  AsyncProtocol p(config);
  EXPECT_EQ(p.contribution(), kNoAgreement);
  p.contribute(1, nullptr);
  EXPECT_EQ(p.contribution(), kNoAgreement);
  EXPECT_FALSE(p.take_due(3, 0).due);
}

TEST(AsyncProtocol, TheAgreementOfStepSIsTakenAtStepSPlusLag) {
  const Config config = external(2);
  AsyncProtocol p(config);
  auto active = std::make_shared<Active>();
  p.start(active);
  active->progress.store(1);
  p.contribute(10, nullptr);
  EXPECT_EQ(p.contribution(), 1);
  active->progress.store(3);
  p.contribute(11, nullptr);
  EXPECT_EQ(p.contribution(), 3);
  p.publish_step(11);
  p.hand_in(10, 1);
  p.hand_in(11, 2);
  EXPECT_FALSE(p.take_due(11, 0).due);  // step 9's: never contributed
  AsyncProtocol::Agreed a = p.take_due(12, 0);
  ASSERT_TRUE(a.due);
  EXPECT_FALSE(a.failed);
  EXPECT_EQ(a.value, 1);
  a = p.take_due(13, 0);
  ASSERT_TRUE(a.due);
  EXPECT_EQ(a.value, 2);
  EXPECT_FALSE(p.control_broken());
  p.finish(false);
  EXPECT_EQ(p.active(), nullptr);
  EXPECT_FALSE(active->cancel.load());
}

TEST(AsyncProtocol, AResultAboveThisRanksContributionBreaksTheControlPlane) {
  const Config config = external(1);
  AsyncProtocol p(config);
  auto active = std::make_shared<Active>();
  p.start(active);
  active->progress.store(2);
  p.contribute(5, nullptr);
  p.publish_step(5);
  p.hand_in(5, 4);
  const AsyncProtocol::Agreed a = p.take_due(6, 0);
  ASSERT_TRUE(a.due);
  EXPECT_TRUE(a.failed);
  EXPECT_NE(a.message.find("above this rank's contribution 2"), std::string::npos) << a.message;
  EXPECT_TRUE(p.control_broken());
}

TEST(AsyncProtocol, AMissingResultFailsTheRebalanceAndNamesTheStep) {
  const Config config = external(1);
  AsyncProtocol p(config);
  p.start(std::make_shared<Active>());
  p.contribute(8, nullptr);
  const AsyncProtocol::Agreed a = p.take_due(9, 0);
  ASSERT_TRUE(a.failed);
  EXPECT_NE(a.message.find("step 8 was not handed in"), std::string::npos) << a.message;
  EXPECT_TRUE(p.control_broken());
}

TEST(AsyncProtocol, ANegativeAgreementNamesTheRankThatFailed) {
  const Config config = external(1);
  AsyncProtocol p(config);
  auto active = std::make_shared<Active>();
  p.start(active);
  p.contribute(1, nullptr);
  p.publish_step(1);
  p.hand_in(1, -1 - 3);  // rank 3 failed
  AsyncProtocol::Agreed a = p.take_due(2, 0);
  ASSERT_TRUE(a.failed);
  EXPECT_EQ(a.message, "rank 3 failed (its log has the error)");
  EXPECT_FALSE(p.control_broken());  // the agreement itself held

  // This rank's own worker failed: its own message and error.
  active->failure = Failure{FailureKind::kIoError, "read of rank 1 failed"};
  active->progress.store(-1 - 0);
  p.contribute(2, nullptr);
  p.publish_step(2);
  p.hand_in(2, -1 - 0);
  a = p.take_due(3, 0);
  ASSERT_TRUE(a.failed);
  EXPECT_EQ(a.message, "rank 0: read of rank 1 failed");
  ASSERT_TRUE(a.error.has_value());
}

TEST(AsyncProtocol, ResultsAreRefusedFromAnInternalAgreementAndForStepsNotEnded) {
  Config internal = external(2);
  internal.agreement = Agreement::kInternal;
  AsyncProtocol in(internal);
  EXPECT_THROW(in.hand_in(0, 1), InvalidArgument);

  const Config config = external(2);
  AsyncProtocol p(config);
  p.publish_step(4);
  EXPECT_THROW(p.hand_in(5, 1), InvalidArgument);
  EXPECT_THROW(p.hand_in(-1, 1), InvalidArgument);
  EXPECT_NO_THROW(p.hand_in(4, 1));
}

TEST(AsyncProtocol, TheWorkerIsHandedEachInstalledLayerAndCancelled) {
  const Config config = external(1);
  AsyncProtocol p(config);
  auto active = std::make_shared<Active>();
  p.start(active);
  p.contribute(1, nullptr);
  bool waiting = false;  // under active->mu
  std::thread worker([&] {  // as run_job waits between layers
    std::unique_lock<std::mutex> lock(active->mu);
    waiting = true;
    active->cv.wait(lock, [&] { return active->installed >= 2 || active->cancel.load(); });
  });
  // The worker holds the mutex until it waits: from then on only a notify wakes it (without
  // one, the test hangs to its timeout).
  for (;;) {
    const std::lock_guard<std::mutex> lock(active->mu);
    if (waiting) break;
  }
  AsyncProtocol::hand_over(*active, 1);
  AsyncProtocol::hand_over(*active, 2);
  worker.join();
  EXPECT_EQ(active->installed, 2);

  std::thread cancelled([&] {
    std::unique_lock<std::mutex> lock(active->mu);
    active->cv.wait(lock, [&] { return active->installed >= 3 || active->cancel.load(); });
  });
  p.finish(true);  // cancels the worker, forgets the rebalance and its agreements
  cancelled.join();
  EXPECT_TRUE(active->cancel.load());
  EXPECT_EQ(p.active(), nullptr);
  EXPECT_FALSE(p.take_due(2, 0).due);
  p.drop_agreements();
  EXPECT_EQ(p.contribution(), kNoAgreement);
}

TEST(AsyncProtocol, EachQueuedCollectiveIsWaitedForWithinTheTimeout) {
  Config config = external(3);
  config.timeout = std::chrono::milliseconds(1000);
  const AsyncProtocol p(config);
  EXPECT_EQ(p.result_bound(), std::chrono::milliseconds(8000));
}

}  // namespace
}  // namespace eplb::runtime
