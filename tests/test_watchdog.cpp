// The watchdog a GPU rank's collectives are watched by (engine/runtime/comm/watchdog.hpp): work that never finishes
// is reported once, naming it, and released; work that finishes, or whose owner is forgotten, never is; a report may
// look at the watchdog; a look that never returns is reported by the second thread. Each test waits for what it
// expects (bounded, 30 s), never for a time to pass.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/runtime/comm/watchdog.hpp"

using namespace ds;
using namespace std::chrono_literals;

namespace {

// What a watchdog reported, and a wait for it.
struct Reports {
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::pair<std::string, double>> seen;
  void add(const std::string& what, double waited) {
    std::lock_guard<std::mutex> lock(m);
    seen.emplace_back(what, waited);
    cv.notify_all();
  }
  Watchdog::Overdue sink() {
    return [this](const std::string& what, double waited) { add(what, waited); };
  }
  bool wait_for(size_t n) {
    std::unique_lock<std::mutex> lock(m);
    return cv.wait_for(lock, 30s, [&] { return seen.size() >= n; });
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(m);
    return seen.size();
  }
};

// Polls `done` until it holds (at most 30 s).
template <typename F>
bool eventually(F done) {
  for (auto until = std::chrono::steady_clock::now() + 30s; std::chrono::steady_clock::now() < until;) {
    if (done()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return done();
}

}  // namespace

TEST(Watchdog, WorkThatNeverFinishesIsReportedOnceNamingItAndReleased) {
  Reports reports;
  std::atomic<int> released{0};
  int owner = 0;
  Watchdog dog(50ms, reports.sink(), 5ms);
  dog.watch(&owner, "rank 1: an all-gather of updated parameters of step 3", [] { return false; }, [&] { ++released; });
  ASSERT_TRUE(reports.wait_for(1));
  ASSERT_TRUE(eventually([&] { return released == 1; }));
  EXPECT_EQ(dog.watched(), 0u);
  std::lock_guard<std::mutex> lock(reports.m);
  ASSERT_EQ(reports.seen.size(), 1u);  // once
  EXPECT_EQ(reports.seen[0].first, "rank 1: an all-gather of updated parameters of step 3");
  EXPECT_GE(reports.seen[0].second, 0.05);
}

TEST(Watchdog, FinishedWorkIsReleasedAndNeverReportedHoweverLateTheLook) {
  Reports reports;
  int owner = 0;
  {
    // Its first look comes 50 ms after it starts, long past the 1 ms limit: done work is released, not reported.
    std::atomic<int> released{0};
    Watchdog late(1ms, reports.sink(), 50ms);
    late.watch(&owner, "done", [] { return true; }, [&] { ++released; });
    ASSERT_TRUE(eventually([&] { return released == 1; }));
    EXPECT_EQ(late.watched(), 0u);
  }
  {
    // Work that finishes later is watched until then (within a limit no test reaches).
    std::atomic<int> released{0};
    std::atomic<bool> done{false};
    Watchdog dog(10s, reports.sink(), 1ms);
    dog.watch(&owner, "finishing", [&] { return done.load(); }, [&] { ++released; });
    EXPECT_EQ(released, 0);
    done = true;
    ASSERT_TRUE(eventually([&] { return released == 1; }));
    EXPECT_EQ(dog.watched(), 0u);
  }
  EXPECT_EQ(reports.count(), 0u);
}

TEST(Watchdog, AForgottenOwnersWorkIsReleasedAndNotReportedAndOthersStayWatched) {
  Reports reports;
  std::atomic<int> released{0};
  int aborted = 0, alive = 0;
  {
    Watchdog dog(10s, reports.sink(), 1ms);  // a limit no test reaches
    dog.watch(&aborted, "a", [] { return false; }, [&] { ++released; });
    dog.watch(&alive, "b", [] { return false; }, [&] { released += 10; });
    dog.watch(&aborted, "c", [] { return false; }, [&] { ++released; });
    dog.forget(&aborted);
    EXPECT_EQ(released, 2);
    EXPECT_EQ(dog.watched(), 1u);
  }  // the watchdog gone: what it held is released, not reported
  EXPECT_EQ(released, 12);
  EXPECT_EQ(reports.count(), 0u);
}

TEST(Watchdog, AReportMayUseTheWatchdogAndForgetItsOwnersOtherWork) {
  Reports reports;
  std::atomic<int> released{0};
  int owner = 0;
  Watchdog* dog = nullptr;
  std::atomic<size_t> held_during_report{99};
  Watchdog watchdog(50ms, [&](const std::string& what, double waited) {
    // Outside the watchdog's lock, or none of these would return.
    dog->watch(&owner, "later", [] { return false; }, [&] { ++released; });
    held_during_report = dog->watched();
    dog->forget(&owner);  // from the report itself: no wait for the report to end
    reports.add(what, waited);
  }, 5ms);
  dog = &watchdog;
  watchdog.watch(&owner, "late", [] { return false; }, [&] { ++released; });
  ASSERT_TRUE(reports.wait_for(1));
  ASSERT_TRUE(eventually([&] { return released == 2; }));
  EXPECT_EQ(held_during_report, 1u);  // "later", held while "late" was reported
  EXPECT_EQ(watchdog.watched(), 0u);
  std::lock_guard<std::mutex> lock(reports.m);
  ASSERT_EQ(reports.seen.size(), 1u);  // "later" was forgotten, never reported
  EXPECT_EQ(reports.seen[0].first, "late");
}

TEST(Watchdog, ALookThatNeverReturnsIsReportedByTheSecondThread) {
  Reports reports;
  std::mutex m;
  std::condition_variable cv;
  bool let_go = false;
  int owner = 0;
  {
    Watchdog dog(50ms, reports.sink(), 5ms);
    dog.watch(&owner, "stuck", [&] {  // blocks as a CUDA query behind a hung kernel may
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return let_go; });
      return true;
    });
    ASSERT_TRUE(reports.wait_for(1));
    {
      std::lock_guard<std::mutex> lock(m);
      let_go = true;  // (so that the watchdog can stop)
    }
    cv.notify_all();
  }
  std::lock_guard<std::mutex> lock(reports.m);
  ASSERT_EQ(reports.seen.size(), 1u);
  EXPECT_NE(reports.seen[0].first.find("the watchdog's own look at its work"), std::string::npos) << reports.seen[0].first;
  EXPECT_GE(reports.seen[0].second, 0.05);
}
