#include "engine/runtime/model/fused_attention.hpp"

#include <torch/version.h>

#include <cmath>
#include <limits>

#include "common/error.hpp"
#include "engine/runtime/device/cpu_kernels_by_dtype.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Heads {
  int64_t B, NH, NKV, G, T, D;
  int64_t kv_batches() const { return B * NKV; }  // the batch of every bmm: one per (sample, kv head)
};

// q (B, T, NH, D), k and v (B, T, NKV, D).
Heads heads_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  DS_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "attention: q (B,T,NH,D), k and v (B,T,NKV,D)");
  const Heads h{q.size(0), q.size(2), k.size(2), 0, q.size(1), q.size(3)};
  DS_CHECK(k.size(0) == h.B && k.size(1) == h.T && k.size(3) == h.D && h.NKV > 0 && h.NH % h.NKV == 0,
           "attention: k and v must match q's batch, length and head size, with NH a multiple of NKV");
  return {h.B, h.NH, h.NKV, h.NH / h.NKV, h.T, h.D};
}

// A (B, T, NH, D) tensor of queries (or their gradient) seen as (B, NKV, G, T, D): each kv head's group.
torch::Tensor by_group(const torch::Tensor& x, const Heads& h) {
  return x.view({h.B, h.T, h.NKV, h.G, h.D}).permute({0, 2, 3, 1, 4});
}

// A (B, T, NKV, D) tensor of keys or values (or their gradient) seen as (B, NKV, T, D).
torch::Tensor by_head(const torch::Tensor& x) { return x.permute({0, 2, 1, 3}); }

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
  by_dtype(s, [&](auto* e) {
    using E = ElementOf<decltype(e)>;
    CpuKernels<E>::softmax_forward(raw<E>(s), raw<float>(lse), blk);
  });
}

void softmax_recompute(torch::Tensor& s, const torch::Tensor& lse, const kernels::CausalBlock& blk) {
  by_dtype(s, [&](auto* e) {
    using E = ElementOf<decltype(e)>;
    CpuKernels<E>::softmax_recompute(raw<E>(s), raw<float>(lse), blk);
  });
}

