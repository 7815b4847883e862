// bf16 causal attention over 64 x 64 tiles, its products on AMX or by AVX512-BF16; the algorithm and
// the layouts are described in attention_tiles.hpp. AMX multiplies a 16 x 32 bf16 tile by a 32 x 16
// one into a 16 x 16 fp32 tile; its second operand is stored "in pairs": row k/2 holds (k, n) at
// column 2n + k % 2. That is also what AVX512-BF16's vdpbf16ps reads (16 lanes, each the dot product
// of a pair), so CPUs without AMX run the same kernel with a register-blocked product in its place.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/cpu/attention_tiles.hpp"
#include "kernels/cpu/simd.hpp"

namespace ds::kernels {
namespace {

constexpr int64_t kTile = kAttentionTile, kStep = kAttentionBf16Step;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

#if defined(__x86_64__)
#define DS_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// The padded sizes of one head: T in whole tiles, D in whole AMX steps.
struct Padded {
  int64_t T, D;
  explicit Padded(const AttentionShape& s) : T(attention_padded(s.T, kTile)), D(attention_padded(s.D, kStep)) {}
  int64_t head() const { return T * D; }
  int64_t tile() const { return kTile * D; }  // one tile of keys or queries in any layout
};

// Palette 1 with all eight tiles 16 rows x 64 bytes: 0-3 accumulate a 32 x 32 block of C, 4-5 hold A's
// two 16-row halves, 6-7 B's two 16-column halves. The configuration is per thread.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

DS_AMX void tiles_begin() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

DS_AMX void tiles_end() { _tile_release(); }

// C (M x N fp32, rows ldc apart) (+)= A B, A (M x K bf16) by rows lda apart, B (K x N) in pairs with
// pair rows ldb apart. M, N and K are multiples of 32.
DS_AMX void product_amx(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                        float* c, int64_t ldc, bool add) {
  const int64_t a_bytes = lda * 2, b_bytes = ldb * 2, c_bytes = ldc * 4;
  for (int64_t m0 = 0; m0 < M; m0 += 32)
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      float* c0 = c + m0 * ldc + n0;
      if (add) {
        _tile_loadd(0, c0, c_bytes);
        _tile_loadd(1, c0 + 16, c_bytes);
        _tile_loadd(2, c0 + 16 * ldc, c_bytes);
        _tile_loadd(3, c0 + 16 * ldc + 16, c_bytes);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        _tile_loadd(4, a + m0 * lda + k0, a_bytes);
        _tile_loadd(5, a + (m0 + 16) * lda + k0, a_bytes);
        _tile_loadd(6, b + k0 / 2 * ldb + 2 * n0, b_bytes);
        _tile_loadd(7, b + k0 / 2 * ldb + 2 * (n0 + 16), b_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, c_bytes);
      _tile_stored(1, c0 + 16, c_bytes);
      _tile_stored(2, c0 + 16 * ldc, c_bytes);
      _tile_stored(3, c0 + 16 * ldc + 16, c_bytes);
    }
}

// The same product by vdpbf16ps: a block of 8 rows x 32 columns of C in 16 registers; per pair of k,
// B's two vectors (32 columns) are loaded once and shared by the 8 rows, each row's pair of A broadcast.
// 16 independent sums cover the instruction's latency.
DS_AMX void product_pairs(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                          float* c, int64_t ldc, bool add) {
  constexpr int kRows = 8;
  for (int64_t m0 = 0; m0 < M; m0 += kRows)
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      __m512 acc[kRows][2];
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const float* cr = c + (m0 + r) * ldc + n0;
        acc[r][0] = add ? _mm512_loadu_ps(cr) : _mm512_setzero_ps();
        acc[r][1] = add ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps();
      }
      const uint16_t* a0 = a + m0 * lda;
      for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* bk = b + k / 2 * ldb + 2 * n0;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          int32_t pair;
          std::memcpy(&pair, a0 + r * lda + k, sizeof pair);
          const __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        float* cr = c + (m0 + r) * ldc + n0;
        _mm512_storeu_ps(cr, acc[r][0]);
        _mm512_storeu_ps(cr + 16, acc[r][1]);
      }
    }
}

// Every product of the kernels, by the products chosen for the run.
DS_AMX inline void product(Bf16Products how, int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                           int64_t ldb, float* c, int64_t ldc, bool add) {
  if (how == Bf16Products::amx)
    product_amx(M, N, K, a, lda, b, ldb, c, ldc, add);
  else
    product_pairs(M, N, K, a, lda, b, ldb, c, ldc, add);
}

