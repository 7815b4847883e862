#include "engine/runtime/model/fused_ops.hpp"

#include "common/error.hpp"
#include "engine/runtime/device/cpu_kernels_by_dtype.hpp"
#include "engine/runtime/device/kernel_route.hpp"
#include "engine/runtime/model/matmul.hpp"
#include "kernels/cpu/dropout.hpp"
#include "kernels/dropout_mask.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the norms' autograd nodes share: the forward on ds's kernels for x's device, what it keeps for the backward,
// and the backward from it. rms: RMSNorm (b undefined).
struct NormForward {
  torch::Tensor y, mean, rstd;
};

// The norm of x (contiguous) on ds's kernels for its device. With `residual` (a GPU's only) the kernel normalises
// x + residual and writes that sum to `sum`.
NormForward norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps,
                         const torch::Tensor& residual = {}, const torch::Tensor& sum = {}) {
  const int64_t C = x.size(-1);
  const kernels::NormShape shape{x.numel() / C, C, static_cast<float>(eps), !b.defined()};
  NormForward f{torch::empty_like(x), torch::empty({shape.rows}, x.options().dtype(torch::kFloat32)), {}};
  f.rstd = torch::empty_like(f.mean);
  if (kernel_route(x) == KernelRoute::cuda)
    cuda_norm_forward(x, w, b, f.y, f.mean, f.rstd, shape, residual, sum);
  else
    by_dtype(x, [&](auto* e) {
      using E = ElementOf<decltype(e)>;
      CpuKernels<E>::norm_forward(raw<E>(x), raw<E>(w), raw<E>(b), raw<E>(f.y), raw<float>(f.mean), raw<float>(f.rstd), shape);
    });
  return f;
}

// x is the tensor the norm read.
void save_norm(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, const NormForward& f, double eps, bool bias) {
  ctx->save_for_backward({x, w});
  ctx->saved_data["mean"] = f.mean;
  ctx->saved_data["rstd"] = f.rstd;
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["bias"] = bias;
}

struct NormGrads {
  torch::Tensor dx, dw, db;  // dw and db in w's dtype; db undefined for RMSNorm
};

// From what save_norm kept: dx from dy, and with `dsum` (the gradient x's other reader gave it) dx + dsum as autograd
// adds two gradients of one tensor (the GPU's kernel adds it in its dx pass).
NormGrads norm_backward(AutogradContext* ctx, const torch::Tensor& dy_in, const torch::Tensor& dsum_in) {
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor& x = saved[0];
  const torch::Tensor& w = saved[1];
  const torch::Tensor mean = ctx->saved_data["mean"].toTensor(), rstd = ctx->saved_data["rstd"].toTensor();
  const bool bias = ctx->saved_data["bias"].toBool();
  const torch::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  const torch::Tensor dsum = dsum_in.defined() ? dsum_in.to(x.scalar_type()).contiguous() : torch::Tensor();
  const int64_t C = x.size(-1);
  const kernels::NormShape shape{x.numel() / C, C, static_cast<float>(ctx->saved_data["eps"].toDouble()), !bias};
  torch::Tensor dx = torch::empty_like(x);
  torch::Tensor dw = torch::zeros({C}, x.options().dtype(torch::kFloat32));
  torch::Tensor db = bias ? torch::zeros_like(dw) : torch::Tensor();
  if (kernel_route(x) == KernelRoute::cuda) {
    cuda_norm_backward(dy, x, w, mean, rstd, dx, dw, db, shape, dsum);
  } else {
    by_dtype(x, [&](auto* e) {
      using E = ElementOf<decltype(e)>;
      CpuKernels<E>::norm_backward(raw<E>(dy), raw<E>(x), raw<E>(w), raw<float>(mean), raw<float>(rstd), raw<E>(dx), raw<float>(dw),
                                   raw<float>(db), shape);
    });
    if (dsum.defined()) dx.add_(dsum);
  }
  return {dx, dw.to(w.scalar_type()), bias ? db.to(w.scalar_type()) : torch::Tensor()};
}

