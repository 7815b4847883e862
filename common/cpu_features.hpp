// ds — what this machine's CPU can do, where both the plan and the kernels ask.
#pragma once

namespace ds {

// AVX-512 (F, BW, VL, DQ): ds's vector kernels, and LibTorch 1.13's bf16 products through oneDNN, need all four.
inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
#else
  return false;
#endif
}

}  // namespace ds