// 16 fp32 lanes rounded to bf16 (nearest even) by AVX512-BF16.
DS_AMX inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// Lane i holds i * step: the offsets of 16 elements `step` apart, for gathers and scatters.
DS_AMX inline __m512i lane_offsets(int64_t step) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int>(step)));
}

// Two rows of 16 bf16 interleaved lane by lane: the pairs layout's 32 elements for rows r and r + 1.
DS_AMX inline __m512i interleave(__m256i even, __m256i odd) {
  const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                         35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), index, _mm512_castsi256_si512(odd));
}

// The copies of one head's rows src[t * stride + d] (t < T, d < D) that the products read; the
// padding is zero (the buffers are zero-filled first).
// rows: (t, d) at t * Dp. Operand A with t as its rows.
void pack_rows(const uint16_t* src, int64_t stride, int64_t T, int64_t D, const Padded& p, uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * p.D, src + t * stride, sizeof(uint16_t) * D);
}

// pairs: (t, d) at t / 2 * 2 Dp + 2 d + t % 2. Operand B with t as the summed index (p v, ds k, ...).
DS_AMX void pack_pairs(const uint16_t* src, int64_t stride, int64_t T, int64_t D, const Padded& p, uint16_t* out) {
  for (int64_t t = 0; t < T; t += 2)
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 mk = simd::first_lanes(D - d);
      const __m256i even = _mm256_maskz_loadu_epi16(mk, src + t * stride + d);
      const __m256i odd = t + 1 < T ? _mm256_maskz_loadu_epi16(mk, src + (t + 1) * stride + d) : _mm256_setzero_si256();
      _mm512_storeu_si512(out + t / 2 * 2 * p.D + 2 * d, interleave(even, odd));
    }
}

// columns, tile by tile: tile t / 64 is a (Dp / 2) x 128 block with (t, d) at d / 2 * 128 + 2 (t % 64)
// + d % 2. Operand B with d as the summed index and t as its columns (q k^T, dy v^T); tile-major so a
// product reads one 8 KiB block (at D = 64) instead of rows 2 T apart. Each (d, d + 1) pair moves as one
// 32-bit word, gathered from 16 rows at a time (16 rows of a tile: 64 is a multiple of 16).
DS_AMX void pack_columns(const uint16_t* src, int64_t stride, int64_t T, int64_t D, const Padded& p, uint16_t* out) {
  if (D % 2 != 0 || stride > (int64_t{1} << 26)) {  // a last word half past the row, or offsets past int32
    for (int64_t t = 0; t < T; ++t) {
      uint16_t* col = out + t / kTile * p.tile() + 2 * (t % kTile);
      for (int64_t d = 0; d < D; ++d) col[d / 2 * 2 * kTile + d % 2] = src[t * stride + d];
    }
    return;
  }
  const __m512i rows = lane_offsets(stride * 2);  // bytes
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const __mmask16 mk = simd::first_lanes(T - t0);
    uint32_t* col = reinterpret_cast<uint32_t*>(out + t0 / kTile * p.tile()) + t0 % kTile;
    for (int64_t w = 0; w < D / 2; ++w)
      _mm512_mask_storeu_epi32(col + w * kTile, mk, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, rows, src + t0 * stride + 2 * w, 1));
  }
}

// transposed, tile by tile: (t, d) at t / 64 * 64 Dp + d * 64 + t % 64. Operand A with d as its rows
// (dq^T += k^T ds^T).
void pack_transposed(const uint16_t* src, int64_t stride, int64_t T, int64_t D, const Padded& p, uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* col = out + t / kTile * p.tile() + t % kTile;
    for (int64_t d = 0; d < D; ++d) col[d * kTile] = src[t * stride + d];
  }
}

// One query tile of forward: s = q k^T, the online softmax on s in fp32, o += p v with p in bf16.
struct ForwardScratch {
  std::vector<uint16_t> q, p;
  std::vector<float> s, o;
  explicit ForwardScratch(const Padded& pd)
      : q(static_cast<size_t>(pd.tile())), p(kTile * kTile), s(kTile * kTile), o(static_cast<size_t>(pd.tile())) {}
};