class Norm : public torch::autograd::Function<Norm> {
 public:
  // rms: RMSNorm, b is not read (autograd takes no undefined inputs: the callers pass w again).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& w_in,
                               const torch::Tensor& b_in, double eps, bool rms) {
    const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = rms ? torch::Tensor() : b_in.contiguous();
    const NormForward f = norm_forward(x, w, b, eps);
    save_norm(ctx, x, w, f, eps, b.defined());
    return f.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const NormGrads g = norm_backward(ctx, grad_out[0], {});
    return {g.dx, g.dw, g.db, torch::Tensor(), torch::Tensor()};
  }
};

// x + r, then normalised: {sum, norm(sum)}; without r ({x, norm(x)}) x is passed on beside its norm. Either way the
// two outputs' gradients meet in this node's backward: one kernel each way on a GPU (kernels/cuda/norm.hpp's
// residual forms), where the add and the norm apart are two and autograd adds the sum's two gradients in a third;
// on the host the add, the norm's kernels, then dx + dsum. The same values either way, and the same as the add and
// the norm apart (the sum rounded before its statistics; in backward the norm's dx rounded before the sum's other
// gradient is added, as autograd adds them). rms: RMSNorm, b not read (the callers pass w again); without a
// residual the callers pass x again as r.
class AddNorm : public torch::autograd::Function<AddNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& r_in, const torch::Tensor& w_in,
                               const torch::Tensor& b_in, double eps, bool rms, bool has_residual) {
    const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = rms ? torch::Tensor() : b_in.contiguous();
    // Without a residual x is passed on (an input returned: autograd makes it a view whose gradient comes here).
    torch::Tensor sum = x;
    NormForward f;
    if (has_residual && kernel_route(x) == KernelRoute::cuda) {
      sum = torch::empty_like(x);
      f = norm_forward(x, w, b, eps, r_in.contiguous(), sum);
    } else {
      if (has_residual) sum = x + r_in;
      f = norm_forward(sum, w, b, eps);
    }
    save_norm(ctx, sum, w, f, eps, b.defined());
    ctx->saved_data["residual"] = has_residual;
    return {sum, f.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    // (autograd hands zeros for an output nobody read)
    const NormGrads g = norm_backward(ctx, grad_out[1], grad_out[0]);
    // x's gradient and r's are one tensor (both entered the sum once).
    const bool residual = ctx->saved_data["residual"].toBool();
    return {g.dx, residual ? g.dx : torch::Tensor(), g.dw, g.db, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class GeluTanh : public torch::autograd::Function<GeluTanh> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in) {
    const torch::Tensor x = x_in.contiguous();
    torch::Tensor y = torch::empty_like(x);
    if (kernel_route(x) == KernelRoute::cuda)
      cuda_gelu_tanh_forward(x, y);
    else
      by_dtype(x, [&](auto* e) {
        using E = ElementOf<decltype(e)>;
        CpuKernels<E>::gelu_tanh_forward(raw<E>(x), raw<E>(y), x.numel());
      });
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor dy = grad_out[0].to(x.scalar_type()).contiguous();
    torch::Tensor dx = torch::empty_like(x);
    if (kernel_route(x) == KernelRoute::cuda)
      cuda_gelu_tanh_backward(dy, x, dx);
    else
      by_dtype(x, [&](auto* e) {
        using E = ElementOf<decltype(e)>;
        CpuKernels<E>::gelu_tanh_backward(raw<E>(dy), raw<E>(x), raw<E>(dx), x.numel());
      });
    return {dx};
  }
};

class SwiGlu : public torch::autograd::Function<SwiGlu> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& g_in, const torch::Tensor& u_in) {
    const torch::Tensor g = g_in.contiguous(), u = u_in.contiguous();
    torch::Tensor y = torch::empty_like(g);
    if (kernel_route(g) == KernelRoute::cuda)
      cuda_swiglu_forward(g, u, y);
    else
      by_dtype(g, [&](auto* e) {
        using E = ElementOf<decltype(e)>;
        CpuKernels<E>::swiglu_forward(raw<E>(g), raw<E>(u), raw<E>(y), g.numel());
      });
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &g = saved[0], &u = saved[1];
    const torch::Tensor dy = grad_out[0].to(g.scalar_type()).contiguous();
    torch::Tensor dg = torch::empty_like(g), du = torch::empty_like(u);
    if (kernel_route(g) == KernelRoute::cuda)
      cuda_swiglu_backward(dy, g, u, dg, du);
    else
      by_dtype(g, [&](auto* e) {
        using E = ElementOf<decltype(e)>;
        CpuKernels<E>::swiglu_backward(raw<E>(dy), raw<E>(g), raw<E>(u), raw<E>(dg), raw<E>(du), g.numel());
      });
    return {dg, du};
  }
};

