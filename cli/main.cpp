// ds — entry point. Everything lives in cli/app.cpp so tests can drive it without a process.
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "cli/app.hpp"
#include "common/crash_trace.hpp"
#include "common/idle_waits.hpp"
#include "common/stop_signals.hpp"

namespace {

// Idle worker threads that wait by spinning take CPU from the threads doing the work, so the commands
// that compute start with short waits (common/idle_waits.hpp says which, and why). The libraries read
// them when they load, before main: such a command sets them and runs itself again, once. A setting
// the user made wins.
void short_idle_waits(char** argv) {
  const char* command = nullptr;
  for (char** a = argv + 1; *a && !command; ++a)
    if ((*a)[0] != '-') command = *a;
  if (!command || (std::strcmp(command, "train") != 0 && std::strcmp(command, "profile") != 0)) return;
  bool changed = false;
  for (const ds::IdleWait& w : ds::kIdleWaits) {
    if (std::getenv(w.variable) || (w.user_choice && std::getenv(w.user_choice))) continue;
    setenv(w.variable, w.value, 1);
    changed = true;
  }
  if (!changed) return;
  // The binary's own path, not /proc/self/exe: the process keeps its name (ps, pgrep, pkill ds).
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  execv(self, argv);  // returns only on failure: then run as we are
}

}  // namespace

int main(int argc, char** argv) {
  short_idle_waits(argv);
  ds::print_stack_on_crash();
  ds::take_stop_signals_on_their_own_thread();  // before any other thread exists (common/stop_signals.hpp)
  return ds::cli::run_ds(argc, argv);
}