DS_AMX void forward_tile(const AttentionShape& s, const Padded& pd, const HeadViewBf16& q, const uint16_t* k_columns,
                         const uint16_t* v_pairs, const HeadViewBf16& y, float* lse, int64_t b, int64_t kv, int64_t g,
                         int64_t i0, Bf16Products how, ForwardScratch& w) {
  const int64_t rows = std::min(kTile, s.T - i0), D = s.D, Dp = pd.D;
  std::fill(w.q.begin(), w.q.end(), uint16_t{0});
  std::fill(w.p.begin(), w.p.end(), uint16_t{0});  // rows past `rows` stay zero
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  pack_rows(q.at(b, kv, g, i0), q.row, rows, D, pd, w.q.data());
  // Per query row: the running maximum m of the scaled scores (scale > 0, so scale max s) and sum l.
  // Padded rows get m = 0 and their results are never written. The passes over rows are split so the rows' horizontal
  // reductions and exps overlap instead of running one dependent chain per row.
  alignas(64) float m[kTile], l[kTile], top[kTile], alpha[kTile], sum[kTile];
  std::fill(m, m + kTile, kMinusInf);
  std::fill(l, l + kTile, 0.0f);
  std::fill(top + rows, top + kTile, 0.0f);
  std::fill(sum + rows, sum + kTile, 0.0f);
  const __m512 vs = _mm512_set1_ps(s.scale);
  for (int64_t j0 = 0; j0 < i0 + rows; j0 += kTile) {
    product(how, kTile, kTile, Dp, w.q.data(), Dp, k_columns + j0 / kTile * pd.tile(), 2 * kTile, w.s.data(), kTile, false);
    for (int64_t r = 0; r < rows; ++r) {
      const float* sr = w.s.data() + r * kTile;
      const int64_t n = std::min(kTile, i0 + r + 1 - j0);  // keys of this tile query i0 + r sees (>= 1)
      __m512 vmax = _mm512_set1_ps(kMinusInf);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = simd::first_lanes(n - j);
        vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, sr + j));
      }
      top[r] = _mm512_reduce_max_ps(vmax);
    }
    for (int64_t r = 0; r < kTile; r += 16) {  // m' = max(m, scale top), alpha = e^(m - m')
      const __m512 mr = _mm512_load_ps(m + r), m_new = _mm512_max_ps(mr, _mm512_mul_ps(vs, _mm512_load_ps(top + r)));
      _mm512_store_ps(alpha + r, simd::exp(_mm512_sub_ps(mr, m_new)));  // 0 on the first tile (m = -inf)
      _mm512_store_ps(m + r, m_new);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* sr = w.s.data() + r * kTile;
      const int64_t n = std::min(kTile, i0 + r + 1 - j0);
      const __m512 vm = _mm512_set1_ps(m[r]);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < kTile; j += 16) {
        const __mmask16 mk = n > j ? simd::first_lanes(n - j) : 0;
        const __m512 p = _mm512_maskz_mov_ps(mk, simd::exp(_mm512_fmsub_ps(vs, _mm512_loadu_ps(sr + j), vm)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.p.data() + r * kTile + j), round16(p));
        vsum = _mm512_add_ps(vsum, p);
      }
      sum[r] = _mm512_reduce_add_ps(vsum);
      const __m512 va = _mm512_set1_ps(alpha[r]);
      float* orow = w.o.data() + r * Dp;
      for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(va, _mm512_loadu_ps(orow + d)));
    }
    for (int64_t r = 0; r < kTile; r += 16)
      _mm512_store_ps(l + r, _mm512_fmadd_ps(_mm512_load_ps(l + r), _mm512_load_ps(alpha + r), _mm512_load_ps(sum + r)));
    product(how, kTile, Dp, kTile, w.p.data(), kTile, v_pairs + j0 / 2 * 2 * Dp, 2 * Dp, w.o.data(), Dp, true);
  }
  float* lse_g = lse + ((b * s.NKV + kv) * s.G + g) * s.T;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    uint16_t* yr = y.at(b, kv, g, i0 + r);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_mask_storeu_epi16(yr + d, simd::first_lanes(D - d), round16(_mm512_mul_ps(inv, _mm512_loadu_ps(w.o.data() + r * Dp + d))));
    lse_g[i0 + r] = m[r] + std::log(l[r]);
  }
}

