#include "common/stop_signals.hpp"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <csignal>
#include <thread>

namespace ds {
namespace {

std::atomic<StopHandler> g_handler{nullptr};
std::atomic<bool> g_taken{false};

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// The default action, from the signals' thread: unblocked here, delivered here, the process ends.
[[noreturn]] void end_as_the_signal_would(int sig) {
  std::signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  raise(sig);
  for (;;) pause();  // not reached: the default action of SIGINT and SIGTERM is to end the process
}

void dispatch_in_signal_context(int sig) {
  if (StopHandler h = g_handler.load()) h(sig);
}

}  // namespace

void take_stop_signals_on_their_own_thread() {
  if (g_taken.exchange(true)) return;
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (StopHandler h = g_handler.load())
        h(sig);
      else
        end_as_the_signal_would(sig);
    }
  }).detach();
}

StopHandler set_stop_handler(StopHandler handler) {
  const StopHandler previous = g_handler.exchange(handler);
  if (!g_taken.load()) {
    std::signal(SIGINT, handler ? dispatch_in_signal_context : SIG_DFL);
    std::signal(SIGTERM, handler ? dispatch_in_signal_context : SIG_DFL);
  }
  return previous;
}

void unblock_stop_signals_in_child() {
  const sigset_t set = stop_set();
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace ds
