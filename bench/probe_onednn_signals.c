// Does oneDNN's sgemm survive a signal handler running in the middle of it? Debian 12's libdnnl.so.2.6
// does not: with SIGUSR1 every 50 us the heap is corrupted within 0.1 s ("corrupted size vs. prev_size").
// This is why ds takes SIGINT and SIGTERM on a thread of their own (common/stop_signals.hpp). Run it again
// after a oneDNN upgrade; "wrong 0" with signals and no abort means the library is safe.
//   cc -O2 bench/probe_onednn_signals.c -o /tmp/probe /usr/lib/x86_64-linux-gnu/libdnnl.so.2 -lm
//   OMP_NUM_THREADS=1 /tmp/probe            # without signals: prints "wrong 0"
//   OMP_NUM_THREADS=1 /tmp/probe signals    # a child process sends SIGUSR1 every 50 us
#define _GNU_SOURCE
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int dnnl_sgemm(char transa, char transb, long M, long N, long K, float alpha, const float* A, long lda, const float* B,
               long ldb, float beta, float* C, long ldc);

static atomic_long g_signals;
static void count_signal(int sig) {
  (void)sig;
  atomic_fetch_add(&g_signals, 1);
}

int main(int argc, char** argv) {
  signal(SIGUSR1, count_signal);
  const pid_t parent = getpid();
  if (argc > 1 && fork() == 0)
    for (;;) {
      if (kill(parent, SIGUSR1) != 0) _exit(0);  // the parent is gone
      usleep(50);
    }
  srand(1);
  long wrong = 0;
  for (int call = 0; call < 3000; ++call) {
    const long M = 1 + rand() % 300, N = 1 + rand() % 300, K = 1 + rand() % 300;
    const char ta = rand() % 2 ? 'T' : 'N', tb = rand() % 2 ? 'T' : 'N';
    float* A = malloc(sizeof(float) * M * K);
    float* B = malloc(sizeof(float) * K * N);
    float* C = malloc(sizeof(float) * M * N);
    for (long i = 0; i < M * K; ++i) A[i] = (float)((i * 7) % 13) - 6;
    for (long i = 0; i < K * N; ++i) B[i] = (float)((i * 5) % 11) - 5;
    dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, ta == 'N' ? K : M, B, tb == 'N' ? N : K, 0.0f, C, N);  // row-major C = op(A) op(B)
    for (long i = 0; i < M; ++i)
      for (long j = 0; j < N; ++j) {
        double s = 0;
        for (long k = 0; k < K; ++k)
          s += (double)(ta == 'N' ? A[i * K + k] : A[k * M + i]) * (tb == 'N' ? B[k * N + j] : B[j * K + k]);
        if (fabs(C[i * N + j] - s) > 1e-2 * (1 + fabs(s))) {
          ++wrong;
          i = M;
          break;
        }
      }
    free(A);
    free(B);
    free(C);
  }
  printf("signals %ld wrong %ld\n", atomic_load(&g_signals), wrong);
  return 0;
}
