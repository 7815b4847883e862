// ds — causal attention in fp32 over 64 x 64 tiles of queries and keys, forward and backward, with
// its own register-blocked products (AVX-512). The block path in engine/runtime/model/fused_attention
// multiplies whole blocks through LibTorch's bmm; at the head size (K or N = 64) OpenBLAS's fp32
// kernels ran at ~75% of their large-GEMM rate there (62% with a transposed operand) and the block
// path as a whole at ~50% (bench/RESULTS.md, session 13). Here every product is a tile that stays in
// L1/L2, the softmax runs on the tile between its two products, and q, k, v, y and their gradients
// are read and written in place through strides (the only copies: K^T and V^T tile by tile, and K or
// V by rows, per kv head).
//
// Forward, per query tile (online softmax over key tiles):
//   s = q k^T, m' = max(m, max_j scale s_j), p = e^(scale s - m'), l = l e^(m - m') + sum p,
//   o = o e^(m - m') + p v;  at the end y = o / l, lse = m + log l.
// Backward, per kv head, key tile by key tile (FlashAttention-2's order; dK and dV stay in a tile):
//   p = e^(scale q k^T - lse), dV += p^T dy, dp = dy v^T, ds = scale p (dp - delta),
//   dQ += ds k, dK += ds^T q, with delta = sum_d dy y per query row.
// Causal: query t sees keys 0..t. Grouped-query attention: G query heads share each kv head.
// Threads: forward over (sample, query head, query tile), backward over (sample, kv head).
#pragma once

#include <cstdint>

#include "engine/plan/attention_workspace.hpp"  // the tile sizes and workspace bytes, which the plan counts too

namespace ds::kernels {

using workspace::attention_padded;
using workspace::attention_tiles_bf16_backward_task_bytes;
using workspace::attention_tiles_bf16_forward_bytes;
using workspace::attention_tiles_f32_backward_bytes;
using workspace::kAttentionBf16Step;
using workspace::kAttentionTile;

// Where one tensor's heads lie, in elements (float, or uint16_t holding bf16): element (b, kv, g, t, d)
// of a (B, NKV, G, T, D) view is at data[b * batch + kv * kv_head + g * group_head + t * row + d]; d is
// contiguous. Keys, values and their gradients have no group (group_head unused). (B, T, NH, D) storage
// with head = kv * G + g: batch = T * NH * D, kv_head = G * D, group_head = D, row = NH * D.
template <class T>
struct HeadViewOf {
  T* data = nullptr;
  int64_t batch = 0, kv_head = 0, group_head = 0, row = 0;

  T* at(int64_t b, int64_t kv, int64_t g, int64_t t) const { return data + b * batch + kv * kv_head + g * group_head + t * row; }
};
using HeadView = HeadViewOf<float>;
using HeadViewBf16 = HeadViewOf<uint16_t>;

struct AttentionShape {
  int64_t B = 0, NKV = 0, G = 1, T = 0, D = 0;
  float scale = 1;  // on q k^T before the softmax: 1 / sqrt(D)
};

// Forward: y (written) and lse, a contiguous (B, NKV, G, T) fp32 array, from q, k, v.
void causal_attention_forward_f32(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                                  const HeadView& y, float* lse);

// Backward: dq, dk, dv (written, not accumulated) from forward's q, k, v, y and lse and the output's
// gradient dy.
void causal_attention_backward_f32(const AttentionShape& s, const HeadView& q, const HeadView& k, const HeadView& v,
                                   const HeadView& y, const float* lse, const HeadView& dy, const HeadView& dq,
                                   const HeadView& dk, const HeadView& dv);

// The tiled kernels need AVX-512; without it callers take another path (the references are for tests).
bool causal_attention_tiles_available();

// Row by row in double, one thread: what the tiled kernels are tested against.
void causal_attention_forward_f32_reference(const AttentionShape& s, const HeadView& q, const HeadView& k,
                                            const HeadView& v, const HeadView& y, float* lse);
void causal_attention_backward_f32_reference(const AttentionShape& s, const HeadView& q, const HeadView& k,
                                             const HeadView& v, const HeadView& y, const float* lse,
                                             const HeadView& dy, const HeadView& dq, const HeadView& dk,
                                             const HeadView& dv);

// bf16: the same algorithm with bf16 products (attention_tiles_bf16.cpp). Every product multiplies
// bf16 tiles into fp32, the softmax runs in fp32 on the product's fp32 tile, and only what feeds the
// next product (the probabilities, the scores' gradient) is rounded to bf16, as LibTorch's bf16 bmm
// path rounds its blocks; y, dq, dk and dv are summed in fp32 and rounded once. The operands are
// copied into the layouts AMX reads (rows, and "pairs": two consecutive k rows interleaved), D padded
// to a multiple of 32 and T to whole tiles with zeros. Backward computes the transposed tiles (s^T =
// k q^T, one key per row) so every operand comes straight out of the elementwise pass, and sums dq^T,
// transposed once at the end.
// The products: AMX's tiles (tdpbf16ps), or where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and
// later, Intel Cooper Lake) the pair dot product vdpbf16ps, which reads the same pairs layout and runs
// at twice the fp32 FMA rate on Zen 4 (bench_fma; on Sapphire Rapids at half of it, hence AMX there).
enum class Bf16Products { none, avx512_bf16, amx };
const char* bf16_products_name(Bf16Products how);  // "AMX", "AVX512-BF16", "none"
// The fastest products this CPU runs (AMX only where the kernel grants this process the tile state).
Bf16Products attention_tiles_bf16_products();
bool causal_attention_tiles_bf16_available();  // products other than none

// As the fp32 kernels; lse is fp32. `how` must be one this CPU runs (std::logic_error otherwise).
void causal_attention_forward_bf16(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k,
                                   const HeadViewBf16& v, const HeadViewBf16& y, float* lse,
                                   Bf16Products how = attention_tiles_bf16_products());
void causal_attention_backward_bf16(const AttentionShape& s, const HeadViewBf16& q, const HeadViewBf16& k,
                                    const HeadViewBf16& v, const HeadViewBf16& y, const float* lse,
                                    const HeadViewBf16& dy, const HeadViewBf16& dq, const HeadViewBf16& dk,
                                    const HeadViewBf16& dv, Bf16Products how = attention_tiles_bf16_products());


}  // namespace ds::kernels
