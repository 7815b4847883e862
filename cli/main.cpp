// ds — entry point. Everything lives in cli/app.cpp so tests can drive it without a process.
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "cli/app.hpp"

namespace {

// OpenMP threads that finish their share of a parallel region spin (libgomp: 300,000 rounds) before
// they sleep. When another process competes for the cores, that spinning takes CPU from the thread
// every region waits for: a 6x384 bf16 run beside one `yes` fell 2.3-3.2x, and 1.6-1.7x with a short
// spin, no slower on a quiet machine (bench/RESULTS.md). libgomp reads its policy when it is loaded,
// before main, so the commands that compute set it and run themselves again, once. OMP_WAIT_POLICY
// or GOMP_SPINCOUNT set by the user win.
void short_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  const char* command = nullptr;
  for (char** a = argv + 1; *a && !command; ++a)
    if ((*a)[0] != '-') command = *a;
  if (!command || (std::strcmp(command, "train") != 0 && std::strcmp(command, "profile") != 0)) return;
  // The binary's own path, not /proc/self/exe: the process keeps its name (ps, pgrep, pkill ds).
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  setenv("GOMP_SPINCOUNT", "1000", 1);
  execv(self, argv);  // returns only on failure: then run as we are
}

}  // namespace

int main(int argc, char** argv) {
  short_openmp_spin(argv);
  return ds::cli::run_ds(argc, argv);
}
