#include "kernels/cpu/attention_tiles.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

constexpr int64_t kTile = kAttentionTile;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

int64_t group_of(const AttentionShape& s, int64_t b, int64_t kv, int64_t g) { return ((b * s.NKV + kv) * s.G + g) * s.T; }

#if defined(__x86_64__)
// C[r, 0..n) (+)= sum_k A(r, k) B[k, 0..n) for R rows and n <= 16 NV columns, with
// A(r, k) = a[r * ars + k * aks] (a row-major tile, or a transposed one: ars = 1), B row-major. The
// R x NV accumulators stay in registers over the whole k loop; lanes past n are masked by `last`.
template <int R, int NV>
DS_AVX512 void micro(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t K, float* c,
                     int64_t ldc, __mmask16 last, bool add) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = add ? _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, b + k * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * ars + k * aks]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v == NV - 1 ? last : 0xffff, acc[r][v]);
}

using Micro = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, __mmask16, bool);

constexpr int kRows = 6;  // rows per micro tile: 6 x 4 vectors = 24 accumulators of the 32 registers
#define DS_MICRO_ROW(R) {micro<R, 1>, micro<R, 2>, micro<R, 3>, micro<R, 4>}
constexpr Micro kMicro[kRows][4] = {DS_MICRO_ROW(1), DS_MICRO_ROW(2), DS_MICRO_ROW(3), DS_MICRO_ROW(4), DS_MICRO_ROW(5), DS_MICRO_ROW(6)};
#undef DS_MICRO_ROW

// C (M x N) (+)= A (M x K) B (K x N), A as in `micro`, C row-major; panels of 64 columns.
DS_AVX512 void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb,
                    float* c, int64_t ldc, bool add) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t n = std::min<int64_t>(64, N - n0), nv = (n + 15) / 16;
    const __mmask16 last = simd::first_lanes(n - 16 * (nv - 1));
    for (int64_t r0 = 0; r0 < M; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - r0);
      kMicro[rows - 1][nv - 1](a + r0 * ars, ars, aks, b + n0, ldb, K, c + r0 * ldc + n0, ldc, last, add);
    }
  }
}

// Lanes [j, n) of the 16 starting at j (none when n <= j).
DS_AVX512 inline __mmask16 lanes_below(int64_t n, int64_t j) { return n > j ? simd::first_lanes(n - j) : 0; }

// A kv head's part of the transposed or packed copies.
int64_t per_head(const AttentionShape& s) { return attention_padded(s.T, kTile) * s.D; }

// Keys or values transposed per kv head, tile by tile: tile j of head (b, kv) is a contiguous D x kTile
// block (row d holds keys j kTile .. j kTile + 63), so q k^T and dy v^T read each tile's rows of 16 keys
// from one 16 KiB block instead of rows T floats apart (4 KiB apart at T = 1024: the same L1 sets).
DS_AVX512 void transpose_tiles(const AttentionShape& s, const HeadView& x, float* xt) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t kv = 0; kv < s.NKV; ++kv) {
      float* out = xt + (b * s.NKV + kv) * per_head(s);
      for (int64_t t = 0; t < s.T; ++t) {
        const float* row = x.at(b, kv, 0, t);
        float* tile = out + t / kTile * s.D * kTile + t % kTile;
        for (int64_t d = 0; d < s.D; ++d) tile[d * kTile] = row[d];
      }
    }
}

// Keys or values copied to a contiguous (T, D) per kv head, for the products that read their rows.
DS_AVX512 void pack_rows(const AttentionShape& s, const HeadView& x, float* out) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t kv = 0; kv < s.NKV; ++kv)
      for (int64_t t = 0; t < s.T; ++t)
        std::memcpy(out + (b * s.NKV + kv) * per_head(s) + t * s.D, x.at(b, kv, 0, t), sizeof(float) * s.D);
}