DS_AMX void forward_tiled(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k, const HeadViewBf16& v,
                          const HeadViewBf16& y, float* lse, Bf16Products how) {
  const Padded pd(s);
  const int64_t kv_heads = s.B * s.NKV;
  std::vector<uint16_t> k_columns(static_cast<size_t>(kv_heads * pd.head()), 0), v_pairs(k_columns.size(), 0);
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < kv_heads; ++h) {
    const int64_t b = h / s.NKV, kv = h % s.NKV;
    pack_columns(k.at(b, kv, 0, 0), k.row, s.T, s.D, pd, k_columns.data() + h * pd.head());
    pack_pairs(v.at(b, kv, 0, 0), v.row, s.T, s.D, pd, v_pairs.data() + h * pd.head());
  }
  const int64_t tiles = pd.T / kTile, heads = kv_heads * s.G, tasks = heads * tiles;
#pragma omp parallel
  {
    if (how == Bf16Products::amx) tiles_begin();
    ForwardScratch w(pd);
    // The longest query tiles (the last, seeing the most keys) first, so the threads finish together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t tile = tiles - 1 - task / heads, head = task % heads;
      const int64_t kvh = head / s.G, g = head % s.G;
      forward_tile(s, pd, q, k_columns.data() + kvh * pd.head(), v_pairs.data() + kvh * pd.head(), y, lse, kvh / s.NKV,
                   kvh % s.NKV, g, tile * kTile, how, w);
    }
    if (how == Bf16Products::amx) tiles_end();
  }
}

// Backward of one (sample, kv head), one query head of its group at a time: the copies, dK and dV of
// the kv head and dq^T of the query head (summed in fp32), and the tiles of one key tile against one
// query tile. Every buffer starts zero, so the copies' padding stays zero.
struct BackwardScratch {
  std::vector<uint16_t> k_rows, k_transposed, v_rows;               // the kv head
  std::vector<uint16_t> q_columns, q_pairs, dy_columns, dy_pairs;  // one query head
  std::vector<float> dk, dv, dq_t, lse, delta;  // dq^T: Dp x 64 per query tile
  std::vector<float> p, dp;                     // p^T and dp^T (64 x 64)
  std::vector<uint16_t> p_rows, ds_rows, ds_pairs;  // p^T, ds^T by rows, ds^T in pairs
  explicit BackwardScratch(const Padded& pd)
      : k_rows(static_cast<size_t>(pd.head())), k_transposed(k_rows.size()), v_rows(k_rows.size()), q_columns(k_rows.size()),
        q_pairs(k_rows.size()), dy_columns(k_rows.size()), dy_pairs(k_rows.size()), dk(k_rows.size()), dv(k_rows.size()),
        dq_t(k_rows.size()), lse(static_cast<size_t>(pd.T)), delta(lse.size()), p(kTile * kTile), dp(p.size()),
        p_rows(p.size()), ds_rows(p.size()), ds_pairs(p.size()) {}
};

