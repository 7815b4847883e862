// ds — causal self-attention without the T x T matrix: a block of query rows at a time is multiplied
// by the keys it may see (the blocks above the diagonal are never computed), turned into
// probabilities in place (kernels/cpu/attention_softmax) and multiplied by the values. Backward
// recomputes each block's probabilities from the log-sum-exp kept per row; what is kept for backward
// is q, k, v and that log-sum-exp, O(T) per head instead of O(T^2). Grouped-query
// attention reads each key/value head once for its group of query heads (no repeated copies).
// fp32 on a CPU with AVX-512, and bf16 on one with AMX or AVX512-BF16, take kernels/cpu/attention_tiles
// instead of the blocks: 64 x 64 tiles of queries and keys with its own products and an online
// softmax, q, k, v and the gradients read and written in place through their strides; it keeps y
// (which the output projection keeps anyway) and the log-sum-exp. fp32 and bf16 CPU tensors take one of these paths;
// anything else takes the materialised one, which is also the reference the tests hold them to.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <tuple>

#include "engine/plan/model_spec.hpp"  // attention_chunk_rows: the plan counts the same block

namespace ds {

// q (B, T, NH, D), k and v (B, T, NKV, D) -- the layout a projection's output has when viewed by head,
// so no caller transposes -- with NH a multiple of NKV (query head h reads key/value head h / (NH/NKV)),
// all of one dtype, any strides. Returns softmax(q k^T / sqrt(D), causal) v as (B, T, NH, D),
// contiguous, so viewing it as (B*T, NH*D) for the output projection copies nothing; the gradients come
// back in the inputs' layout, contiguous. `block_rows` 0: ds's choice (tiles where the CPU has them,
// AVX-512 for fp32 and AMX or AVX512-BF16 for bf16, else blocks of attention_chunk_rows); > 0: the
// block path with blocks of that many rows.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               int64_t block_rows = 0);

// The same from one packed projection (B, T, NH + 2 NKV, D): the NH query heads, then the NKV key
// heads, then the NKV value heads (GPT-2's c_attn output viewed by head). Its gradient is one tensor of
// that shape, written by head, where three views of it would each make a zero-filled full-size
// gradient to be summed (GPT-2 124M fp32 at T=128: peak RSS -130 MiB).
torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t heads, int64_t block_rows = 0);

// The packed tensor's three parts as views: q (B, T, NH, D), k and v (B, T, NKV, D).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> unpack(const torch::Tensor& qkv, int64_t heads);
// The same views, differentiable with one gradient of qkv's shape in backward (the parts' gradients
// concatenated) instead of one zeroed packed-size gradient per part added by autograd: LibTorch's attention
// (a GPU's) takes q, k and v apart.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> unpack_one_gradient(const torch::Tensor& qkv, int64_t heads);

// What a family changes in its attention (schema/arch.hpp), which only the materialised path computes:
// a window (each query sees the last `window` positions, itself included; 0: every earlier one), the
// scores soft-capped as cap tanh(s / cap) (Gemma 2; 0: not), and their scale (0: 1 / sqrt(D)).
struct AttentionForm {
  int64_t window = 0;
  double softcap = 0, scale = 0;
  // Whether at T positions it is the plain causal attention the fused paths compute.
  bool plain(int64_t T) const { return (window <= 0 || window >= T) && softcap <= 0 && scale <= 0; }
};

// The same computed the plain way (scores for every pair, masked, softmax, then the values), with
// `drop` applied to the probabilities (attention dropout) and the `form` a family gives it; the same layouts.
torch::Tensor causal_attention_materialised(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const std::function<torch::Tensor(const torch::Tensor&)>& drop = {},
                                            const AttentionForm& form = {});

}  // namespace ds