// One query tile of forward. sp: a kTile x kTile tile of scores then probabilities; o: kTile x D.
DS_AVX512 void forward_tile(const AttentionShape& s, const HeadView& q, const float* kt, const float* vc,
                            const HeadView& y, float* lse, int64_t b, int64_t kv, int64_t g, int64_t i0, float* sp,
                            float* o) {
  const int64_t rows = std::min(kTile, s.T - i0), D = s.D;
  float m[kTile];
  double l[kTile];
  std::fill(m, m + rows, kMinusInf);
  std::fill(l, l + rows, 0.0);
  std::fill(o, o + rows * D, 0.0f);
  const __m512 vs = _mm512_set1_ps(s.scale);
  for (int64_t j0 = 0; j0 < i0 + rows; j0 += kTile) {
    const int64_t cols = std::min(kTile, i0 + rows - j0);
    gemm(rows, cols, D, q.at(b, kv, g, i0), q.row, 1, kt + j0 * D, kTile, sp, kTile, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = sp + r * kTile;
      const int64_t n = std::min(cols, i0 + r + 1 - j0);  // keys of this tile query i0 + r sees (>= 1)
      __m512 vmax = _mm512_set1_ps(kMinusInf);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = simd::first_lanes(n - j);
        vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(mk, pr + j)));
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      const float alpha = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < cols; j += 16) {
        const __m512 p = _mm512_maskz_mov_ps(lanes_below(n, j), simd::exp(_mm512_fmsub_ps(vs, _mm512_loadu_ps(pr + j), vm)));
        _mm512_mask_storeu_ps(pr + j, simd::first_lanes(cols - j), p);
        vsum = _mm512_add_ps(vsum, p);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(vsum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 mk = simd::first_lanes(D - d);
          _mm512_mask_storeu_ps(o + r * D + d, mk, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(mk, o + r * D + d)));
        }
      }
    }
    gemm(rows, D, cols, sp, kTile, 1, vc + j0 * D, D, o, D, true);
  }
  float* lse_g = lse + group_of(s, b, kv, g);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(static_cast<float>(1.0 / l[r]));
    float* yr = y.at(b, kv, g, i0 + r);
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 mk = simd::first_lanes(D - d);
      _mm512_mask_storeu_ps(yr + d, mk, _mm512_mul_ps(inv, _mm512_maskz_loadu_ps(mk, o + r * D + d)));
    }
    lse_g[i0 + r] = static_cast<float>(m[r] + std::log(l[r]));
  }
}

DS_AVX512 void forward_tiled(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                             const HeadView& y, float* lse) {
  const int64_t hs = per_head(s);
  std::vector<float> kt(static_cast<size_t>(s.B * s.NKV * hs)), vc(kt.size());
  transpose_tiles(s, k, kt.data());
  pack_rows(s, v, vc.data());
  const int64_t tiles = (s.T + kTile - 1) / kTile, heads = s.B * s.NKV * s.G, tasks = heads * tiles;
#pragma omp parallel
  {
    std::vector<float> sp(kTile * kTile), o(static_cast<size_t>(kTile * s.D));
    // The longest query tiles (the last, seeing the most keys) first, so the threads finish together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t tile = tiles - 1 - task / heads, head = task % heads;
      const int64_t g = head % s.G, kv = head / s.G % s.NKV, b = head / s.G / s.NKV;
      const int64_t at = (b * s.NKV + kv) * hs;
      forward_tile(s, q, kt.data() + at, vc.data() + at, y, lse, b, kv, g, tile * kTile, sp.data(), o.data());
    }
  }
}

