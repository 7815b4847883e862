#include "kernels/cuda/cross_entropy.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // one block per row; a row of 50k bf16 logits is about 25 loads a thread
constexpr int kGroup = 4;      // packs a thread loads before it uses the first
// Two passes: five blocks an SM, as before the grouped loads (48 registers a thread then; 56 without this bound
// left four, and a GPT-2 chunk's 640 rows no longer fit an H200's 132 SMs at once). sm_90 fits it unspilled.
constexpr int kTwoPassBlocksPerSm = 5;
// With the row in shared memory an SM holds two blocks at most: twice as many threads a block keep twice as many
// loads in flight (at 256, 16 warps an SM, the H200 ran GPT-2's chunks at 92 us against two passes' 77).
constexpr int kCachedThreads = 512;
// Rows up to this size stay in shared memory between the passes: two blocks an SM of an H100/H200 (228 KiB).
// Less where the card grants a block less (cached_row_limit).
constexpr size_t kMaxCachedRowBytes = 112 * 1024;

// What `automatic` runs: two passes over the row in device memory, the faster on the H200 (session 66: the row
// kept in shared memory at 256 threads a block ran GPT-2's chunks at 92 us, two passes at 77); the row in shared
// memory at kCachedThreads waits for bench_cuda_optimizers to measure it.
constexpr CrossEntropyPath kAutomatic = CrossEntropyPath::two_pass;

// The forward declaration the limit below asks about. With the row in shared memory two blocks an SM is the most
// there can be: their registers must fit beside each other too.
template <class T, bool kCached, int kBlock>
__global__ void __launch_bounds__(kBlock, kCached ? 2 : kTwoPassBlocksPerSm)
    cross_entropy_kernel(T* logits, const int64_t* targets, int64_t vocab, int64_t row_stride, float grad_scale, bool write_grad,
                         float* row_loss);

// The largest row kept in shared memory on the current GPU: kMaxCachedRowBytes, or what a block may opt in to
// there less the kernel's own static shared memory (the block merge's) where that is less (96 KiB on a V100,
// 99 KiB on sm_86/89, 64 KiB on a T4). Asked once per element type (one GPU a process).
template <class T>
size_t cached_row_limit() {
  static const size_t limit = [] {
    int device = 0, optin = 0;
    ds::cuda::check(cudaGetDevice(&device), "softmax_cross_entropy: the current device");
    ds::cuda::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                    "softmax_cross_entropy: the shared memory a block may use");
    cudaFuncAttributes kernel{};
    ds::cuda::check(cudaFuncGetAttributes(&kernel, cross_entropy_kernel<T, true, kCachedThreads>),
                    "softmax_cross_entropy: the kernel's attributes");
    const size_t free = static_cast<size_t>(optin) > kernel.sharedSizeBytes ? static_cast<size_t>(optin) - kernel.sharedSizeBytes : 0;
    return std::min(kMaxCachedRowBytes, free / 16 * 16);
  }();
  return limit;
}

// A running maximum and the sum of exp(z - max) over what was seen: the online softmax's state.
struct MaxSum {
  float m = -INFINITY, s = 0.f;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);  // fmaxf passes a NaN over: the sums carry it
  MaxSum r;
  r.m = m;
  if (a.s != a.s || b.s != b.s) {  // a NaN seen anywhere stays, also before any finite value
    r.s = NAN;
    return r;
  }
  if (m == -INFINITY) return a;  // neither has seen a finite value
  r.s = (a.s == 0.f ? 0.f : a.s * expf(a.m - m)) + (b.s == 0.f ? 0.f : b.s * expf(b.m - m));
  return r;
}

// The block's state, merged over every thread; every thread gets it.
template <int kBlock>
__device__ MaxSum block_merge(MaxSum v) {
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other;
    other.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    v = merge(v, other);
  }
  __shared__ float wm[kBlock / 32], ws[kBlock / 32], total_m, total_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    wm[warp] = v.m;
    ws[warp] = v.s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum t;
    for (int w = 0; w < kBlock / 32; ++w) {
      MaxSum x;
      x.m = wm[w];
      x.s = ws[w];
      t = merge(t, x);
    }
    total_m = t.m;
    total_s = t.s;
  }
  __syncthreads();
  MaxSum total;
  total.m = total_m;
  total.s = total_s;
  return total;
}

