// ds — a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints the stack it happened on before the
// process dies as it would have: a user's report, or a GPU machine's log, then says where, not just
// "Segmentation fault". First the faulting instruction and the return address on top of the stack, each
// named by library and nearest exported symbol (a call through a bad pointer leaves no frame to unwind,
// but its caller is there), then backtrace_symbols_fd's frames: binary or library, symbol when it is
// exported, offset (addr2line -e BINARY OFFSET names the line).
#pragma once

namespace ds {

// Once, early in main. The default action follows the trace (the exit status stays the signal's).
void print_stack_on_crash();

}  // namespace ds
