#include "kernels/cuda/norm.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/check.hpp"

namespace ds::kernels::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp a row, 256 threads a block
// The weight gradients' chunks of rows are counted as if a block took 256 columns (8 bf16 a thread), whatever path
// runs, so the scratch they need is known before the pointers are.
constexpr int kChunkTileCols = 256;
constexpr int kRowLanes = 8;
constexpr int64_t kGradBlocks = 1024;  // about this many blocks for the weight gradients, whatever the card

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// With `residual` the row normalised is x + residual rounded to T, written to `sum` (a pre-norm block's residual
// add and the norm after it in one pass: the sum read from x and residual, not written then read back).
template <class T, int V, bool kVector>
__global__ void forward_kernel(const T* x, const T* residual, const T* w, const T* b, T* sum, T* y, float* mean, float* rstd, int64_t rows,
                               int64_t C, float eps, bool rms) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const T* xr = x + r * C;
  const T* rr = residual ? residual + r * C : nullptr;
  const auto load_row = [&](int64_t c, float(&v)[V]) {
    load_widened<T, V, kVector>(xr + c, v);
    if (rr) {
      float a[V];
      load_widened<T, V, kVector>(rr + c, a);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = rounded_to<T>(v[k] + a[k]);
    }
  };
  float mu = 0.f;
  if (!rms) {
    float s = 0.f;
    for (int64_t c = lane * V; c < C; c += 32 * V) {
      float v[V];
      load_row(c, v);
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[k];
    }
    mu = warp_sum(s) / static_cast<float>(C);
  }
  float ss = 0.f;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    float v[V];
    load_row(c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += (v[k] - mu) * (v[k] - mu);
  }
  const float rs = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(C) + eps);
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  T* yr = y + r * C;
  T* sr = rr ? sum + r * C : nullptr;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    float v[V], wv[V], bv[V] = {};
    load_row(c, v);
    if (sr) store_narrowed<T, V, kVector>(sr + c, v);  // already T's values: exact
    load_widened<T, V, kVector>(w + c, wv);
    if (b) load_widened<T, V, kVector>(b + c, bv);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = (v[k] - mu) * rs * wv[k] + bv[k];
    store_narrowed<T, V, kVector>(yr + c, v);
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w (RMSNorm: without mean(g)). With `dsum` (the gradient of
// a residual sum the norm read, from its other reader) dx is rounded to T and dsum added, as autograd would add the
// two T gradients, in the same pass.
template <class T, int V, bool kVector>
__global__ void backward_dx_kernel(const T* dy, const T* dsum, const T* x, const T* w, const float* mean, const float* rstd, T* dx,
                                   int64_t rows, int64_t C, bool rms) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const T* xr = x + r * C;
  const T* dyr = dy + r * C;
  const float mu = mean[r], rs = rstd[r];
  // Each pass reads x, dy and w at columns c..c+V-1 (the second from L1/L2: a row is a few KiB).
  const auto load_at = [&](int64_t c, float(&xv)[V], float(&dv)[V], float(&wv)[V]) {
    load_widened<T, V, kVector>(xr + c, xv);
    load_widened<T, V, kVector>(dyr + c, dv);
    load_widened<T, V, kVector>(w + c, wv);
  };
  float sg = 0.f, sgx = 0.f;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    float xv[V], dv[V], wv[V];
    load_at(c, xv, dv, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = dv[k] * wv[k];
      sg += g;
      sgx += g * (xv[k] - mu) * rs;
    }
  }
  const float a = rms ? 0.f : warp_sum(sg) / static_cast<float>(C), bb = warp_sum(sgx) / static_cast<float>(C);
  T* dxr = dx + r * C;
  const T* dsr = dsum ? dsum + r * C : nullptr;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    float xv[V], dv[V], wv[V];
    load_at(c, xv, dv, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) xv[k] = rs * (dv[k] * wv[k] - a - (xv[k] - mu) * rs * bb);
    if (dsr) {
      float other[V];
      load_widened<T, V, kVector>(dsr + c, other);
#pragma unroll
      for (int k = 0; k < V; ++k) xv[k] = __fadd_rn(rounded_to<T>(xv[k]), other[k]);  // never fused into the product above
    }
    store_narrowed<T, V, kVector>(dxr + c, xv);
  }
}