DS_AMX float dot_bf16(const uint16_t* x, const uint16_t* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = simd::first_lanes(n - j);
    acc = _mm512_fmadd_ps(simd::load(x + j, mk), simd::load(y + j, mk), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <class T>
void zero(std::vector<T>& x) {
  std::fill(x.begin(), x.end(), T{0});
}

DS_AMX void backward_head(const AttentionShape& s, const Padded& pd, const HeadViewBf16& q, const HeadViewBf16& k,
                          const HeadViewBf16& v, const HeadViewBf16& y, const float* lse, const HeadViewBf16& dy,
                          const HeadViewBf16& dq, const HeadViewBf16& dk, const HeadViewBf16& dv, int64_t b, int64_t kv,
                          Bf16Products how, BackwardScratch& w) {
  const int64_t T = s.T, D = s.D, Dp = pd.D;
  zero(w.dk);
  zero(w.dv);
  pack_rows(k.at(b, kv, 0, 0), k.row, T, D, pd, w.k_rows.data());
  pack_transposed(k.at(b, kv, 0, 0), k.row, T, D, pd, w.k_transposed.data());
  pack_rows(v.at(b, kv, 0, 0), v.row, T, D, pd, w.v_rows.data());
  const __m512 vs = _mm512_set1_ps(s.scale);
  const __m512i down = lane_offsets(kTile);
  for (int64_t g = 0; g < s.G; ++g) {
    zero(w.dq_t);
    pack_columns(q.at(b, kv, g, 0), q.row, T, D, pd, w.q_columns.data());
    pack_pairs(q.at(b, kv, g, 0), q.row, T, D, pd, w.q_pairs.data());
    pack_columns(dy.at(b, kv, g, 0), dy.row, T, D, pd, w.dy_columns.data());
    pack_pairs(dy.at(b, kv, g, 0), dy.row, T, D, pd, w.dy_pairs.data());
    std::memcpy(w.lse.data(), lse + ((b * s.NKV + kv) * s.G + g) * T, sizeof(float) * T);
    for (int64_t t = 0; t < T; ++t) w.delta[t] = dot_bf16(dy.at(b, kv, g, t), y.at(b, kv, g, t), D);
    for (int64_t j0 = 0; j0 < T; j0 += kTile) {
      const int64_t cols = std::min(kTile, T - j0);  // real keys in this tile
      for (int64_t i0 = j0; i0 < T; i0 += kTile) {  // query tiles at or below the diagonal see this key tile
        const int64_t queries = std::min(kTile, T - i0);
        // p^T: row r is key j0 + r, column c query i0 + c; kept where c sees r (i0 + c >= j0 + r).
        product(how, kTile, kTile, Dp, w.k_rows.data() + j0 * Dp, Dp, w.q_columns.data() + i0 / kTile * pd.tile(), 2 * kTile,
                w.p.data(), kTile, false);
        const float* lse_i = w.lse.data() + i0;
        for (int64_t r = 0; r < kTile; ++r) {
          const int64_t first = std::max<int64_t>(0, j0 + r - i0);  // the first query column that sees key r
          float* pr = w.p.data() + r * kTile;
          for (int64_t c = 0; c < kTile; c += 16) {
            __mmask16 mk = 0;
            if (r < cols && c + 16 > first && c < queries)
              mk = static_cast<__mmask16>(simd::first_lanes(queries - c) & ~simd::first_lanes(std::max<int64_t>(0, first - c)));
            const __m512 p = _mm512_maskz_mov_ps(mk, simd::exp(_mm512_fmsub_ps(vs, _mm512_loadu_ps(pr + c), _mm512_loadu_ps(lse_i + c))));
            _mm512_storeu_ps(pr + c, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.p_rows.data() + r * kTile + c), round16(p));
          }
        }
        // dV += p^T dy; dp^T = v dy^T
        product(how, kTile, Dp, kTile, w.p_rows.data(), kTile, w.dy_pairs.data() + i0 / 2 * 2 * Dp, 2 * Dp, w.dv.data() + j0 * Dp, Dp, true);
        product(how, kTile, kTile, Dp, w.v_rows.data() + j0 * Dp, Dp, w.dy_columns.data() + i0 / kTile * pd.tile(), 2 * kTile,
                w.dp.data(), kTile, false);
        // ds^T = scale p^T (dp^T - delta), by rows (for dK) and in pairs of keys (for dQ^T).
        const float* delta_i = w.delta.data() + i0;
        for (int64_t r = 0; r < kTile; r += 2) {
          for (int64_t c = 0; c < kTile; c += 16) {
            const __m512 dl = _mm512_loadu_ps(delta_i + c);
            __m256i half[2];
            for (int64_t e = 0; e < 2; ++e) {
              const int64_t at_rc = (r + e) * kTile + c;
              const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(vs, _mm512_loadu_ps(w.p.data() + at_rc)),
                                              _mm512_sub_ps(_mm512_loadu_ps(w.dp.data() + at_rc), dl));
              half[e] = round16(ds);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.ds_rows.data() + at_rc), half[e]);
            }
            _mm512_storeu_si512(w.ds_pairs.data() + r / 2 * 2 * kTile + 2 * c, interleave(half[0], half[1]));
          }
        }
        // dK += ds^T q; dQ^T += k^T ds^T
        product(how, kTile, Dp, kTile, w.ds_rows.data(), kTile, w.q_pairs.data() + i0 / 2 * 2 * Dp, 2 * Dp, w.dk.data() + j0 * Dp, Dp, true);
        product(how, Dp, kTile, kTile, w.k_transposed.data() + j0 / kTile * pd.tile(), kTile, w.ds_pairs.data(), 2 * kTile,
                w.dq_t.data() + i0 / kTile * pd.tile(), kTile, true);
      }
    }
    // dq from dq^T: query t's column of its tile, gathered 16 elements (64 floats apart) at a time.
    for (int64_t t = 0; t < T; ++t) {
      const float* col = w.dq_t.data() + t / kTile * pd.tile() + t % kTile;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mk = simd::first_lanes(D - d);
        _mm256_mask_storeu_epi16(dq.at(b, kv, g, t) + d, mk, round16(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, down, col + d * kTile, 4)));
      }
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 mk = simd::first_lanes(D - d);
      _mm256_mask_storeu_epi16(dk.at(b, kv, 0, t) + d, mk, round16(_mm512_loadu_ps(w.dk.data() + t * Dp + d)));
      _mm256_mask_storeu_epi16(dv.at(b, kv, 0, t) + d, mk, round16(_mm512_loadu_ps(w.dv.data() + t * Dp + d)));
    }
}

