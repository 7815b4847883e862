// ds — entry point. Everything lives in cli/app.cpp so tests can drive it without a process.
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "cli/app.hpp"

namespace {

// Idle worker threads that wait by spinning take CPU from the threads doing the work: the commands
// that compute start with short waits, set before the libraries that read them load (before main),
// so such a command sets them and runs itself again, once. A setting the user made wins.
//  - OpenMP (libgomp) threads that finish their share of a parallel region spin 300,000 rounds before
//    they sleep. Beside another busy process a 6x384 bf16 run fell 2.3-3.2x with that spin, 1.6-1.7x
//    with GOMP_SPINCOUNT=1000, no slower on a quiet machine (bench/RESULTS.md).
//  - OpenBLAS's own worker threads (the pthreads build runs fp32 GEMMs) spin and yield for 2^28
//    cycles after each product, through the OpenMP kernels that run between products; 2^4 makes them
//    sleep at once. GPT-2 6x384 fp32 on 2 cores: 13 of 13 interleaved pairs faster, the median step
//    4-7% shorter; bf16 (oneDNN, not OpenBLAS) no different.
void short_idle_waits(char** argv) {
  const char* command = nullptr;
  for (char** a = argv + 1; *a && !command; ++a)
    if ((*a)[0] != '-') command = *a;
  if (!command || (std::strcmp(command, "train") != 0 && std::strcmp(command, "profile") != 0)) return;
  bool changed = false;
  if (!std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT")) {
    setenv("GOMP_SPINCOUNT", "1000", 1);
    changed = true;
  }
  if (!std::getenv("OPENBLAS_THREAD_TIMEOUT")) {
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
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
  return ds::cli::run_ds(argc, argv);
}
