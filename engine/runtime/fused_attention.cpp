#include "engine/runtime/fused_attention.hpp"

#include <cmath>
#include <limits>

#include "common/error.hpp"
#include "kernels/cpu/attention_softmax.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Heads {
  int64_t B, NH, NKV, G, T, D;
  int64_t kv_batches() const { return B * NKV; }  // the batch of every bmm: one per (sample, kv head)
};

Heads heads_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  DS_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "attention: q (B,NH,T,D), k and v (B,NKV,T,D)");
  const Heads h{q.size(0), q.size(1), k.size(1), 0, q.size(2), q.size(3)};
  DS_CHECK(k.size(0) == h.B && k.size(2) == h.T && k.size(3) == h.D && h.NKV > 0 && h.NH % h.NKV == 0,
           "attention: k and v must match q's batch, length and head size, with NH a multiple of NKV");
  return {h.B, h.NH, h.NKV, h.NH / h.NKV, h.T, h.D};
}

template <class T>
T* raw(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// (BKV, T, D) as (BKV, D, T) in memory: LibTorch 1.13's bmm against a transposed view ran at half the
// rate in fp32 (0.053 vs 0.109 TFLOP/s at 341 x 682 x 64, 24 batches) and 15% slower in bf16.
torch::Tensor transposed(const torch::Tensor& x) { return x.transpose(1, 2).contiguous(); }

// acc (fp32) += a b: straight into acc in fp32; through one bf16 product otherwise (bmm keeps the dtype).
void accumulate(torch::Tensor acc, const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() == torch::kFloat32)
    acc.baddbmm_(a, b);
  else
    acc.add_(torch::bmm(a, b));
}

// One block of query rows [first, first + rows): the G query heads of each kv head stacked, so one bmm
// per block serves the whole group.
kernels::CausalBlock block_of(const Heads& h, int64_t first, int64_t rows) {
  return {h.kv_batches() * h.G * rows, first + rows, rows, first, static_cast<float>(1.0 / std::sqrt(double(h.D)))};
}

// The softmax kernels on a block of scores in its dtype (fp32 or bf16), in place.
void softmax_forward(torch::Tensor& s, torch::Tensor& lse, const kernels::CausalBlock& blk) {
  if (s.scalar_type() == torch::kBFloat16)
    kernels::causal_softmax_forward_bf16(raw<uint16_t>(s), raw<float>(lse), blk);
  else
    kernels::causal_softmax_forward_f32(raw<float>(s), raw<float>(lse), blk);
}

void softmax_recompute(torch::Tensor& s, const torch::Tensor& lse, const kernels::CausalBlock& blk) {
  if (s.scalar_type() == torch::kBFloat16)
    kernels::causal_softmax_recompute_bf16(raw<uint16_t>(s), raw<float>(lse), blk);
  else
    kernels::causal_softmax_recompute_f32(raw<float>(s), raw<float>(lse), blk);
}

void softmax_backward(const torch::Tensor& p, torch::Tensor& dp, const kernels::CausalBlock& blk) {
  if (p.scalar_type() == torch::kBFloat16)
    kernels::causal_softmax_backward_bf16(raw<uint16_t>(p), raw<uint16_t>(dp), blk);
  else
    kernels::causal_softmax_backward_f32(raw<float>(p), raw<float>(dp), blk);
}

// One block's part of backward: the probabilities p (recomputed from the lse) and the scores'
// gradient ds, from the block's queries qb and output gradient dyb against the keys it sees.
struct BlockGrads {
  torch::Tensor p, ds;
};

BlockGrads block_backward(const torch::Tensor& qb, const torch::Tensor& dyb, const torch::Tensor& k_t,
                          const torch::Tensor& v_t, const torch::Tensor& lse_b, const kernels::CausalBlock& blk) {
  BlockGrads g{torch::bmm(qb, k_t.narrow(2, 0, blk.cols)), torch::bmm(dyb, v_t.narrow(2, 0, blk.cols))};
  softmax_recompute(g.p, lse_b, blk);
  softmax_backward(g.p, g.ds, blk);
  return g;
}