void softmax_backward(const torch::Tensor& p, torch::Tensor& dp, const kernels::CausalBlock& blk) {
  by_dtype(p, [&](auto* e) {
    using E = ElementOf<decltype(e)>;
    CpuKernels<E>::softmax_backward(raw<E>(p), raw<E>(dp), blk);
  });
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

// What forward keeps for backward, laid out for the bmms: q as (B*NKV, G, T, D), k and v as
// (B*NKV, T, D), and the fp32 log-sum-exp of every query row, (B*NKV, G, T).
struct Kept {
  torch::Tensor q, k, v, lse;
};

// Forward over q (B, T, NH, D), k and v (B, T, NKV, D) of any strides: returns y (B, T, NH, D), contiguous.
torch::Tensor attend(const Heads& h, const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                     int64_t block_rows, Kept& kept) {
  const int64_t BKV = h.kv_batches();
  const torch::Tensor q = by_group(q_in, h).contiguous().view({BKV, h.G, h.T, h.D});
  const torch::Tensor k = by_head(k_in).contiguous().view({BKV, h.T, h.D}), v = by_head(v_in).contiguous().view({BKV, h.T, h.D});
  const torch::Tensor k_t = transposed(k);
  torch::Tensor y = torch::empty({h.B, h.T, h.NH, h.D}, q.options());
  const torch::Tensor y_groups = by_group(y, h);
  torch::Tensor lse = torch::empty({BKV, h.G, h.T}, q.options().dtype(torch::kFloat32));
  for (int64_t first = 0; first < h.T; first += block_rows) {
    const int64_t rows = std::min(block_rows, h.T - first), seen = first + rows;
    const kernels::CausalBlock blk = block_of(h, first, rows);
    const torch::Tensor qb = q.narrow(2, first, rows).reshape({BKV, h.G * rows, h.D});
    torch::Tensor s = torch::bmm(qb, k_t.narrow(2, 0, seen));  // (BKV, G*rows, seen)
    torch::Tensor lse_b = torch::empty({blk.rows}, lse.options());
    softmax_forward(s, lse_b, blk);
    lse.narrow(2, first, rows).copy_(lse_b.view({BKV, h.G, rows}));
    y_groups.narrow(3, first, rows).copy_(torch::bmm(s, v.narrow(1, 0, seen)).view({h.B, h.NKV, h.G, rows, h.D}));
  }
  kept = {q, k, v, lse};
  return y;
}

// Backward: the gradients written into dq (B, T, NH, D), dk and dv (B, T, NKV, D), views of any
// strides (the packed form's are slices of one tensor), so no caller copies or sums them again.
void attend_backward(const Kept& kept, int64_t B, int64_t block_rows, const torch::Tensor& dy_in, const torch::Tensor& dq_out,
                     const torch::Tensor& dk_out, const torch::Tensor& dv_out) {
  const torch::Tensor &q = kept.q, &k = kept.k, &v = kept.v, &lse = kept.lse;
  const int64_t BKV = q.size(0), G = q.size(1);
  const Heads h{B, BKV / B * G, BKV / B, G, q.size(2), q.size(3)};
  const torch::Tensor dy = dy_in.to(q.scalar_type()).contiguous();
  const torch::Tensor k_t = transposed(k), v_t = transposed(v);
  const torch::Tensor dy_groups = by_group(dy, h), dq_groups = by_group(dq_out, h);
  auto as_heads = [&](const torch::Tensor& x) { return x.view({h.B, h.NKV, h.T, h.D}); };
  if (block_rows >= h.T) {  // one block (short sequences): every product is whole, nothing to sum
    const torch::Tensor qb = q.view({BKV, h.G * h.T, h.D}), dyb = dy_groups.reshape({BKV, h.G * h.T, h.D});
    const BlockGrads g = block_backward(qb, dyb, k_t, v_t, lse, block_of(h, 0, h.T));
    dq_groups.copy_(torch::bmm(g.ds, k).view({h.B, h.NKV, h.G, h.T, h.D}));
    by_head(dk_out).copy_(as_heads(torch::bmm(g.ds.transpose(1, 2), qb)));
    by_head(dv_out).copy_(as_heads(torch::bmm(g.p.transpose(1, 2), dyb)));
    return;
  }
  // Keys and values collect a term from every block below them: summed in fp32, rounded once.
  torch::Tensor dk = torch::zeros({BKV, h.T, h.D}, q.options().dtype(torch::kFloat32)), dv = torch::zeros_like(dk);
  for (int64_t first = 0; first < h.T; first += block_rows) {
    const int64_t rows = std::min(block_rows, h.T - first), seen = first + rows;
    const torch::Tensor qb = q.narrow(2, first, rows).reshape({BKV, h.G * rows, h.D});
    const torch::Tensor dyb = dy_groups.narrow(3, first, rows).reshape({BKV, h.G * rows, h.D});
    const BlockGrads g = block_backward(qb, dyb, k_t, v_t, lse.narrow(2, first, rows).contiguous(), block_of(h, first, rows));
    accumulate(dv.narrow(1, 0, seen), g.p.transpose(1, 2), dyb);
    dq_groups.narrow(3, first, rows).copy_(torch::bmm(g.ds, k.narrow(1, 0, seen)).view({h.B, h.NKV, h.G, rows, h.D}));
    accumulate(dk.narrow(1, 0, seen), g.ds.transpose(1, 2), qb);
  }
  by_head(dk_out).copy_(as_heads(dk));
  by_head(dv_out).copy_(as_heads(dv));
}

void keep(AutogradContext* ctx, const Kept& kept, int64_t B, int64_t block_rows) {
  ctx->save_for_backward({kept.q, kept.k, kept.v, kept.lse});
  ctx->saved_data["block_rows"] = block_rows;
  ctx->saved_data["batch"] = B;
}

Kept kept_of(AutogradContext* ctx) {
  const auto saved = ctx->get_saved_variables();
  return {saved[0], saved[1], saved[2], saved[3]};
}

// fp32 on a CPU with AVX-512, and bf16 on one with AMX or AVX512-BF16, go through
// kernels/cpu/attention_tiles instead of the blocks above: its own 64 x 64 tile products read q, k, v
// and write y and the gradients through their strides, and backward needs y (kept anyway: the output
// projection saves it as its input) instead of the blocks.
bool tiled(const torch::Tensor& x) {
  if (x.scalar_type() == torch::kFloat32) return kernels::causal_attention_tiles_available();
  return x.scalar_type() == torch::kBFloat16 && kernels::causal_attention_tiles_bf16_available();
}

// The kernels read d contiguously; anything else is copied once.
torch::Tensor rows_contiguous(const torch::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

// A (B, T, heads, D) tensor as the kernels' (B, NKV, G, T, D) heads: head = kv * group + g.
template <class T>
kernels::HeadViewOf<T> view_of(const torch::Tensor& x, int64_t group) {
  DS_CHECK(x.dim() == 4 && x.stride(3) == 1, "attention: the tiled kernels need (B, T, heads, D) with D contiguous");
  return {raw<T>(x), x.stride(0), group * x.stride(2), x.stride(2), x.stride(1)};
}

kernels::AttentionShape shape_of(const Heads& h) {
  return {h.B, h.NKV, h.G, h.T, h.D, static_cast<float>(1.0 / std::sqrt(double(h.D)))};
}

// Forward: y (B, T, NH, D) and the fp32 log-sum-exp of every query row, (B, NKV, G, T).
std::pair<torch::Tensor, torch::Tensor> attend_tiled(const Heads& h, const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v) {
  torch::Tensor y = torch::empty({h.B, h.T, h.NH, h.D}, q.options());
  torch::Tensor lse = torch::empty({h.B, h.NKV, h.G, h.T}, q.options().dtype(torch::kFloat32));
  by_dtype(q, [&](auto* e) {
    using E = ElementOf<decltype(e)>;
    CpuKernels<E>::attention_forward(shape_of(h), view_of<E>(q, h.G), view_of<E>(k, 1), view_of<E>(v, 1), view_of<E>(y, h.G),
                                     raw<float>(lse));
  });
  return {y, lse};
}

void attend_tiled_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& y,
                           const torch::Tensor& lse, const torch::Tensor& dy_in, const torch::Tensor& dq,
                           const torch::Tensor& dk, const torch::Tensor& dv) {
  const Heads h = heads_of(q, k, v);
  const torch::Tensor dy = rows_contiguous(dy_in.to(q.scalar_type()));
  by_dtype(q, [&](auto* e) {
    using E = ElementOf<decltype(e)>;
    CpuKernels<E>::attention_backward(shape_of(h), view_of<E>(q, h.G), view_of<E>(k, 1), view_of<E>(v, 1), view_of<E>(y, h.G),
                                      raw<float>(lse), view_of<E>(dy, h.G), view_of<E>(dq, h.G), view_of<E>(dk, 1), view_of<E>(dv, 1));
  });
}

class CausalAttention : public torch::autograd::Function<CausalAttention> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               int64_t block_rows) {
    const Heads h = heads_of(q, k, v);
    if (block_rows == 0) {  // the tiled kernels (see path_rows)
      const torch::Tensor qc = rows_contiguous(q), kc = rows_contiguous(k), vc = rows_contiguous(v);
      auto [y, lse] = attend_tiled(h, qc, kc, vc);
      ctx->save_for_backward({qc, kc, vc, y, lse});
      ctx->saved_data["tiled"] = true;
      return y;
    }
    Kept kept;
    torch::Tensor y = attend(h, q, k, v, block_rows, kept);
    keep(ctx, kept, h.B, block_rows);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    if (ctx->saved_data.count("tiled")) {
      const auto saved = ctx->get_saved_variables();
      const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
      torch::Tensor dq = torch::empty(q.sizes(), q.options()), dk = torch::empty(k.sizes(), k.options()), dv = torch::empty_like(dk);
      attend_tiled_backward(q, k, v, saved[3], saved[4], grad_out[0], dq, dk, dv);
      return {dq, dk, dv, torch::Tensor()};
    }
    const Kept kept = kept_of(ctx);
    const int64_t B = ctx->saved_data["batch"].toInt(), T = kept.q.size(2), D = kept.q.size(3);
    const int64_t NKV = kept.k.size(0) / B, NH = NKV * kept.q.size(1);
    const auto options = kept.q.options();
    torch::Tensor dq = torch::empty({B, T, NH, D}, options), dk = torch::empty({B, T, NKV, D}, options), dv = torch::empty_like(dk);
    attend_backward(kept, B, ctx->saved_data["block_rows"].toInt(), grad_out[0], dq, dk, dv);
    return {dq, dk, dv, torch::Tensor()};
  }
};