DS_AVX512 float dot(const float* x, const float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = simd::first_lanes(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + j), _mm512_maskz_loadu_ps(mk, y + j), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

struct BackwardScratch {
  std::vector<float> p, ds, dk, dv, delta;
  BackwardScratch(const AttentionShape& s)
      : p(kTile * kTile), ds(kTile * kTile), dk(static_cast<size_t>(kTile * s.D)), dv(dk.size()), delta(static_cast<size_t>(s.G * s.T)) {}
};

// Backward of one kv head of one sample: its G query heads' dq, and its dk and dv.
DS_AVX512 void backward_head(const AttentionShape& s, const HeadView& q, const float* kt, const float* vt, const float* kc,
                             const HeadView& y, const float* lse, const HeadView& dy, const HeadView& dq,
                             const HeadView& dk, const HeadView& dv, int64_t b, int64_t kv, BackwardScratch& w) {
  const int64_t T = s.T, D = s.D;
  for (int64_t g = 0; g < s.G; ++g)
    for (int64_t t = 0; t < T; ++t) {
      w.delta[g * T + t] = dot(dy.at(b, kv, g, t), y.at(b, kv, g, t), D);
      std::memset(dq.at(b, kv, g, t), 0, sizeof(float) * D);
    }
  const __m512 vs = _mm512_set1_ps(s.scale);
  for (int64_t j0 = 0; j0 < T; j0 += kTile) {
    const int64_t cols = std::min(kTile, T - j0);
    std::fill(w.dk.begin(), w.dk.end(), 0.0f);
    std::fill(w.dv.begin(), w.dv.end(), 0.0f);
    for (int64_t g = 0; g < s.G; ++g) {
      const float* lse_g = lse + group_of(s, b, kv, g);
      for (int64_t i0 = j0; i0 < T; i0 += kTile) {  // query tiles at or below the diagonal see this key tile
        const int64_t rows = std::min(kTile, T - i0);
        const float *qi = q.at(b, kv, g, i0), *dyi = dy.at(b, kv, g, i0);
        gemm(rows, cols, D, qi, q.row, 1, kt + j0 * D, kTile, w.p.data(), kTile, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* pr = w.p.data() + r * kTile;
          const int64_t n = std::min(cols, i0 + r + 1 - j0);
          const __m512 vl = _mm512_set1_ps(lse_g[i0 + r]);
          for (int64_t j = 0; j < cols; j += 16) {
            const __m512 p = _mm512_maskz_mov_ps(lanes_below(n, j), simd::exp(_mm512_fmsub_ps(vs, _mm512_loadu_ps(pr + j), vl)));
            _mm512_mask_storeu_ps(pr + j, simd::first_lanes(cols - j), p);
          }
        }
        gemm(cols, D, rows, w.p.data(), 1, kTile, dyi, dy.row, w.dv.data(), D, true);  // dV += p^T dy
        gemm(rows, cols, D, dyi, dy.row, 1, vt + j0 * D, kTile, w.ds.data(), kTile, false);  // dp = dy v^T
        for (int64_t r = 0; r < rows; ++r) {
          const float* pr = w.p.data() + r * kTile;
          float* dsr = w.ds.data() + r * kTile;
          const __m512 vd = _mm512_set1_ps(w.delta[g * T + i0 + r]);
          for (int64_t j = 0; j < cols; j += 16) {
            const __mmask16 mk = simd::first_lanes(cols - j);
            const __m512 sp = _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(mk, pr + j));
            _mm512_mask_storeu_ps(dsr + j, mk, _mm512_mul_ps(sp, _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, dsr + j), vd)));
          }
        }
        gemm(rows, D, cols, w.ds.data(), kTile, 1, kc + j0 * D, D, dq.at(b, kv, g, i0), dq.row, true);  // dQ += ds k
        gemm(cols, D, rows, w.ds.data(), 1, kTile, qi, q.row, w.dk.data(), D, true);  // dK += ds^T q
      }
    }
    for (int64_t r = 0; r < cols; ++r) {
      std::memcpy(dk.at(b, kv, 0, j0 + r), w.dk.data() + r * D, sizeof(float) * D);
      std::memcpy(dv.at(b, kv, 0, j0 + r), w.dv.data() + r * D, sizeof(float) * D);
    }
  }
}

DS_AVX512 void backward_tiled(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                              const HeadView& y, const float* lse, const HeadView& dy, const HeadView& dq,
                              const HeadView& dk, const HeadView& dv) {
  const int64_t hs = per_head(s);
  std::vector<float> kt(static_cast<size_t>(s.B * s.NKV * hs)), vt(kt.size()), kc(kt.size());
  transpose_tiles(s, k, kt.data());
  transpose_tiles(s, v, vt.data());
  pack_rows(s, k, kc.data());
  const int64_t tasks = s.B * s.NKV;
#pragma omp parallel
  {
    BackwardScratch w(s);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      backward_head(s, q, kt.data() + task * hs, vt.data() + task * hs, kc.data() + task * hs, y, lse, dy, dq, dk, dv,
                    task / s.NKV, task % s.NKV, w);
  }
}
#endif

}  // namespace

bool causal_attention_tiles_available() {
#if defined(__x86_64__)
  return simd::has_avx512();
#else
  return false;
#endif
}

void causal_attention_forward_f32(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                                  const HeadView& y, float* lse) {
  if (s.B * s.NKV * s.G * s.T * s.D == 0) return;
#if defined(__x86_64__)
  if (simd::has_avx512()) return forward_tiled(s, q, k, v, y, lse);
#endif
  causal_attention_forward_f32_reference(s, q, k, v, y, lse);
}

void causal_attention_backward_f32(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                                   const HeadView& y, const float* lse, const HeadView& dy, const HeadView& dq,
                                   const HeadView& dk, const HeadView& dv) {
  if (s.B * s.NKV * s.G * s.T * s.D == 0) return;
#if defined(__x86_64__)
  if (simd::has_avx512()) return backward_tiled(s, q, k, v, y, lse, dy, dq, dk, dv);
#endif
  causal_attention_backward_f32_reference(s, q, k, v, y, lse, dy, dq, dk, dv);
}

