// The record book and the worker thread on their own.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/record_book.h"
#include "runtime/worker.h"

namespace eplb::runtime {
namespace {

TEST(RecordBook, ARecordOpensEndsAndIsPublishedOnceWithWhatToRaise) {
  RecordBook book;
  EXPECT_FALSE(book.open.has_value());
  book.start(10, true);
  ASSERT_TRUE(book.open.has_value());
  EXPECT_EQ(book.open->index, 0);
  EXPECT_EQ(book.open->trigger_step, 10);
  EXPECT_TRUE(book.open->repair);
  EXPECT_FALSE(book.ended());
  book.open->outcome = Outcome::kFailed;
  book.end(13, Failure{FailureKind::kIoError, "lost"});
  EXPECT_TRUE(book.ended());
  EXPECT_EQ(book.open->end_step, 13);
  EXPECT_EQ(book.open->steps, 3);
  EXPECT_GE(book.open->seconds, 0.0);
  EXPECT_TRUE(book.history().empty());  // published at the end of that step, not before

  std::optional<Failure> raise;
  const RebalanceRecord r = book.publish(raise);
  EXPECT_EQ(r.index, 0);
  ASSERT_TRUE(raise.has_value());
  EXPECT_EQ(raise->message, "lost");
  EXPECT_FALSE(book.open.has_value());
  EXPECT_FALSE(book.ended());
  ASSERT_EQ(book.history().size(), 1u);
  EXPECT_EQ(book.history()[0].end_step, 13);

  book.start(20, false);
  EXPECT_EQ(book.open->index, 1);
  book.end(20, std::nullopt);
  book.publish(raise);
  EXPECT_FALSE(raise.has_value());  // what one record raised is never raised again
  EXPECT_EQ(book.history().size(), 2u);
}

TEST(RecordBook, AdoptedIndicesContinueTheGroupsNumbering) {
  RecordBook book;
  book.set_next_index(7);
  EXPECT_EQ(book.next_index(), 7);
  book.start(0, false);
  EXPECT_EQ(book.open->index, 7);
  EXPECT_EQ(book.next_index(), 8);
}

TEST(RecordBook, TheHistoryIsReadWhileRecordsArePublished) {
  RecordBook book;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    size_t last = 0;
    while (!done.load()) {
      const std::vector<RebalanceRecord> h = book.history();
      EXPECT_GE(h.size(), last);  // never shrinks
      for (size_t i = 0; i < h.size(); ++i) EXPECT_EQ(h[i].index, static_cast<int64_t>(i));
      last = h.size();
    }
  });
  std::optional<Failure> raise;
  for (int64_t s = 0; s < 200; ++s) {
    book.start(s, false);
    book.end(s + 1, std::nullopt);
    book.publish(raise);
  }
  done.store(true);
  reader.join();
  EXPECT_EQ(book.history().size(), 200u);
}

TEST(WorkerThread, RunsJobsInOrderAndIsIdleOnceAllRan) {
  WorkerThread worker;
  std::mutex mu;
  std::vector<int64_t> ran;  // guarded by mu
  worker.start([&](Active& job) {
    std::lock_guard<std::mutex> lock(mu);
    ran.push_back(job.index);
  });
  for (int64_t i = 0; i < 20; ++i) {
    auto job = std::make_shared<Active>();
    job->index = i;
    worker.submit(job);
  }
  worker.wait_idle();
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(ran.size(), 20u);
    for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(ran[i], i);
  }
  worker.stop();
  worker.stop();  // idempotent
}

TEST(WorkerThread, StopJoinsOnceTheRunningJobWasCancelled) {
  WorkerThread worker;
  std::atomic<int> started{0};
  worker.start([&](Active& job) {
    started.fetch_add(1);
    std::unique_lock<std::mutex> lock(job.mu);
    job.cv.wait(lock, [&] { return job.cancel.load(); });
  });
  auto running = std::make_shared<Active>();
  auto queued = std::make_shared<Active>();
  worker.submit(running);
  worker.submit(queued);
  while (started.load() == 0) std::this_thread::yield();
  {
    std::lock_guard<std::mutex> lock(running->mu);
    running->cancel.store(true);
  }
  running->cv.notify_one();
  // Stop may come before the worker takes the next job, or while it runs it: cancel that too.
  std::thread canceller([&] {
    std::lock_guard<std::mutex> lock(queued->mu);
    queued->cancel.store(true);
    queued->cv.notify_one();
  });
  canceller.join();
  worker.stop();
  EXPECT_LE(started.load(), 2);
}

}  // namespace
}  // namespace eplb::runtime
