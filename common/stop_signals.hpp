// ds — SIGINT and SIGTERM taken by a thread of their own, never by a thread that computes.
//
// Why: a signal handler runs on whichever thread the kernel picks, in the middle of what that thread was
// doing. oneDNN 2.6's sgemm (Debian 12's libdnnl, which ds's fp32 products use) corrupts the heap when a
// handler runs during it: a standalone loop of sgemm calls with a signal every 50 us aborts ("corrupted
// size vs. prev_size") within 0.1 s, and Ctrl-C killed about one `ds train` run in four at 1 thread
// before this. So ds blocks both signals in every thread (the mask is inherited by the threads created
// after, hence first thing in main) and one thread waits for them with sigwait.
#pragma once

namespace ds {

// Blocks SIGINT and SIGTERM in this thread (and so in every thread it starts from now on) and starts the
// thread that waits for them. Call once, first thing in main, before any other thread exists.
void take_stop_signals_on_their_own_thread();

// What SIGINT and SIGTERM do from now on: `handler(signal)`, or, for nullptr, the default: the process
// ends as the signal would have ended it. Returns the previous handler. Where the signals were not taken
// (a test that calls the trainer in its own process) the handler runs as an ordinary signal handler, so
// it must be async-signal-safe: set a flag, kill(), close().
using StopHandler = void (*)(int signal);
StopHandler set_stop_handler(StopHandler handler);

// Between fork and exec: the program the child becomes gets the signals unblocked, as usual.
void unblock_stop_signals_in_child();

}  // namespace ds
