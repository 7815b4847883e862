#include "engine/runtime/comm/watchdog.hpp"

#include <utility>

namespace ds {

Watchdog::Watchdog(std::chrono::milliseconds limit, Overdue overdue, std::chrono::milliseconds every)
    : limit_(limit), every_(every), overdue_(std::move(overdue)), thread_([this] { run(); }), monitor_([this] { heartbeat(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(m_);
    std::lock_guard<std::mutex> beat(beat_m_);
    stop_ = true;
  }
  cv_.notify_all();
  beat_cv_.notify_all();
  thread_.join();
  monitor_.join();
  for (Work& w : work_) release(w);
}

void Watchdog::watch(const void* owner, std::string what, Finished finished, Release release) {
  std::lock_guard<std::mutex> lock(m_);
  work_.push_back({owner, std::move(what), std::move(finished), std::move(release), std::chrono::steady_clock::now()});
}

void Watchdog::forget(const void* owner) {
  std::unique_lock<std::mutex> lock(m_);
  if (reporter_ != std::this_thread::get_id()) cv_.wait(lock, [&] { return reporting_ != owner; });
  for (auto it = work_.begin(); it != work_.end();) {
    if (it->owner != owner) {
      ++it;
      continue;
    }
    release(*it);
    it = work_.erase(it);
  }
}

size_t Watchdog::watched() const {
  std::lock_guard<std::mutex> lock(m_);
  return work_.size();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(m_);
  while (!cv_.wait_for(lock, every_, [this] { return stop_.load(); })) {
    look_began_ns_ = now_ns();
    const auto now = std::chrono::steady_clock::now();
    for (auto it = work_.begin(); it != work_.end();) {
      if (it->finished()) {  // first: work done is never reported, however late the look
        release(*it);
        it = work_.erase(it);
        continue;
      }
      if (now - it->since <= limit_) {
        ++it;
        continue;
      }
      Work late = std::move(*it);
      work_.erase(it);
      reporting_ = late.owner;
      reporter_ = std::this_thread::get_id();
      look_began_ns_ = 0;  // (a report may take its time)
      lock.unlock();
      overdue_(late.what, std::chrono::duration<double>(now - late.since).count());
      release(late);
      lock.lock();
      reporting_ = nullptr;
      reporter_ = std::thread::id();
      cv_.notify_all();  // a forget() waiting for this report
      if (stop_) break;
      look_began_ns_ = now_ns();
      it = work_.begin();  // the list may have changed meanwhile
    }
    look_began_ns_ = 0;
  }
}

void Watchdog::heartbeat() {
  std::unique_lock<std::mutex> lock(beat_m_);  // never m_, which a look that never returns holds
  while (!beat_cv_.wait_for(lock, every_, [this] { return stop_.load(); })) {
    const int64_t began = look_began_ns_;
    if (began == 0 || now_ns() - began <= std::chrono::nanoseconds(limit_).count()) continue;
    lock.unlock();
    overdue_("the watchdog's own look at its work (a call it made to see whether work finished has not returned)",
             static_cast<double>(now_ns() - began) * 1e-9);
    return;  // once
  }
}

}  // namespace ds