void causal_attention_forward_f32_reference(const AttentionShape& s, const HeadView& q, const HeadView& k,
                                            const HeadView& v, const HeadView& y, float* lse) {
  std::vector<double> p(static_cast<size_t>(s.T)), out(static_cast<size_t>(s.D));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t kv = 0; kv < s.NKV; ++kv)
      for (int64_t g = 0; g < s.G; ++g)
        for (int64_t t = 0; t < s.T; ++t) {
          const float* qt = q.at(b, kv, g, t);
          double max = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j <= t; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < s.D; ++d) dot += double(qt[d]) * k.at(b, kv, 0, j)[d];
            p[j] = double(s.scale) * dot;
            max = std::max(max, p[j]);
          }
          double sum = 0;
          for (int64_t j = 0; j <= t; ++j) sum += std::exp(p[j] - max);
          std::fill(out.begin(), out.end(), 0.0);
          for (int64_t j = 0; j <= t; ++j) {
            const double pj = std::exp(p[j] - max) / sum;
            for (int64_t d = 0; d < s.D; ++d) out[d] += pj * v.at(b, kv, 0, j)[d];
          }
          for (int64_t d = 0; d < s.D; ++d) y.at(b, kv, g, t)[d] = static_cast<float>(out[d]);
          lse[group_of(s, b, kv, g) + t] = static_cast<float>(max + std::log(sum));
        }
}

// Independent of forward's results: the probabilities are computed again from q and k in double, and
// delta as sum_j p_j dp_j (y and lse are not read).
void causal_attention_backward_f32_reference(const AttentionShape& s, const HeadView& q, const HeadView& k,
                                             const HeadView& v, const HeadView& /*y*/, const float* /*lse*/,
                                             const HeadView& dy, const HeadView& dq, const HeadView& dk,
                                             const HeadView& dv) {
  const size_t TD = static_cast<size_t>(s.T * s.D);
  std::vector<double> p(static_cast<size_t>(s.T)), dp(p.size()), dkh(TD), dvh(TD), dqt(static_cast<size_t>(s.D));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t kv = 0; kv < s.NKV; ++kv) {
      std::fill(dkh.begin(), dkh.end(), 0.0);
      std::fill(dvh.begin(), dvh.end(), 0.0);
      for (int64_t g = 0; g < s.G; ++g)
        for (int64_t t = 0; t < s.T; ++t) {
          const float *qt = q.at(b, kv, g, t), *dyt = dy.at(b, kv, g, t);
          double max = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j <= t; ++j) {
            double qk = 0, dyv = 0;
            for (int64_t d = 0; d < s.D; ++d) {
              qk += double(qt[d]) * k.at(b, kv, 0, j)[d];
              dyv += double(dyt[d]) * v.at(b, kv, 0, j)[d];
            }
            p[j] = double(s.scale) * qk;
            dp[j] = dyv;
            max = std::max(max, p[j]);
          }
          double sum = 0, delta = 0;
          for (int64_t j = 0; j <= t; ++j) sum += std::exp(p[j] - max);
          for (int64_t j = 0; j <= t; ++j) {
            p[j] = std::exp(p[j] - max) / sum;
            delta += p[j] * dp[j];
          }
          std::fill(dqt.begin(), dqt.end(), 0.0);
          for (int64_t j = 0; j <= t; ++j) {
            const double ds = double(s.scale) * p[j] * (dp[j] - delta);
            for (int64_t d = 0; d < s.D; ++d) {
              dqt[d] += ds * k.at(b, kv, 0, j)[d];
              dkh[j * s.D + d] += ds * qt[d];
              dvh[j * s.D + d] += p[j] * dyt[d];
            }
          }
          for (int64_t d = 0; d < s.D; ++d) dq.at(b, kv, g, t)[d] = static_cast<float>(dqt[d]);
        }
      for (int64_t j = 0; j < s.T; ++j)
        for (int64_t d = 0; d < s.D; ++d) {
          dk.at(b, kv, 0, j)[d] = static_cast<float>(dkh[j * s.D + d]);
          dv.at(b, kv, 0, j)[d] = static_cast<float>(dvh[j * s.D + d]);
        }
    }
}

}  // namespace ds::kernels