// Each block: 32 V columns over one chunk of rows, V consecutive columns a thread (one 16-byte load where V is a
// Pack's width); each of its 8 row lanes sums every 8th row, then the lanes are added in order. partial_w/partial_b:
// chunks x C. Without x (a projection's bias gradient) only the sums of dy are made: partial_w is not written.
// (Two bytes a thread a row, as this was until session 67, ran GPT-2's 73 launches a step at about 1.1 TB/s.)
template <class T, int V>
__global__ void weight_grads_kernel(const T* dy, const T* x, const float* mean, const float* rstd, float* partial_w, float* partial_b,
                                    int64_t rows, int64_t C, int64_t rows_per_chunk) {
  const bool norm = x != nullptr;
  const int64_t chunk = blockIdx.y, r0 = chunk * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * (32 * V) + static_cast<int64_t>(threadIdx.x) * V;
  const bool inside = c0 < C;  // whole: V > 1 only where C is a multiple of V
  float aw[V] = {}, ab[V] = {};
  if (inside) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      float d[V];
      load_widened<T, V>(dy + r * C + c0, d);
      if (norm) {
        float xv[V];
        load_widened<T, V>(x + r * C + c0, xv);
        const float mu = mean[r], rs = rstd[r];
#pragma unroll
        for (int k = 0; k < V; ++k) aw[k] += d[k] * ((xv[k] - mu) * rs);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) ab[k] += d[k];
    }
  }
  // Column c0 + k of the thread sits at [k][threadIdx.x]: the lanes' writes and the sums' reads meet no bank twice.
  __shared__ float sw[kRowLanes][V][32], sb[kRowLanes][V][32];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sw[threadIdx.y][k][threadIdx.x] = aw[k];
    sb[threadIdx.y][k][threadIdx.x] = ab[k];
  }
  __syncthreads();
  if (threadIdx.y != 0 || !inside) return;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float tw = 0.f, tb = 0.f;
    for (int j = 0; j < kRowLanes; ++j) {
      tw += sw[j][k][threadIdx.x];
      tb += sb[j][k][threadIdx.x];
    }
    if (norm) partial_w[chunk * C + c0 + k] = tw;
    partial_b[chunk * C + c0 + k] = tb;
  }
}

// Each block: 32 columns; its 8 row lanes sum every 8th chunk, then the lanes are added in order (a thread a
// column walking every chunk took 38 us at GPT-2's 169 chunks x 768: latency, not bytes).
// dw and db (either may be null) are added to, in their own type (fp32 for the norms; the bias's type for a projection,
// rounded once).
template <class O>
__global__ void sum_chunks_kernel(const float* partial_w, const float* partial_b, O* dw, O* db, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float tw = 0.f, tb = 0.f;
  if (c < C) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < chunks; k += kRowLanes) {
      if (dw) tw += partial_w[k * C + c];
      tb += partial_b[k * C + c];
    }
  }
  __shared__ float sw[kRowLanes][32], sb[kRowLanes][32];
  sw[threadIdx.y][threadIdx.x] = tw;
  sb[threadIdx.y][threadIdx.x] = tb;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  tw = 0.f;
  tb = 0.f;
  for (int j = 0; j < kRowLanes; ++j) {
    tw += sw[j][threadIdx.x];
    tb += sb[j][threadIdx.x];
  }
  if (dw) narrow_into(dw[c], widen(dw[c]) + tw);
  if (db) narrow_into(db[c], widen(db[c]) + tb);
}

// The weight gradients' chunks of rows: about kGradBlocks blocks in all, at least 64 rows a chunk.
int64_t rows_per_chunk(const NormShape& s) {
  const int64_t tiles = (s.cols + kChunkTileCols - 1) / kChunkTileCols;
  const int64_t chunks = std::max<int64_t>(1, std::min((s.rows + 63) / 64, kGradBlocks / tiles));
  return std::max<int64_t>(1, (s.rows + chunks - 1) / chunks);
}

int64_t chunk_count(const NormShape& s) {
  const int64_t per = rows_per_chunk(s);
  return s.rows == 0 ? 0 : (s.rows + per - 1) / per;
}

void check_shape(const NormShape& s, const char* what) {
  if (s.rows < 0 || s.cols <= 0 || (s.rows + kRowsPerBlock - 1) / kRowsPerBlock > 0x7fffffff)
    throw std::runtime_error(std::string(what) + ": bad shape (rows " + std::to_string(s.rows) + ", cols " + std::to_string(s.cols) + ")");
}