class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});  // not x: the backward is a rotation of the gradient alone
    return rotate(x_in, cos, sin, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    return {rotate(grad_out[0], saved[0], saved[1], true), torch::Tensor(), torch::Tensor()};
  }

 private:
  // On a GPU x is read where it lies when its D elements are contiguous (a gradient that comes transposed is not
  // copied first); the CPU's kernels read it packed.
  static torch::Tensor rotate(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin, bool inverse) {
    const bool gpu = kernel_route(x_in) == KernelRoute::cuda;
    const torch::Tensor x = gpu && x_in.stride(3) == 1 ? x_in : x_in.contiguous();
    const kernels::RopeShape shape{x.size(0) * x.size(1), x.size(1), x.size(2), x.size(3), inverse};
    torch::Tensor y = torch::empty(x.sizes(), x.options());
    if (gpu)
      cuda_rope(x, y, cos, sin, shape);
    else
      by_dtype(x, [&](auto* e) {
        using E = ElementOf<decltype(e)>;
        CpuKernels<E>::rope(raw<E>(x), raw<E>(y), raw<float>(cos), raw<float>(sin), shape);
      });
    return y;
  }
};

class Embedding : public torch::autograd::Function<Embedding> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& weight, const torch::Tensor& ids) {
    ctx->save_for_backward({ids});
    ctx->saved_data["weight"] = weight;  // the parameter itself (a leaf: no cycle), for its gradient buffer
    return torch::embedding(weight, ids);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const torch::Tensor ids = ctx->get_saved_variables()[0].contiguous();
    const torch::Tensor weight = ctx->saved_data["weight"].toTensor();
    const int64_t V = weight.size(0), C = weight.size(1), n = ids.numel();
    const torch::Tensor dy = grad_out[0].to(weight.scalar_type()).reshape({n, C}).contiguous();
    torch::Tensor g = bound_gradient(weight);
    if (!g.defined()) return {torch::embedding_dense_backward(dy, ids.reshape({n}), V, -1, false), torch::Tensor()};
    by_dtype(g, [&](auto* e) {
      using E = ElementOf<decltype(e)>;
      CpuKernels<E>::embedding_backward(raw<E>(g), ids.data_ptr<int64_t>(), raw<E>(dy), n, C);
    });
    return {torch::Tensor(), torch::Tensor()};  // already in the gradient: nothing for autograd to add
  }
};

// y = x w^T + b, or x w + b with `in_out`; b may be undefined. Shared by the two Functions below
// (autograd's Functions take no undefined tensor inputs).
torch::Tensor project(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                      bool in_out) {
  const torch::Tensor x2 = x.reshape({-1, x.size(-1)});
  const torch::Tensor wm = in_out ? w : w.t();  // (in, out)
  torch::Tensor y;
  if (b.defined() && !on_host(x2)) {
    y = at::addmm(b, x2, wm);  // a GPU's cuBLASLt adds the bias in the product's epilogue: no copy of it first
  } else {
    y = torch::empty({x2.size(0), wm.size(1)}, x2.options());
    if (b.defined()) y.copy_(b.expand_as(y));  // then the product adds into the bias
    matmul_into(y, x2, wm, b.defined());
  }
  ctx->save_for_backward({x2});
  ctx->saved_data["x_shape"] = x.sizes();
  ctx->saved_data["weight"] = w;  // the parameters themselves (leaves: no cycle), for their gradient buffers
  if (b.defined()) ctx->saved_data["bias"] = b;
  ctx->saved_data["in_out"] = in_out;
  auto shape = x.sizes().vec();
  shape.back() = wm.size(1);
  return y.view(shape);
}

