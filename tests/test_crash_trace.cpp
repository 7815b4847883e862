// A crash prints where it happened before the process dies of its signal (common/crash_trace.hpp): the
// faulting instruction, the caller's return address named by library and symbol (a call through a null
// pointer leaves no frame to unwind: this is how the GPU machine's libstdc++ crash was found), and the
// stack. In a child process (EXPECT_EXIT): the handlers are the whole process's.
#include <gtest/gtest.h>

#include <signal.h>

#include "common/crash_trace.hpp"

namespace {

// Not inlined: the return address on the stack is in this test's binary. Clang's UBSan would check the
// callee's type by reading bytes before it (a fault inside this function): the call itself is the test.
#if defined(__clang__)
__attribute__((no_sanitize("function")))
#endif
__attribute__((noinline)) void call_through(void (*volatile f)()) { f(); }

}  // namespace

TEST(CrashTrace, ACallThroughANullPointerNamesItsCallerAndDiesOfTheSignal) {
  EXPECT_EXIT(
      {
        ds::print_stack_on_crash();
        call_through(nullptr);
      },
      ::testing::KilledBySignal(SIGSEGV), "return address on the stack 0x[0-9a-f]+: .*ds_tests");
  EXPECT_EXIT(
      {
        ds::print_stack_on_crash();
        call_through(nullptr);
      },
      ::testing::KilledBySignal(SIGSEGV), "ds: crashed with Segmentation fault; the stack");
}

TEST(CrashTrace, AnAbortIsReportedToo) {
  EXPECT_EXIT(
      {
        ds::print_stack_on_crash();
        abort();
      },
      ::testing::KilledBySignal(SIGABRT), "ds: crashed with Aborted");
}
