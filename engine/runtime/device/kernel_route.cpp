#include "engine/runtime/device/kernel_route.hpp"

#include <initializer_list>

#include "common/error.hpp"
#ifdef DS_WITH_CUDA_KERNELS
#include "kernels/cuda/activation.hpp"
#include "kernels/cuda/cross_entropy.hpp"
#include "kernels/cuda/dropout.hpp"
#include "kernels/cuda/norm.hpp"
#include "kernels/cuda/rope.hpp"
#endif

namespace ds {

bool on_host(const torch::Device& d) { return d.is_cpu(); }
bool on_host(const torch::Tensor& x) { return on_host(x.device()); }

KernelRoute kernel_route(const torch::Tensor& x) {
  const auto dtype = x.scalar_type();
  const bool fp32_or_bf16 = dtype == torch::kFloat32 || dtype == torch::kBFloat16;
  if (on_host(x)) return fp32_or_bf16 ? KernelRoute::host : KernelRoute::libtorch;
#ifdef DS_WITH_CUDA_KERNELS
  // A GPU's kernels take fp16 too (the host's do not: fp16 is computed only where the device computes it).
  if (x.is_cuda() && (fp32_or_bf16 || dtype == torch::kHalf)) return KernelRoute::cuda;
#endif
  return KernelRoute::libtorch;
}

GradElements grad_elements_of(const torch::Tensor& grads) {
  switch (grads.scalar_type()) {
    case torch::kFloat32: return GradElements::f32;
    case torch::kBFloat16: return GradElements::bf16;
    case torch::kFloat16: return GradElements::fp16;
    default: DS_CHECK(false, "the optimizers' kernels read fp32, bf16 or fp16 gradients, not ", grads.scalar_type());
  }
  return GradElements::f32;
}

namespace {

void check_cuda_route(const torch::Tensor& x, const char* op) {
  DS_CHECK(kernel_route(x) == KernelRoute::cuda, op, ": a ", x.scalar_type(), " tensor on ", x.device(), " is not kernels/cuda's");
}

// x and every tensor of `like_x` (y; dy, dx) of x's dtype, device and size; w and b (undefined for RMSNorm) one a
// column; mean and rstd one fp32 a row; all contiguous.
void check_norm_tensors(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                        std::initializer_list<const torch::Tensor*> like_x, const torch::Tensor& mean, const torch::Tensor& rstd,
                        const kernels::NormShape& s) {
  const auto same_kind = [&](const torch::Tensor& t) {
    return t.is_contiguous() && t.scalar_type() == x.scalar_type() && t.device() == x.device();
  };
  DS_CHECK(same_kind(x) && x.numel() == s.rows * s.cols, "norm: x contiguous, holding rows x cols");
  for (const torch::Tensor* t : like_x) DS_CHECK(same_kind(*t) && t->numel() == x.numel(), "norm: y (dy, dx) like x");
  DS_CHECK(same_kind(w) && w.numel() == s.cols && (!b.defined() || (same_kind(b) && b.numel() == s.cols)),
           "norm: w (and b) of x's dtype and device, one a column");
  for (const torch::Tensor* stat : {&mean, &rstd})
    DS_CHECK(stat->scalar_type() == torch::kFloat32 && stat->is_contiguous() && stat->numel() == s.rows && stat->device() == x.device(),
             "norm: mean and rstd one fp32 a row, contiguous, on x's device");
}

void check_elementwise(std::initializer_list<const torch::Tensor*> ts, const char* op) {
  const torch::Tensor& x = **ts.begin();
  check_cuda_route(x, op);
  for (const torch::Tensor* t : ts)
    DS_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->device() == x.device() && t->numel() == x.numel(), op,
             ": contiguous tensors of one dtype, device and size");
}

#ifdef DS_WITH_CUDA_KERNELS
namespace kc = kernels::cuda;

// kernels/cuda's entry points for one element type, E the type its pointers take (bf16 and fp16 both pass their
// bits as uint16_t: the entry points' names tell them apart), looked up once by dtype instead of an if per op.
struct CudaF32 {
  using E = float;
  static constexpr auto norm_forward = kc::norm_forward_f32;
  static constexpr auto norm_backward = kc::norm_backward_f32;
  static constexpr auto column_sums_add = kc::column_sums_add_f32;
  static constexpr auto dropout = kc::dropout_f32;
  static constexpr auto softmax_cross_entropy = kc::softmax_cross_entropy_f32;
  static constexpr auto gelu_tanh_forward = kc::gelu_tanh_forward_f32;
  static constexpr auto gelu_tanh_backward = kc::gelu_tanh_backward_f32;
  static constexpr auto swiglu_forward = kc::swiglu_forward_f32;
  static constexpr auto swiglu_backward = kc::swiglu_backward_f32;
  static constexpr auto rope = kc::rope_f32;
};
struct CudaBf16 {
  using E = uint16_t;
  static constexpr auto norm_forward = kc::norm_forward_bf16;
  static constexpr auto norm_backward = kc::norm_backward_bf16;
  static constexpr auto column_sums_add = kc::column_sums_add_bf16;
  static constexpr auto dropout = kc::dropout_bf16;
  static constexpr auto softmax_cross_entropy = kc::softmax_cross_entropy_bf16;
  static constexpr auto gelu_tanh_forward = kc::gelu_tanh_forward_bf16;
  static constexpr auto gelu_tanh_backward = kc::gelu_tanh_backward_bf16;
  static constexpr auto swiglu_forward = kc::swiglu_forward_bf16;
  static constexpr auto swiglu_backward = kc::swiglu_backward_bf16;
  static constexpr auto rope = kc::rope_bf16;
};
struct CudaFp16 {
  using E = uint16_t;
  static constexpr auto norm_forward = kc::norm_forward_fp16;
  static constexpr auto norm_backward = kc::norm_backward_fp16;
  static constexpr auto column_sums_add = kc::column_sums_add_fp16;
  static constexpr auto dropout = kc::dropout_fp16;
  static constexpr auto softmax_cross_entropy = kc::softmax_cross_entropy_fp16;
  static constexpr auto gelu_tanh_forward = kc::gelu_tanh_forward_fp16;
  static constexpr auto gelu_tanh_backward = kc::gelu_tanh_backward_fp16;
  static constexpr auto swiglu_forward = kc::swiglu_forward_fp16;
  static constexpr auto swiglu_backward = kc::swiglu_backward_fp16;
  static constexpr auto rope = kc::rope_fp16;
};

// Calls f with the entry points for x's dtype (checked by the caller: check_cuda_route).
template <class F>
void by_cuda_dtype(const torch::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case torch::kFloat32: return f(CudaF32{});
    case torch::kBFloat16: return f(CudaBf16{});
    case torch::kHalf: return f(CudaFp16{});
    default: DS_CHECK(false, "kernels/cuda take fp32, bf16 or fp16, not ", x.scalar_type());
  }
}