// {dx, dw, db}: dw and db undefined where they went into the parameters' gradient buffers.
variable_list project_backward(AutogradContext* ctx, const torch::Tensor& grad, bool want_dx, bool want_dw, bool want_db) {
  const torch::Tensor x2 = ctx->get_saved_variables()[0];
  const torch::Tensor w = ctx->saved_data["weight"].toTensor();
  const bool in_out = ctx->saved_data["in_out"].toBool();
  const torch::Tensor dy = grad.reshape({x2.size(0), -1});
  variable_list out(3);
  if (want_dx) out[0] = matmul_new(dy, in_out ? w.t() : w).view(ctx->saved_data["x_shape"].toIntVector());
  if (want_dw) {  // x^T dy (in, out) or dy^T x (out, in), added into the buffer by the GEMM itself
    torch::Tensor g = bound_gradient(w);
    if (g.defined())
      in_out ? matmul_into(g, x2.t(), dy, true) : matmul_into(g, dy.t(), x2, true);
    else
      out[1] = in_out ? matmul_new(x2.t(), dy) : matmul_new(dy.t(), x2);
  }
  if (want_db && ctx->saved_data.count("bias")) {
    torch::Tensor g = bound_gradient(ctx->saved_data["bias"].toTensor());
    if (g.defined() && kernel_route(g) == KernelRoute::cuda && dy.scalar_type() == g.scalar_type() && dy.size(1) > 0)
      cuda_column_sums_add(dy.contiguous(), g);  // one pass over dy, summed in fp32 and rounded once
    else if (g.defined())
      g.add_(dy.sum(0));
    else
      out[2] = dy.sum(0);
  }
  return out;
}

class Projection : public torch::autograd::Function<Projection> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                               bool in_out) {
    return project(ctx, x, w, b, in_out);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto g = project_backward(ctx, grad_out[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    return {g[0], g[1], g[2], torch::Tensor()};
  }
};

class ProjectionNoBias : public torch::autograd::Function<ProjectionNoBias> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, bool in_out) {
    return project(ctx, x, w, torch::Tensor(), in_out);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto g = project_backward(ctx, grad_out[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1), false);
    return {g[0], g[1], torch::Tensor()};
  }
};