// kCached: the row is kept in shared memory between the two passes (it fits: GPT-2's 50,257 bf16 logits are
// 98 KiB), so the logits are read from device memory once, not twice. Each thread reads back what it stored.
template <class T, bool kCached, int kBlock>
__global__ void __launch_bounds__(kBlock, kCached ? 2 : kTwoPassBlocksPerSm)
    cross_entropy_kernel(T* logits, const int64_t* targets, int64_t vocab, int64_t row_stride, float grad_scale, bool write_grad,
                         float* row_loss) {
  constexpr int kN = Pack<T>::kN;
  extern __shared__ __align__(16) unsigned char shared_row[];
  T* row = logits + static_cast<int64_t>(blockIdx.x) * row_stride;
  T* cache = kCached ? reinterpret_cast<T*>(shared_row) : row;
  const bool packed = aligned_to(row, 16);
  const int64_t n_packs = packed ? vocab / kN : 0;
  const auto* packs = reinterpret_cast<Pack<T>*>(row);
  auto* cache_packs = reinterpret_cast<Pack<T>*>(cache);
  // One pack's max and sum of exp(z - max), merged into the thread's state (in the order of i, grouped or not).
  MaxSum st;
  const auto take = [&](const Pack<T>& p) {
    float z[kN];
    MaxSum local;
    local.m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      z[k] = widen(p.v[k]);
      local.m = fmaxf(local.m, z[k]);
    }
    if (local.m != -INFINITY) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < kN; ++k) s += expf(z[k] - local.m);
      local.s = s;
    } else {
      local.s = 0.f;
    }
    for (int k = 0; k < kN; ++k)
      if (z[k] != z[k]) local.s = NAN;
    st = merge(st, local);
  };
  // kGroup packs loaded before any is used: with one block a row, the rows of a chunk fill about 60% of an H200's
  // threads, and one load in flight a thread left the first pass waiting on memory.
  int64_t i = threadIdx.x;
  for (; i + (kGroup - 1) * kBlock < n_packs; i += kGroup * kBlock) {
    Pack<T> p[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) p[g] = packs[i + g * kBlock];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if constexpr (kCached) cache_packs[i + g * kBlock] = p[g];
      take(p[g]);
    }
  }
  for (; i < n_packs; i += kBlock) {
    const Pack<T> p = packs[i];
    if constexpr (kCached) cache_packs[i] = p;
    take(p);
  }
  for (int64_t j = n_packs * kN + threadIdx.x; j < vocab; j += kBlock) {
    if constexpr (kCached) cache[j] = row[j];
    MaxSum one;
    one.m = widen(row[j]);
    one.s = one.m != one.m ? NAN : 1.f;
    if (one.m == -INFINITY) one.s = 0.f;
    st = merge(st, one);
  }
  const MaxSum all = block_merge<kBlock>(st);
  const float lse = all.m + logf(all.s);
  const int64_t t = targets[blockIdx.x];
  const bool valid = t >= 0 && t < vocab;  // checked by the caller; a bad one makes the loss NaN, never a stray read
  // log(s) + (m - z_t): the two large terms cancel before the sum's logarithm is added, not after.
  if (threadIdx.x == 0) row_loss[blockIdx.x] = valid ? logf(all.s) + (all.m - widen(row[t])) : NAN;
  if (!write_grad) return;
  __syncthreads();  // z_t is read before it is overwritten
  auto grad = [&](float z, int64_t j) { return (expf(z - lse) - (j == t ? 1.f : 0.f)) * grad_scale; };
  auto* wpacks = reinterpret_cast<Pack<T>*>(row);
  const auto write = [&](Pack<T> p, int64_t at) {
#pragma unroll
    for (int k = 0; k < kN; ++k) narrow_into(p.v[k], grad(widen(p.v[k]), at * kN + k));
    wpacks[at] = p;
  };
  i = threadIdx.x;
  for (; i + (kGroup - 1) * kBlock < n_packs; i += kGroup * kBlock) {
    Pack<T> p[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) p[g] = cache_packs[i + g * kBlock];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) write(p[g], i + g * kBlock);
  }
  for (; i < n_packs; i += kBlock) write(cache_packs[i], i);
  for (int64_t j = n_packs * kN + threadIdx.x; j < vocab; j += kBlock) narrow_into(row[j], grad(widen(cache[j]), j));
}

template <class T>
void launch(CrossEntropyPath path, T* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
            float grad_scale, bool write_grad, float* row_loss, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || row_stride < vocab || rows > 0x7fffffff)
    throw std::runtime_error("softmax_cross_entropy: bad shape (rows " + std::to_string(rows) + ", vocab " + std::to_string(vocab) +
                             ", row stride " + std::to_string(row_stride) + ")");
  auto* st = static_cast<cudaStream_t>(stream);
  const size_t row_bytes = (static_cast<size_t>(vocab) * sizeof(T) + 15) / 16 * 16;
  if (path == CrossEntropyPath::row_in_shared && write_grad && row_bytes <= cached_row_limit<T>()) {
    static bool opted_in = false;  // per T: shared memory past 48 KiB is granted on request
    if (!opted_in) {
      ds::cuda::check(cudaFuncSetAttribute(cross_entropy_kernel<T, true, kCachedThreads>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(cached_row_limit<T>())),
                      "softmax_cross_entropy: shared memory");
      opted_in = true;
    }
    cross_entropy_kernel<T, true, kCachedThreads><<<static_cast<unsigned>(rows), kCachedThreads, row_bytes, st>>>(
        logits, targets, vocab, row_stride, grad_scale, write_grad, row_loss);
  } else {
    cross_entropy_kernel<T, false, kThreads><<<static_cast<unsigned>(rows), kThreads, 0, st>>>(logits, targets, vocab, row_stride,
                                                                                                grad_scale, write_grad, row_loss);
  }
  ds::cuda::check(cudaGetLastError(), "softmax_cross_entropy launch");
}

}  // namespace

void softmax_cross_entropy_f32(float* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                               float grad_scale, bool write_grad, float* row_loss, void* stream) {
  launch(kAutomatic, logits, targets, rows, vocab, row_stride, grad_scale, write_grad, row_loss, stream);
}

void softmax_cross_entropy_bf16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                float grad_scale, bool write_grad, float* row_loss, void* stream) {
  launch(kAutomatic, logits, targets, rows, vocab, row_stride, grad_scale, write_grad, row_loss, stream);
}

void softmax_cross_entropy_fp16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                float grad_scale, bool write_grad, float* row_loss, void* stream) {
  launch(kAutomatic, as_half(logits), targets, rows, vocab, row_stride, grad_scale, write_grad, row_loss, stream);
}

void softmax_cross_entropy_bf16_by(CrossEntropyPath path, uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                   int64_t row_stride, float grad_scale, bool write_grad, float* row_loss, void* stream) {
  launch(path == CrossEntropyPath::automatic ? kAutomatic : path, logits, targets, rows, vocab, row_stride, grad_scale, write_grad,
         row_loss, stream);
}

}  // namespace ds::kernels::cuda