// A tensor's data as E* (null where undefined).
template <class E>
E* data(const torch::Tensor& t) {
  return t.defined() ? static_cast<E*>(t.data_ptr()) : nullptr;
}
#endif

}  // namespace

// (Without kernels/cuda these are never reached: kernel_route sends nothing there, and check_cuda_route refuses.)

void cuda_norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& y,
                       const torch::Tensor& mean, const torch::Tensor& rstd, const kernels::NormShape& s, const torch::Tensor& residual,
                       const torch::Tensor& sum) {
  check_cuda_route(x, "norm forward");
  DS_CHECK(residual.defined() == sum.defined(), "norm forward: a residual and its sum go together");
  if (residual.defined())
    check_norm_tensors(x, w, b, {&y, &residual, &sum}, mean, rstd, s);
  else
    check_norm_tensors(x, w, b, {&y}, mean, rstd, s);
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.norm_forward(data<E>(x), data<E>(residual), data<E>(w), data<E>(b), data<E>(sum), data<E>(y), data<float>(mean), data<float>(rstd),
                   s, nullptr);
  });
#endif
}

void cuda_norm_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& mean,
                        const torch::Tensor& rstd, const torch::Tensor& dx, const torch::Tensor& dw, const torch::Tensor& db,
                        const kernels::NormShape& s, const torch::Tensor& dsum) {
  check_cuda_route(x, "norm backward");
  if (dsum.defined())
    check_norm_tensors(x, w, torch::Tensor(), {&dy, &dx, &dsum}, mean, rstd, s);
  else
    check_norm_tensors(x, w, torch::Tensor(), {&dy, &dx}, mean, rstd, s);
  for (const torch::Tensor* grad : {&dw, &db})
    DS_CHECK(!grad->defined() || (grad->scalar_type() == torch::kFloat32 && grad->numel() == s.cols && grad->is_contiguous() &&
                                  grad->device() == x.device()),
             "norm backward: dw (and db) fp32, one a column, contiguous, on x's device");
  DS_CHECK(dw.defined(), "norm backward: dw is required");
#ifdef DS_WITH_CUDA_KERNELS
  // The column sums' partials, from LibTorch's caching allocator on the current stream.
  const torch::Tensor scratch = torch::empty({kc::norm_backward_scratch_floats(s)}, dw.options());
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.norm_backward(data<E>(dy), data<E>(dsum), data<E>(x), data<E>(w), data<float>(mean), data<float>(rstd), data<E>(dx),
                    data<float>(dw), data<float>(db), data<float>(scratch), s, nullptr);
  });