bool aligned16(const void* p) { return p == nullptr || aligned_to(p, 16); }

unsigned row_blocks(const NormShape& s) { return static_cast<unsigned>((s.rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// The column sums' partials (of dy x-hat into partial_w and of dy into partial_b; without x, of dy alone), 16 bytes
// a load where the columns and both pointers allow.
template <class T>
void launch_weight_grads(const T* dy, const T* x, const float* mean, const float* rstd, float* partial_w, float* partial_b,
                         const NormShape& s, cudaStream_t st) {
  constexpr int kN = Pack<T>::kN;
  const int64_t per = rows_per_chunk(s);
  const unsigned chunks = static_cast<unsigned>(chunk_count(s));
  if (s.cols % kN == 0 && aligned16(dy) && aligned16(x)) {
    const dim3 grid(static_cast<unsigned>((s.cols + 32 * kN - 1) / (32 * kN)), chunks);
    weight_grads_kernel<T, kN><<<grid, dim3(32, kRowLanes), 0, st>>>(dy, x, mean, rstd, partial_w, partial_b, s.rows, s.cols, per);
  } else {
    const dim3 grid(static_cast<unsigned>((s.cols + 31) / 32), chunks);
    weight_grads_kernel<T, 1><<<grid, dim3(32, kRowLanes), 0, st>>>(dy, x, mean, rstd, partial_w, partial_b, s.rows, s.cols, per);
  }
}

template <class T>
void forward(const T* x, const T* residual, const T* w, const T* b, T* sum, T* y, float* mean, float* rstd, const NormShape& s,
             void* stream) {
  check_shape(s, "norm forward");
  if (s.rows == 0) return;
  if ((residual == nullptr) != (sum == nullptr)) throw std::runtime_error("norm forward: a residual and its sum go together");
  auto* st = static_cast<cudaStream_t>(stream);
  constexpr int kN = Pack<T>::kN;
  // The lanes take a row's elements by the width alone (a Pack's where it divides the row), the pointers deciding
  // only how they are loaded: a row sums in one order wherever its tensors lie, so the residual form equals the add
  // then the norm even where x or the residual starts off the 16-byte boundary and the add's fresh sum does not.
  const bool vector = aligned16(x) && aligned16(residual) && aligned16(w) && aligned16(b) && aligned16(sum) && aligned16(y);
  const unsigned blocks = row_blocks(s), threads = 32 * kRowsPerBlock;
  if (s.cols % kN != 0)
    forward_kernel<T, 1, true><<<blocks, threads, 0, st>>>(x, residual, w, b, sum, y, mean, rstd, s.rows, s.cols, s.eps, s.rms);
  else if (vector)
    forward_kernel<T, kN, true><<<blocks, threads, 0, st>>>(x, residual, w, b, sum, y, mean, rstd, s.rows, s.cols, s.eps, s.rms);
  else
    forward_kernel<T, kN, false><<<blocks, threads, 0, st>>>(x, residual, w, b, sum, y, mean, rstd, s.rows, s.cols, s.eps, s.rms);
  ds::cuda::check(cudaGetLastError(), "norm forward launch");
}

template <class T>
void backward(const T* dy, const T* dsum, const T* x, const T* w, const float* mean, const float* rstd, T* dx, float* dw, float* db,
              float* scratch, const NormShape& s, void* stream) {
  check_shape(s, "norm backward");
  if (s.rows == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  constexpr int kN = Pack<T>::kN;
  const bool vector = aligned16(dy) && aligned16(dsum) && aligned16(x) && aligned16(w) && aligned16(dx);  // (as the forward's)
  const unsigned blocks = row_blocks(s), threads = 32 * kRowsPerBlock;
  if (s.cols % kN != 0)
    backward_dx_kernel<T, 1, true><<<blocks, threads, 0, st>>>(dy, dsum, x, w, mean, rstd, dx, s.rows, s.cols, s.rms);
  else if (vector)
    backward_dx_kernel<T, kN, true><<<blocks, threads, 0, st>>>(dy, dsum, x, w, mean, rstd, dx, s.rows, s.cols, s.rms);
  else
    backward_dx_kernel<T, kN, false><<<blocks, threads, 0, st>>>(dy, dsum, x, w, mean, rstd, dx, s.rows, s.cols, s.rms);
  ds::cuda::check(cudaGetLastError(), "norm backward (dx) launch");
  const int64_t chunks = chunk_count(s);
  float* partial_w = scratch;
  float* partial_b = scratch + chunks * s.cols;
  launch_weight_grads(dy, x, mean, rstd, partial_w, partial_b, s, st);
  ds::cuda::check(cudaGetLastError(), "norm backward (weight gradients) launch");
  sum_chunks_kernel<float><<<static_cast<unsigned>((s.cols + 31) / 32), dim3(32, kRowLanes), 0, st>>>(partial_w, partial_b, dw, db,
                                                                                                     chunks, s.cols);
  ds::cuda::check(cudaGetLastError(), "norm backward (chunk sums) launch");
}

template <class T>
void column_sums_add(const T* x, int64_t rows, int64_t cols, T* out, float* scratch, void* stream) {
  const NormShape s{rows, cols, 0.f, true};
  check_shape(s, "column sums");
  if (rows == 0) return;
  auto* st = static_cast<cudaStream_t>(stream);
  const int64_t chunks = chunk_count(s);
  launch_weight_grads<T>(x, nullptr, nullptr, nullptr, nullptr, scratch, s, st);
  ds::cuda::check(cudaGetLastError(), "column sums launch");
  sum_chunks_kernel<T><<<static_cast<unsigned>((cols + 31) / 32), dim3(32, kRowLanes), 0, st>>>(nullptr, scratch, nullptr, out, chunks,
                                                                                               cols);
  ds::cuda::check(cudaGetLastError(), "column sums (chunk sums) launch");
}

}  // namespace

void norm_forward_f32(const float* x, const float* residual, const float* w, const float* b, float* sum, float* y, float* mean, float* rstd,
                      const NormShape& s, void* stream) {
  forward(x, residual, w, b, sum, y, mean, rstd, s, stream);
}
void norm_forward_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, const uint16_t* b, uint16_t* sum, uint16_t* y,
                       float* mean, float* rstd, const NormShape& s, void* stream) {
  forward(x, residual, w, b, sum, y, mean, rstd, s, stream);
}

void norm_forward_fp16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, const uint16_t* b, uint16_t* sum, uint16_t* y,
                       float* mean, float* rstd, const NormShape& s, void* stream) {
  const auto half = [](auto* p) { return p ? as_half(p) : nullptr; };
  forward(as_half(x), half(residual), as_half(w), half(b), half(sum), as_half(y), mean, rstd, s, stream);
}

int64_t norm_backward_scratch_floats(const NormShape& s) { return 2 * chunk_count(s) * s.cols; }

int64_t column_sums_scratch_floats(int64_t rows, int64_t cols) { return chunk_count(NormShape{rows, cols, 0.f, true}) * cols; }
void column_sums_add_f32(const float* x, int64_t rows, int64_t cols, float* out, float* scratch, void* stream) {
  column_sums_add(x, rows, cols, out, scratch, stream);
}
void column_sums_add_bf16(const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out, float* scratch, void* stream) {
  column_sums_add(x, rows, cols, out, scratch, stream);
}

void column_sums_add_fp16(const uint16_t* x, int64_t rows, int64_t cols, uint16_t* out, float* scratch, void* stream) {
  column_sums_add(as_half(x), rows, cols, as_half(out), scratch, stream);
}

void norm_backward_f32(const float* dy, const float* dsum, const float* x, const float* w, const float* mean, const float* rstd, float* dx,
                       float* dw, float* db, float* scratch, const NormShape& s, void* stream) {
  backward(dy, dsum, x, w, mean, rstd, dx, dw, db, scratch, s, stream);
}
void norm_backward_bf16(const uint16_t* dy, const uint16_t* dsum, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, float* scratch, const NormShape& s, void* stream) {
  backward(dy, dsum, x, w, mean, rstd, dx, dw, db, scratch, s, stream);
}
void norm_backward_fp16(const uint16_t* dy, const uint16_t* dsum, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, float* scratch, const NormShape& s, void* stream) {
  backward(as_half(dy), dsum ? as_half(dsum) : nullptr, as_half(x), as_half(w), mean, rstd, as_half(dx), dw, db, scratch, s, stream);
}

}  // namespace ds::kernels::cuda
