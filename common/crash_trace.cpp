#include "common/crash_trace.hpp"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <initializer_list>

namespace ds {
namespace {

void write_text(const char* s) {
  const ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)ignored;
}

// Where `pc` is: library, nearest exported symbol, offset (dladdr: not async-signal-safe, but the process
// is dying and this is what makes the report useful).
void write_place(const char* what, void* pc) {
  char line[512];
  Dl_info info{};
  if (pc && dladdr(pc, &info) && info.dli_fname)
    std::snprintf(line, sizeof line, "  %s %p: %s(%s+0x%lx) [+0x%lx in the file]\n", what, pc, info.dli_fname,
                  info.dli_sname ? info.dli_sname : "?",
                  static_cast<unsigned long>(static_cast<char*>(pc) - static_cast<char*>(info.dli_saddr ? info.dli_saddr : info.dli_fbase)),
                  static_cast<unsigned long>(static_cast<char*>(pc) - static_cast<char*>(info.dli_fbase)));
  else
    std::snprintf(line, sizeof line, "  %s %p: in no loaded file\n", what, pc);
  write_text(line);
}

// Reads the top of the interrupted stack, which AddressSanitizer may have poisoned (a sanitizer build's
// redzone): not instrumented.
__attribute__((no_sanitize_address)) void* stack_top(void* const* sp) { return *sp; }

extern "C" void on_crash(int sig, siginfo_t* si, void* context) {
  write_text("\nds: crashed with ");
  write_text(strsignal(sig));
  write_text("; the stack (please include it in a report):\n");
#if defined(__x86_64__)
  // The faulting instruction, and the return address on top of the stack: a call through a bad pointer
  // leaves no frame to unwind, but its caller is there.
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* pc = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  void* const* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
  write_place("instruction", pc);
  if (sp) write_place("return address on the stack", stack_top(sp));
  char line[96];
  std::snprintf(line, sizeof line, "  fault address %p\n", si ? si->si_addr : nullptr);
  write_text(line);
#endif
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);  // die of the same signal: the exit status says what happened
  raise(sig);
}

}  // namespace

void print_stack_on_crash() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
    struct sigaction sa {};
    sa.sa_sigaction = on_crash;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND | SA_NODEFER | SA_SIGINFO;
    sigaction(sig, &sa, nullptr);
  }
}

}  // namespace ds