DS_AMX void backward_tiled(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k, const HeadViewBf16& v,
                           const HeadViewBf16& y, const float* lse, const HeadViewBf16& dy, const HeadViewBf16& dq,
                           const HeadViewBf16& dk, const HeadViewBf16& dv, Bf16Products how) {
  const Padded pd(s);
  const int64_t tasks = s.B * s.NKV;
#pragma omp parallel
  {
    if (how == Bf16Products::amx) tiles_begin();
    BackwardScratch w(pd);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      backward_head(s, pd, q, k, v, y, lse, dy, dq, dk, dv, task / s.NKV, task % s.NKV, how, w);
    if (how == Bf16Products::amx) tiles_end();
  }
}

// CPUID leaf 7: AMX-TILE (subleaf 0, EDX bit 24), AMX-BF16 (EDX bit 22), AVX512-BF16 (subleaf 1, EAX
// bit 5). Asked directly: clang's __builtin_cpu_supports knows no AMX names.
bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1u);
}

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ((d >> 24) & 1u) && ((d >> 22) & 1u);
}

// Linux hands out AMX's 8 KiB of tile state only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18); without it the first tile instruction faults.
bool amx_granted() {
#if defined(__linux__)
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}
#endif

// Whether this CPU can run `how` (AMX needs AVX512-BF16 too: the kernels round with it).
bool can_run(Bf16Products how) {
#if defined(__x86_64__)
  if (how == Bf16Products::none || !simd::has_avx512() || !cpu_has_avx512_bf16()) return false;
  if (how == Bf16Products::avx512_bf16) return true;
  static const bool amx = cpu_has_amx_bf16() && amx_granted();
  return amx;
#else
  (void)how;
  return false;
#endif
}

void check_can_run(Bf16Products how) {
  if (!can_run(how))
    throw std::logic_error(std::string("the bf16 attention tiles cannot run with products '") + bf16_products_name(how) + "' on this CPU");
}

}  // namespace

const char* bf16_products_name(Bf16Products how) {
  switch (how) {
    case Bf16Products::amx: return "AMX";
    case Bf16Products::avx512_bf16: return "AVX512-BF16";
    case Bf16Products::none: break;
  }
  return "none";
}

Bf16Products attention_tiles_bf16_products() {
  static const Bf16Products best =
      can_run(Bf16Products::amx) ? Bf16Products::amx : can_run(Bf16Products::avx512_bf16) ? Bf16Products::avx512_bf16 : Bf16Products::none;
  return best;
}

bool causal_attention_tiles_bf16_available() { return attention_tiles_bf16_products() != Bf16Products::none; }

void causal_attention_forward_bf16(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k,
                                   const HeadViewBf16& v, const HeadViewBf16& y, float* lse, Bf16Products how) {
  if (s.B * s.NKV * s.G * s.T * s.D == 0) return;
  check_can_run(how);
#if defined(__x86_64__)
  forward_tiled(s, q, k, v, y, lse, how);
#endif
}

void causal_attention_backward_bf16(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k,
                                    const HeadViewBf16& v, const HeadViewBf16& y, const float* lse,
                                    const HeadViewBf16& dy, const HeadViewBf16& dq, const HeadViewBf16& dk,
                                    const HeadViewBf16& dv, Bf16Products how) {
  if (s.B * s.NKV * s.G * s.T * s.D == 0) return;
  check_can_run(how);
#if defined(__x86_64__)
  backward_tiled(s, q, k, v, y, lse, dy, dq, dk, dv, how);
#endif
}

}  // namespace ds::kernels