// The packed form: one (B, T, NH + 2 NKV, D) tensor in, one gradient of that shape out.
class CausalAttentionPacked : public torch::autograd::Function<CausalAttentionPacked> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& qkv, int64_t heads, int64_t block_rows) {
    const auto [q, k, v] = unpack(qkv, heads);
    const Heads h = heads_of(q, k, v);
    ctx->saved_data["heads"] = heads;
    if (block_rows == 0) {
      const torch::Tensor packed = rows_contiguous(qkv);
      const auto [pq, pk, pv] = unpack(packed, heads);
      auto [y, lse] = attend_tiled(h, pq, pk, pv);
      ctx->save_for_backward({packed, y, lse});
      ctx->saved_data["tiled"] = true;
      return y;
    }
    Kept kept;
    torch::Tensor y = attend(h, q, k, v, block_rows, kept);
    keep(ctx, kept, h.B, block_rows);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const int64_t heads = ctx->saved_data["heads"].toInt();
    if (ctx->saved_data.count("tiled")) {
      const auto saved = ctx->get_saved_variables();
      const torch::Tensor& qkv = saved[0];
      torch::Tensor dqkv = torch::empty(qkv.sizes(), qkv.options());
      const auto [q, k, v] = unpack(qkv, heads);
      const auto [dq, dk, dv] = unpack(dqkv, heads);
      attend_tiled_backward(q, k, v, saved[1], saved[2], grad_out[0], dq, dk, dv);
      return {dqkv, torch::Tensor(), torch::Tensor()};
    }
    const Kept kept = kept_of(ctx);
    const int64_t B = ctx->saved_data["batch"].toInt(), T = kept.q.size(2), D = kept.q.size(3);
    const int64_t all = heads + 2 * (kept.k.size(0) / B);
    torch::Tensor dqkv = torch::empty({B, T, all, D}, kept.q.options());
    const auto [dq, dk, dv] = unpack(dqkv, heads);
    attend_backward(kept, B, ctx->saved_data["block_rows"].toInt(), grad_out[0], dq, dk, dv);
    return {dqkv, torch::Tensor(), torch::Tensor()};
  }
};

