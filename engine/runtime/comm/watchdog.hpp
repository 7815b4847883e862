// ds — a rank's last guard against a peer that never comes. A GPU's collectives run on streams the host does not
// wait for; the host's own waits for them are bounded (the communicator's settle), but the host may also block
// where no bounded wait runs: a copy to host memory, or a read of the device, queued behind a collective whose peer
// is gone. A watchdog thread polls every piece of work it is given and, once one has stayed unfinished past its
// limit, reports it (the NCCL communicator ends the rank, naming the collective and the step), so a dead peer
// ends the run instead of hanging it. What "finished" means is the caller's (a CUDA event's query), and such a call
// may itself block behind the hung work: a second thread, which calls nothing of the caller's, reports the watchdog
// itself when one of its looks has not come back within the limit.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>

namespace ds {

class Watchdog {
 public:
  using Finished = std::function<bool()>;  // polled from the watchdog's thread: whether the work is done
  using Release = std::function<void()>;   // once the work is done, reported or forgotten: frees what Finished reads
  // Work unfinished `limit` after it was given: its name and the seconds since. Called from a watchdog thread,
  // outside the watchdog's lock (it may call watched() or watch()), once per piece of work, which is then released.
  using Overdue = std::function<void(const std::string& what, double waited_s)>;

  // Looks every `every` at the work it holds.
  Watchdog(std::chrono::milliseconds limit, Overdue overdue, std::chrono::milliseconds every = std::chrono::milliseconds(100));
  // Stops its threads; what it still holds is released, never reported.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches `what`, given now by `owner`, until `finished` says it is done.
  void watch(const void* owner, std::string what, Finished finished, Release release = {});
  // Stops watching `owner`'s work (its communicator was aborted, or is gone): released, never reported; a report of
  // its work under way ends first (unless forget is called from that report).
  void forget(const void* owner);
  // How many pieces of work it holds.
  size_t watched() const;
  std::chrono::milliseconds limit() const { return limit_; }

 private:
  struct Work {
    const void* owner;
    std::string what;
    Finished finished;
    Release release;
    std::chrono::steady_clock::time_point since;
  };
  void run();
  // The second thread: reports the first when one of its looks has not come back within the limit.
  void heartbeat();
  static void release(Work& w) {
    if (w.release) w.release();
  }
  static int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch() / std::chrono::nanoseconds(1); }

  const std::chrono::milliseconds limit_, every_;
  const Overdue overdue_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::list<Work> work_;
  std::atomic<bool> stop_{false};
  std::mutex beat_m_;  // the heartbeat's own (m_ may be held by a look that never returns)
  std::condition_variable beat_cv_;
  const void* reporting_ = nullptr;  // the owner whose work is being reported (outside the lock)
  std::thread::id reporter_;         // the thread reporting it
  std::atomic<int64_t> look_began_ns_{0};  // when the look under way began (0: none under way)
  std::thread thread_, monitor_;  // last: started once everything above is
};

}  // namespace ds