class CausalAttention : public torch::autograd::Function<CausalAttention> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q_in, const torch::Tensor& k_in,
                               const torch::Tensor& v_in, int64_t block_rows) {
    const Heads h = heads_of(q_in, k_in, v_in);
    const int64_t BKV = h.kv_batches();
    const torch::Tensor q = q_in.contiguous().view({BKV, h.G, h.T, h.D});
    const torch::Tensor k = k_in.contiguous().view({BKV, h.T, h.D}), v = v_in.contiguous().view({BKV, h.T, h.D});
    const torch::Tensor k_t = transposed(k);
    torch::Tensor y = torch::empty({h.B, h.T, h.NH, h.D}, q.options());
    const torch::Tensor y_blocks = y.view({h.B, h.T, h.NKV, h.G, h.D}).permute({0, 2, 3, 1, 4});  // (B,NKV,G,T,D)
    torch::Tensor lse = torch::empty({BKV, h.G, h.T}, q.options().dtype(torch::kFloat32));
    for (int64_t first = 0; first < h.T; first += block_rows) {
      const int64_t rows = std::min(block_rows, h.T - first), seen = first + rows;
      const kernels::CausalBlock blk = block_of(h, first, rows);
      const torch::Tensor qb = q.narrow(2, first, rows).reshape({BKV, h.G * rows, h.D});
      torch::Tensor s = torch::bmm(qb, k_t.narrow(2, 0, seen));  // (BKV, G*rows, seen)
      torch::Tensor lse_b = torch::empty({blk.rows}, lse.options());
      softmax_forward(s, lse_b, blk);
      lse.narrow(2, first, rows).copy_(lse_b.view({BKV, h.G, rows}));
      y_blocks.narrow(3, first, rows).copy_(torch::bmm(s, v.narrow(1, 0, seen)).view({h.B, h.NKV, h.G, rows, h.D}));
    }
    ctx->save_for_backward({q, k, v, lse});
    ctx->saved_data["block_rows"] = block_rows;
    ctx->saved_data["batch"] = h.B;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &lse = saved[3];
    const int64_t block_rows = ctx->saved_data["block_rows"].toInt(), B = ctx->saved_data["batch"].toInt();
    const int64_t BKV = q.size(0), G = q.size(1);
    const Heads h{B, BKV / B * G, BKV / B, G, q.size(2), q.size(3)};
    const auto dtype = q.scalar_type();
    const torch::Tensor dy = grad_out[0].to(dtype).contiguous();
    const torch::Tensor k_t = transposed(k), v_t = transposed(v);
    const torch::Tensor dy_blocks = dy.view({h.B, h.T, h.NKV, h.G, h.D}).permute({0, 2, 3, 1, 4});
    if (block_rows >= h.T) {  // one block (short sequences): every product is whole, nothing to sum
      const torch::Tensor qb = q.view({BKV, h.G * h.T, h.D}), dyb = dy_blocks.reshape({BKV, h.G * h.T, h.D});
      const BlockGrads g = block_backward(qb, dyb, k_t, v_t, lse, block_of(h, 0, h.T));
      return {torch::bmm(g.ds, k).view({h.B, h.NH, h.T, h.D}), torch::bmm(g.ds.transpose(1, 2), qb).view({h.B, h.NKV, h.T, h.D}),
              torch::bmm(g.p.transpose(1, 2), dyb).view({h.B, h.NKV, h.T, h.D}), torch::Tensor()};
    }
    torch::Tensor dq = torch::empty_like(q);
    // Keys and values collect a term from every block below them: summed in fp32, rounded once.
    torch::Tensor dk = torch::zeros({BKV, h.T, h.D}, q.options().dtype(torch::kFloat32)), dv = torch::zeros_like(dk);
    for (int64_t first = 0; first < h.T; first += block_rows) {
      const int64_t rows = std::min(block_rows, h.T - first), seen = first + rows;
      const torch::Tensor qb = q.narrow(2, first, rows).reshape({BKV, h.G * rows, h.D});
      const torch::Tensor dyb = dy_blocks.narrow(3, first, rows).reshape({BKV, h.G * rows, h.D});
      const BlockGrads g = block_backward(qb, dyb, k_t, v_t, lse.narrow(2, first, rows).contiguous(), block_of(h, first, rows));
      accumulate(dv.narrow(1, 0, seen), g.p.transpose(1, 2), dyb);
      dq.narrow(2, first, rows).copy_(torch::bmm(g.ds, k.narrow(1, 0, seen)).view({BKV, h.G, rows, h.D}));
      accumulate(dk.narrow(1, 0, seen), g.ds.transpose(1, 2), qb);
    }
    return {dq.view({h.B, h.NH, h.T, h.D}), dk.to(dtype).view({h.B, h.NKV, h.T, h.D}),
            dv.to(dtype).view({h.B, h.NKV, h.T, h.D}), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t block_rows) {
  const Heads h = heads_of(q, k, v);
  const auto dtype = q.scalar_type();
  const bool on_kernels = q.device().is_cpu() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
                          k.scalar_type() == dtype && v.scalar_type() == dtype;
  if (!on_kernels || h.T == 0) return causal_attention_materialised(q, k, v);
  if (block_rows <= 0) block_rows = attention_chunk_rows(h.B * h.NH, h.T);
  return CausalAttention::apply(q, k, v, block_rows);
}

torch::Tensor causal_attention_materialised(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const std::function<torch::Tensor(const torch::Tensor&)>& drop) {
  const Heads h = heads_of(q, k, v);
  // Each kv head serves G consecutive query heads (Hugging Face's repeat_kv).
  const torch::Tensor kk = h.G > 1 ? k.repeat_interleave(h.G, 1) : k, vv = h.G > 1 ? v.repeat_interleave(h.G, 1) : v;
  const auto mask = torch::ones({h.T, h.T}, torch::kBool).triu(1);  // causal: -inf above the diagonal
  torch::Tensor att = torch::matmul(q, kk.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(h.D)));
  att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  if (drop) att = drop(att);
  return torch::matmul(att, vv).transpose(1, 2).contiguous();
}

}  // namespace ds