// A LoRA-adapted projection of a frozen base, one autograd node: y = x W^T (+ b) + scale (d A^T) B^T, d = x or x
// with LoRA's dropout. Each scale rides in a GEMM's alpha and each sum in its beta, so the adapter adds no
// elementwise kernel: forward three GEMMs (the adapter's product added into y), backward at most five (without
// dropout dx's two parts summed by the second, A's and B's gradients scaled and added into their buffers by theirs).
// Composed of separate ops it took three more kernels an adapted projection a micro step (the add, its scaling in
// backward, dx's sum), and on a GPU LoRA's step is bound by launching them. Autograd takes no undefined inputs:
// `w` stands in for an absent bias or dropped input (`has_bias`, `has_dropped`).
class LoraProjection : public torch::autograd::Function<LoraProjection> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& dropped, const torch::Tensor& w,
                               const torch::Tensor& b, const torch::Tensor& a, const torch::Tensor& bm, double scale, bool has_bias,
                               bool has_dropped, bool in_out) {
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)});
    const torch::Tensor d2 = has_dropped ? dropped.reshape({-1, x.size(-1)}) : x2;
    const torch::Tensor wm = in_out ? w : w.t();  // (in, out)
    torch::Tensor y = has_bias ? at::addmm(b, x2, wm) : matmul_new(x2, wm);
    const torch::Tensor low = matmul_new(d2, a.t());  // (rows, r)
    y.addmm_(low, bm.t(), 1.0, scale);
    ctx->save_for_backward({d2, low});
    ctx->saved_data["x_shape"] = x.sizes();
    ctx->saved_data["weight"] = w;  // parameters (leaves: no cycle)
    ctx->saved_data["a"] = a;
    ctx->saved_data["b"] = bm;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_dropped"] = has_dropped;
    ctx->saved_data["in_out"] = in_out;
    auto shape = x.sizes().vec();
    shape.back() = wm.size(1);
    return y.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &d2 = saved[0], &low = saved[1];
    const torch::Tensor w = ctx->saved_data["weight"].toTensor(), a = ctx->saved_data["a"].toTensor(),
                        bm = ctx->saved_data["b"].toTensor();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool has_dropped = ctx->saved_data["has_dropped"].toBool();
    const auto x_shape = ctx->saved_data["x_shape"].toIntVector();
    const torch::Tensor dy = grad_out[0].to(d2.scalar_type()).reshape({d2.size(0), -1});
    variable_list out(10);
    const bool want_dx = ctx->needs_input_grad(0), want_dd = has_dropped && ctx->needs_input_grad(1);
    const bool want_da = ctx->needs_input_grad(4), want_db = ctx->needs_input_grad(5);
    torch::Tensor dx;
    if (want_dx) dx = matmul_new(dy, ctx->saved_data["in_out"].toBool() ? w.t() : w);
    if ((want_dx && !has_dropped) || want_dd || want_da) {
      const torch::Tensor dlow = matmul_new(dy, bm);  // (rows, r), not yet scaled
      if (want_dx && !has_dropped) dx.addmm_(dlow, a, 1.0, scale);
      if (want_dd) out[1] = matmul_new(dlow, a).mul_(scale).view(x_shape);  // through the dropout's own backward
      if (want_da) out[4] = scaled_product_into(bound_gradient(a), dlow.t(), d2, scale);
    }
    if (want_dx) out[0] = dx.view(x_shape);
    if (want_db) out[5] = scaled_product_into(bound_gradient(bm), dy.t(), low, scale);
    return out;
  }

 private:
  // scale p q added into the gradient buffer g (nothing for autograd then), or a new tensor where there is none.
  static torch::Tensor scaled_product_into(const torch::Tensor& g, const torch::Tensor& p, const torch::Tensor& q, double scale) {
    if (g.defined()) {
      torch::Tensor buffer = g;
      buffer.addmm_(p, q, 1.0, scale);
      return {};
    }
    return matmul_new(p, q).mul_(scale);
  }
};

// x with the mask of `key` applied, no autograd: ds's kernel where there is one for x's device and dtype (fp16
// on a GPU included); else (fp16 on the host, fp64, a GPU build without ds's CUDA kernels) the mask made by the
// fp32 kernel (on x's GPU where ds has kernels there, else on the host) and applied in x's dtype on x's device (x times the kept 0/1, then
// the scale: one rounding, as the kernels), a chunk of elements at a time: the fp32 mask and its conversions take
// about 11 bytes an element, which over attention's probabilities would be more than the plan counts.
torch::Tensor apply_dropout(const torch::Tensor& x_in, double p, uint64_t key) {
  const torch::Tensor x = x_in.contiguous();
  const uint32_t keep_below = kernels::dropout_keep_below(p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  const KernelRoute route = kernel_route(x);
  if (route != KernelRoute::libtorch) {
    torch::Tensor y = torch::empty_like(x);
    if (route == KernelRoute::cuda) {
      cuda_dropout(x, y, key, keep_below, scale);
    } else if (x.scalar_type() == torch::kFloat32) {
      kernels::dropout_f32(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), key, keep_below, scale);
    } else {
      kernels::dropout_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), x.numel(), key, keep_below, scale);
    }
    return y;
  }
  // The mask drawn in fp32 where a kernel draws it: on x's device when ds has one there (fp64 on a GPU), else on the
  // host (fp16 there never reaches this: the host computes no fp16). A chunk from element `at` on is keyed key + at strides: its elements' masks are the whole tensor's.
  constexpr int64_t kChunk = int64_t{1} << 18;
  torch::Tensor ones = torch::ones({std::min(kChunk, x.numel())}, torch::TensorOptions(torch::kFloat32).device(x.device()));
  if (kernel_route(ones) == KernelRoute::libtorch) ones = torch::ones({ones.numel()}, torch::kFloat32);
  const torch::Tensor y = torch::empty_like(x), flat_x = x.view({-1}), flat_y = y.view({-1});
  for (int64_t at = 0; at < x.numel(); at += kChunk) {
    const int64_t n = std::min(kChunk, x.numel() - at);
    const uint64_t chunk_key = key + static_cast<uint64_t>(at) * kernels::kDropoutStride;
    const torch::Tensor keep = apply_dropout(ones.narrow(0, 0, n), p, chunk_key).ne(0);
    flat_y.narrow(0, at, n).copy_(flat_x.narrow(0, at, n) * keep.to(x.device(), x.scalar_type()) * (1.0 / (1.0 - p)));
  }
  return y;
}

