// Ctrl-C and SIGTERM are taken by a thread of their own (common/stop_signals.hpp): never by the thread
// that computes (oneDNN's sgemm corrupts the heap when a handler runs in it), the default action kept
// while no handler is set, and children started with the signals unblocked. Each test runs in a child
// process (EXPECT_EXIT): the signal mask and the signals' thread are the whole process's.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "common/stop_signals.hpp"

using namespace ds;

namespace {

std::atomic<pid_t> g_taken_on{0};
std::atomic<int> g_taken_signal{0};
void note_signal(int sig) {
  g_taken_signal = sig;
  g_taken_on = gettid();
}

// Busy (as a thread in a GEMM would be) until the handler has run, at most 5 s.
bool compute_until_taken() {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  volatile double x = 1;
  while (!g_taken_on.load() && std::chrono::steady_clock::now() < until) x = x * 1.0000001 + 1e-9;
  return g_taken_on.load() != 0;
}

}  // namespace

TEST(StopSignalsDeathTest, AreTakenByTheirOwnThreadNotByTheOneThatComputes) {
  EXPECT_EXIT(
      {
        take_stop_signals_on_their_own_thread();
        set_stop_handler(note_signal);
        const pid_t me = gettid();
        for (int sig : {SIGINT, SIGTERM}) {
          g_taken_on = 0;
          kill(getpid(), sig);  // to the process, as Ctrl-C, kill or a parent's death signal send it
          if (!compute_until_taken()) std::_Exit(2);
          if (g_taken_on.load() == me || g_taken_signal.load() != sig) std::_Exit(3);
        }
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "");
}

TEST(StopSignalsDeathTest, WithNoHandlerTheProcessEndsAsTheSignalWouldEndIt) {
  EXPECT_EXIT(
      {
        take_stop_signals_on_their_own_thread();
        set_stop_handler(note_signal);
        set_stop_handler(nullptr);  // a run ended: back to the default
        kill(getpid(), SIGTERM);
        std::this_thread::sleep_for(std::chrono::seconds(5));
        std::_Exit(0);
      },
      testing::KilledBySignal(SIGTERM), "");
}

TEST(StopSignalsDeathTest, AChildStartsWithTheSignalsUnblocked) {
  // Without the unblock, `sleep` would inherit the blocked mask and sleep through SIGINT.
  EXPECT_EXIT(
      {
        take_stop_signals_on_their_own_thread();
        const pid_t child = fork();
        if (child == 0) {
          unblock_stop_signals_in_child();
          execlp("sleep", "sleep", "10", static_cast<char*>(nullptr));
          _exit(127);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        kill(child, SIGINT);
        const auto t0 = std::chrono::steady_clock::now();
        int status = 0;
        waitpid(child, &status, 0);
        const bool quick = std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5);
        std::_Exit(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT && quick ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}
