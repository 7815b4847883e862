// The bytes a second this host's memory streams with N threads: each thread copies its slice of a 1 GiB float
// array into another (a read and a write per byte copied), 5 passes after one to fault the pages in; the best
// pass is printed as bytes read + bytes written per second, what ds plan's --host-memory-bw means.
// usage: host_memory_rate THREADS
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kFloats = 1 << 28 };  // 1 GiB of floats each
static float *from, *to;
static int threads;

static void* copy_slice(void* arg) {
  const long t = (long)arg, n = kFloats / threads;
  memcpy(to + t * n, from + t * n, (size_t)n * sizeof(float));
  return NULL;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1 || threads > 256) return 2;
  from = malloc((size_t)kFloats * sizeof(float));
  to = malloc((size_t)kFloats * sizeof(float));
  if (!from || !to) return 1;
  for (long i = 0; i < kFloats; ++i) from[i] = (float)i;
  double best = 0;
  for (int pass = 0; pass < 6; ++pass) {
    pthread_t ids[256];
    const double t0 = now();
    for (long t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, copy_slice, (void*)t);
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    const double rate = 2.0 * kFloats * sizeof(float) / (now() - t0);
    if (pass > 0 && rate > best) best = rate;
  }
  printf("%.0f\n", best);
  return to[kFloats - 1] == (float)(kFloats - 1) ? 0 : 1;
}