// unpack's views with one gradient of the packed shape in backward (the three parts' gradients
// concatenated), where three narrows would each make a zeroed packed-size gradient for autograd to add.
class UnpackOneGradient : public torch::autograd::Function<UnpackOneGradient> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& qkv, int64_t heads) {
    const auto [q, k, v] = unpack(qkv, heads);
    ctx->saved_data["sizes"] = qkv.sizes();
    ctx->saved_data["heads"] = heads;
    return {q, k, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t heads = ctx->saved_data["heads"].toInt(), kv = (sizes[2] - heads) / 2;
    const int64_t widths[3] = {heads, kv, kv};
    torch::TensorOptions options;
    for (const torch::Tensor& g : grads)
      if (g.defined()) options = g.options();
    std::vector<torch::Tensor> parts;
    for (int i = 0; i < 3; ++i)
      parts.push_back(grads[i].defined() ? grads[i] : torch::zeros({sizes[0], sizes[1], widths[i], sizes[3]}, options));
    return {torch::cat(parts, 2), torch::Tensor()};
  }
};

// The rows per block the Functions get, 0 meaning the tiled kernels: asked-for blocks (> 0) are kept,
// else tiles where the CPU has them for the dtype, else blocks of attention_chunk_rows.
int64_t path_rows(const torch::Tensor& x, const Heads& h, int64_t block_rows) {
  if (block_rows > 0) return block_rows;
  return tiled(x) ? 0 : attention_chunk_rows(h.B * h.NH, h.T);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> unpack(const torch::Tensor& qkv, int64_t heads) {
  DS_CHECK(qkv.dim() == 4 && heads > 0 && qkv.size(2) > heads && (qkv.size(2) - heads) % 2 == 0,
           "attention: packed q, k, v must be (B, T, NH + 2 NKV, D) with NH = ", heads);
  const int64_t kv = (qkv.size(2) - heads) / 2;
  return {qkv.narrow(2, 0, heads), qkv.narrow(2, heads, kv), qkv.narrow(2, heads + kv, kv)};
}

namespace {
// q, k, v as (B, H, T, D) views, each kv head repeated for the G query heads it serves (Hugging Face's
// repeat_kv): the layout LibTorch's attention operations take.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> heads_first(const torch::Tensor& q, const torch::Tensor& k,
                                                                    const torch::Tensor& v, const Heads& h) {
  const torch::Tensor kh = k.transpose(1, 2), vh = v.transpose(1, 2);
  return {q.transpose(1, 2), h.G > 1 ? kh.repeat_interleave(h.G, 1) : kh, h.G > 1 ? vh.repeat_interleave(h.G, 1) : vh};
}

// Off the CPU: LibTorch's fused attention (flash or memory-efficient kernels on a GPU) where this LibTorch
// has it (2.0 on), the materialised reference otherwise.
torch::Tensor library_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  const Heads h = heads_of(q, k, v);
  if (h.T > 0 && !on_host(q)) {
    const auto [qh, kk, vv] = heads_first(q, k, v, h);
    return at::scaled_dot_product_attention(qh, kk, vv, {}, 0.0, /*is_causal=*/true).transpose(1, 2).contiguous();
  }
#endif
  return causal_attention_materialised(q, k, v);
}
}  // namespace

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t block_rows) {
  const Heads h = heads_of(q, k, v);
  if (!on_cpu_kernels(q) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type() || h.T == 0)
    return library_attention(q, k, v);
  return CausalAttention::apply(q, k, v, path_rows(q, h, block_rows));
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> unpack_one_gradient(const torch::Tensor& qkv, int64_t heads) {
  if (!torch::GradMode::is_enabled() || !qkv.requires_grad()) return unpack(qkv, heads);
  const variable_list parts = UnpackOneGradient::apply(qkv, heads);
  return {parts[0], parts[1], parts[2]};
}

torch::Tensor causal_attention_packed(const torch::Tensor& qkv, int64_t heads, int64_t block_rows) {
  const auto [q, k, v] = unpack(qkv, heads);
  const Heads h = heads_of(q, k, v);
  if (h.T == 0) return library_attention(q, k, v);
  if (!on_cpu_kernels(qkv)) {
    const auto [lq, lk, lv] = unpack_one_gradient(qkv, heads);
    return library_attention(lq, lk, lv);
  }
  return CausalAttentionPacked::apply(qkv, heads, path_rows(qkv, h, block_rows));
}

torch::Tensor causal_attention_materialised(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const std::function<torch::Tensor(const torch::Tensor&)>& drop, const AttentionForm& form) {
  const Heads h = heads_of(q, k, v);
  const auto [qh, kk, vv] = heads_first(q, k, v, h);
  const torch::Tensor ones = torch::ones({h.T, h.T}, torch::dtype(torch::kBool).device(q.device()));
  torch::Tensor mask = ones.triu(1);  // causal: -inf above the diagonal
  if (form.window > 0 && form.window < h.T) mask = mask.logical_or(ones.tril(-form.window));  // and W or more back
  const double scale = form.scale > 0 ? form.scale : 1.0 / std::sqrt(static_cast<double>(h.D));
  torch::Tensor att = torch::matmul(qh, kk.transpose(-2, -1)) * scale;
  if (form.softcap > 0) att = torch::tanh(att / form.softcap) * form.softcap;
  att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  if (drop) att = drop(att);
  return torch::matmul(att, vv).transpose(1, 2).contiguous();
}

}  // namespace ds