#endif
}

void cuda_dropout(const torch::Tensor& x, const torch::Tensor& y, uint64_t key, uint32_t keep_below, float scale) {
  check_cuda_route(x, "dropout");
  DS_CHECK(x.is_contiguous() && y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.numel() == x.numel(),
           "dropout: x and y contiguous, of one dtype and size");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.dropout(data<E>(x), data<E>(y), x.numel(), key, keep_below, scale, nullptr);
  });
#endif
}

void cuda_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                const torch::Tensor& row_loss) {
  check_cuda_route(logits, "softmax cross-entropy");
  DS_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && targets.scalar_type() == torch::kLong && targets.is_contiguous() &&
               row_loss.scalar_type() == torch::kFloat32,
           "softmax cross-entropy: (rows, vocab) logits of unit stride, int64 targets, fp32 row losses");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(logits, [&](auto k) {
    using E = typename decltype(k)::E;
    k.softmax_cross_entropy(data<E>(logits), targets.data_ptr<int64_t>(), logits.size(0), logits.size(1), logits.stride(0), row_grad,
                            write_grad, data<float>(row_loss), nullptr);
  });
#endif
}

void cuda_column_sums_add(const torch::Tensor& x, const torch::Tensor& out) {
  check_cuda_route(x, "column sums");
  DS_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
               out.device() == x.device() && out.numel() == x.size(1) && x.size(1) > 0,
           "column sums: x (rows, cols) contiguous, out of cols elements of x's dtype and device");
#ifdef DS_WITH_CUDA_KERNELS
  const int64_t rows = x.size(0), cols = x.size(1);
  const torch::Tensor scratch = torch::empty({kc::column_sums_scratch_floats(rows, cols)}, x.options().dtype(torch::kFloat32));
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.column_sums_add(data<E>(x), rows, cols, data<E>(out), data<float>(scratch), nullptr);
  });
#endif
}

void cuda_gelu_tanh_forward(const torch::Tensor& x, const torch::Tensor& y) {
  check_elementwise({&x, &y}, "gelu forward");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.gelu_tanh_forward(data<E>(x), data<E>(y), x.numel(), nullptr);
  });
#endif
}

void cuda_gelu_tanh_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& dx) {
  check_elementwise({&x, &dy, &dx}, "gelu backward");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.gelu_tanh_backward(data<E>(dy), data<E>(x), data<E>(dx), x.numel(), nullptr);
  });
#endif
}

void cuda_swiglu_forward(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& y) {
  check_elementwise({&g, &u, &y}, "swiglu forward");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(g, [&](auto k) {
    using E = typename decltype(k)::E;
    k.swiglu_forward(data<E>(g), data<E>(u), data<E>(y), g.numel(), nullptr);
  });
#endif
}

void cuda_swiglu_backward(const torch::Tensor& dy, const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dg,
                          const torch::Tensor& du) {
  check_elementwise({&g, &dy, &u, &dg, &du}, "swiglu backward");
#ifdef DS_WITH_CUDA_KERNELS
  by_cuda_dtype(g, [&](auto k) {
    using E = typename decltype(k)::E;
    k.swiglu_backward(data<E>(dy), data<E>(g), data<E>(u), data<E>(dg), data<E>(du), g.numel(), nullptr);
  });
#endif
}

void cuda_rope(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin,
               const kernels::RopeShape& s) {
  // x (B, T, heads, D) may lie anywhere its D elements are contiguous (an attention's gradient, transposed): the
  // kernel reads it by its strides; y is packed.
  check_cuda_route(x, "rotary");
  const int64_t half = s.D / 2;
  DS_CHECK(x.dim() == 4 && x.size(3) == s.D && x.stride(3) == 1 && x.size(0) * x.size(1) == s.rows && x.size(1) == s.T &&
               x.size(2) == s.heads && y.is_contiguous() && y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() &&
               y.device() == x.device() && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
               cos.is_contiguous() && sin.is_contiguous() && cos.device() == x.device() && sin.device() == x.device() &&
               cos.numel() == s.T * half && sin.numel() == s.T * half,
           "rotary: x (B, T, heads, D) with D contiguous, y packed alike; fp32 cos and sin (T, D/2), contiguous, on x's GPU");
#ifdef DS_WITH_CUDA_KERNELS
  const kernels::cuda::RopeStrides strides{x.stride(0), x.stride(1), x.stride(2)};
  by_cuda_dtype(x, [&](auto k) {
    using E = typename decltype(k)::E;
    k.rope(data<E>(x), data<E>(y), data<float>(cos), data<float>(sin), s, nullptr, &strides);
  });
#endif
}

}  // namespace ds
