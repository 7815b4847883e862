// bench_fma — the peak of one core's multiply-adds: AVX-512 fp32 FMA (vfmadd231ps, 32 FLOP each)
// against AVX512-BF16's pair dot product (vdpbf16ps, 64 FLOP each), 12 independent accumulators, no
// memory traffic. It decides how a bf16 kernel should multiply on this CPU: on the Xeon of session 14
// (AMX) vdpbf16ps ran at half the fp32 FMA rate, so bf16 tiles there need AMX, not AVX512-BF16.
//
// Usage: bench_fma [seconds per measurement, default 1]   (one thread; run it beside nothing else)
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kAcc = 12;  // enough independent chains to cover the latency of two pipes

__attribute__((target("avx512f"), noinline)) float fma_loop(long n) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_set1_ps(1.0001f);
  const __m512 b = _mm512_set1_ps(0.9999f);
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx512f,avx512bf16"), noinline)) float dpbf16_loop(long n) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f81);
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

// GFLOP/s of `loop` over about `seconds`, its iterations doing `flops` each.
template <class F>
double rate(F loop, double flops, double seconds) {
  long n = 1 << 20;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = loop(n);
    (void)sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= seconds) return n * flops / s / 1e9;
    n *= 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  std::printf("bench_fma: one thread, %.1f s per figure; command:", seconds);
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n");
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("no AVX-512 on this CPU\n");
    return 0;
  }
  for (int round = 0; round < 2; ++round) {  // interleaved, twice
    const double fma = rate(fma_loop, kAcc * 32.0, seconds);
    std::printf("round %d: fp32 FMA (vfmadd231ps)      %7.1f GFLOP/s\n", round + 1, fma);
    if (__builtin_cpu_supports("avx512bf16")) {
      const double bf16 = rate(dpbf16_loop, kAcc * 64.0, seconds);
      std::printf("round %d: bf16 pairs (vdpbf16ps)      %7.1f GFLOP/s  (%.2fx the fp32 FMA)\n", round + 1, bf16, bf16 / fma);
    } else
      std::printf("round %d: no AVX512-BF16 on this CPU\n", round + 1);
  }
}