class HashedDropout : public torch::autograd::Function<HashedDropout> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, double p, int64_t key) {
    ctx->saved_data["p"] = p;
    ctx->saved_data["key"] = key;
    return apply_dropout(x, p, static_cast<uint64_t>(key));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto key = static_cast<uint64_t>(ctx->saved_data["key"].toInt());
    return {apply_dropout(grad_out[0], ctx->saved_data["p"].toDouble(), key), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor hashed_dropout(const torch::Tensor& x, double p, uint64_t key) {
  DS_CHECK(p > 0 && p < 1, "dropout probability ", p, " is outside (0, 1)");
  return HashedDropout::apply(x, p, static_cast<int64_t>(key));
}

torch::Tensor bound_gradient(const torch::Tensor& param) {
  // (a weight that passed through an op, as LoRA's A entering a tensor group does, has no buffer of its own: its
  // gradient flows back through that op)
  if (!param.defined() || !param.is_leaf()) return {};
  torch::Tensor g = param.grad();
  const bool usable = g.defined() && g.is_contiguous() && g.scalar_type() == param.scalar_type() && g.sizes() == param.sizes();
  return usable ? g : torch::Tensor();
}

torch::Tensor projection(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool in_out) {
  return b.defined() ? Projection::apply(x, w, b, in_out) : ProjectionNoBias::apply(x, w, in_out);
}

torch::Tensor lora_projection(const torch::Tensor& x, const torch::Tensor& dropped, const torch::Tensor& w, const torch::Tensor& b,
                              const torch::Tensor& a, const torch::Tensor& bm, double scale, bool in_out) {
  DS_CHECK(!w.requires_grad() && !(b.defined() && b.requires_grad()),
           "lora_projection: the base weight and bias are frozen (a trained base takes projection() and its adapter apart)");
  DS_CHECK(!dropped.defined() || dropped.sizes() == x.sizes(), "lora_projection: the dropped input is x's shape");
  return LoraProjection::apply(x, dropped.defined() ? dropped : w, w, b.defined() ? b : w, a, bm, scale, b.defined(), dropped.defined(),
                               in_out);
}

namespace {

// ds's norm kernels take x, w (and b) of one dtype and device: the host's (kernels/cpu) or a GPU's (kernels/cuda);
// a last dimension of 0 (nothing to normalise over) is LibTorch's.
bool on_norm_kernels(const torch::Tensor& x, const torch::Tensor& w) {
  return kernel_route(x) != KernelRoute::libtorch && x.dim() > 0 && x.size(-1) > 0 && w.scalar_type() == x.scalar_type() &&
         w.device() == x.device();
}

// r can be added to x element by element as the residual kernels read it: same dtype, device and shape.
bool same_tensor_kind(const torch::Tensor& x, const torch::Tensor& r) {
  return r.scalar_type() == x.scalar_type() && r.device() == x.device() && r.sizes() == x.sizes();
}

}  // namespace

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
  if (!on_norm_kernels(x, w) || !on_norm_kernels(x, b))
    return torch::layer_norm(x, {x.size(-1)}, w, b, eps);
  return Norm::apply(x, w, b, eps, false);
}

std::pair<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w,
                                                       const torch::Tensor& b, double eps) {
  if (!on_norm_kernels(x, w) || !on_norm_kernels(x, b) || !same_tensor_kind(x, r)) {
    const torch::Tensor sum = x + r;
    return {sum, layer_norm(sum, w, b, eps)};
  }
  const variable_list out = AddNorm::apply(x, r, w, b, eps, false, true);
  return {out[0], out[1]};
}

