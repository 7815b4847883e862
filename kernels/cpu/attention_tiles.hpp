// ds — causal attention in fp32 over 64 x 64 tiles of queries and keys, forward and backward, with
// its own register-blocked products (AVX-512). The block path in engine/runtime/fused_attention
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

namespace ds::kernels {

// Queries and keys per tile: a 64 x 64 fp32 tile is 16 KiB, L1-sized. The plan counts the kernels'
// copies of K and V in whole tiles.
constexpr int64_t kAttentionTile = 64;

// Where one tensor's heads lie, in floats: element (b, kv, g, t, d) of a (B, NKV, G, T, D) view is at
// data[b * batch + kv * kv_head + g * group_head + t * row + d]; d is contiguous. Keys, values and
// their gradients have no group (group_head unused). (B, T, NH, D) storage with head = kv * G + g:
// batch = T * NH * D, kv_head = G * D, group_head = D, row = NH * D.
struct HeadView {
  float* data = nullptr;
  int64_t batch = 0, kv_head = 0, group_head = 0, row = 0;

  float* at(int64_t b, int64_t kv, int64_t g, int64_t t) const { return data + b * batch + kv * kv_head + g * group_head + t * row; }
};

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

}  // namespace ds::kernels