std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps) {
  if (!on_norm_kernels(x, w) || !same_tensor_kind(x, r)) {
    const torch::Tensor sum = x + r;
    return {sum, rms_norm(sum, w, eps)};
  }
  const variable_list out = AddNorm::apply(x, r, w, w, eps, true, true);
  return {out[0], out[1]};
}

std::pair<torch::Tensor, torch::Tensor> layer_norm_beside(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
  if (!on_norm_kernels(x, w) || !on_norm_kernels(x, b) || !x.requires_grad()) return {x, layer_norm(x, w, b, eps)};
  const variable_list out = AddNorm::apply(x, x, w, b, eps, false, false);
  return {out[0], out[1]};
}

std::pair<torch::Tensor, torch::Tensor> rms_norm_beside(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  if (!on_norm_kernels(x, w) || !x.requires_grad()) return {x, rms_norm(x, w, eps)};
  const variable_list out = AddNorm::apply(x, x, w, w, eps, true, false);
  return {out[0], out[1]};
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  if (!on_norm_kernels(x, w)) {
    const torch::Tensor xf = x.to(torch::kFloat32);
    return w * (xf * inverse_rms(xf, eps)).to(x.scalar_type());
  }
  return Norm::apply(x, w, w, eps, true);
}

torch::Tensor inverse_rms(const torch::Tensor& xf, double eps) {
  return torch::rsqrt(xf.pow(2).sum(-1, true) / static_cast<double>(xf.size(-1)) + eps);
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (kernel_route(x) == KernelRoute::libtorch) return torch::gelu(x, "tanh");
  return GeluTanh::apply(x);
}

torch::Tensor ids_to_device(const torch::Tensor& ids, const torch::Device& device) {
  const torch::Tensor ids64 = ids.to(torch::kLong);
  if (on_host(device) || !on_host(ids)) return ids64.to(device);
  return ids64.pin_memory().to(device, /*non_blocking=*/true);  // the pinned block is kept until the copy ran
}

torch::Tensor embedding_lookup(const torch::Tensor& weight, const torch::Tensor& ids) {
  // The batch's ids come from the host: a GPU's weights look them up on the GPU.
  if (!on_cpu_kernels(weight) || weight.dim() != 2 || ids.scalar_type() != torch::kLong)
    return torch::embedding(weight, ids_to_device(ids, weight.device()));
  return Embedding::apply(weight, ids);
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  DS_CHECK(x.dim() == 4, "rotary: x (B, T, heads, D)");
  const int64_t T = x.size(1), half = x.size(3) / 2;
  DS_CHECK(x.size(3) % 2 == 0 && cos.sizes() == torch::IntArrayRef({T, half}) && sin.sizes() == cos.sizes() &&
               cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
           "rotary: x (B, T, heads, even D), fp32 cos and sin (T, D/2)");
  if (kernel_route(x) != KernelRoute::libtorch && cos.is_contiguous() && sin.is_contiguous() && cos.device() == x.device() &&
      sin.device() == x.device())
    return Rotary::apply(x, cos, sin);
  // Hugging Face's formula: the tables duplicated to D and cast to x's dtype.
  const auto table = [&](const torch::Tensor& t) { return torch::cat({t, t}, -1).to(x.device(), x.scalar_type()).view({T, 1, 2 * half}); };
  const torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * table(cos) + rotated * table(sin);
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (kernel_route(gate) == KernelRoute::libtorch || up.scalar_type() != gate.scalar_type() || up.sizes() != gate.sizes() ||
      up.device() != gate.device())
    return torch::silu(gate) * up;
  return SwiGlu::apply(gate, up);
}

}  // namespace ds
