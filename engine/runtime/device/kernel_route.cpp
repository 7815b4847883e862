#include "engine/runtime/device/kernel_route.hpp"

#include <initializer_list>
#include <type_traits>

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
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16) return KernelRoute::libtorch;
  if (on_host(x)) return KernelRoute::host;
#ifdef DS_WITH_CUDA_KERNELS
  if (x.is_cuda()) return KernelRoute::cuda;
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

uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// An optional tensor's data as E* (null where undefined).
template <class E>
E* data_or_null(const torch::Tensor& t) {
  if (!t.defined()) return nullptr;
  if constexpr (std::is_same_v<E, uint16_t>)
    return bf16_data(t);
  else
    return t.data_ptr<E>();
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

}  // namespace

void cuda_norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& y,
                       const torch::Tensor& mean, const torch::Tensor& rstd, const kernels::NormShape& s) {
  check_cuda_route(x, "norm forward");
  check_norm_tensors(x, w, b, {&y}, mean, rstd, s);
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::norm_forward_f32(x.data_ptr<float>(), w.data_ptr<float>(), data_or_null<float>(b), y.data_ptr<float>(),
                                    mean.data_ptr<float>(), rstd.data_ptr<float>(), s, nullptr);
  else
    kernels::cuda::norm_forward_bf16(bf16_data(x), bf16_data(w), data_or_null<uint16_t>(b), bf16_data(y), mean.data_ptr<float>(),
                                     rstd.data_ptr<float>(), s, nullptr);
#else
  (void)w, (void)b, (void)y;
#endif
}

void cuda_norm_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& mean,
                        const torch::Tensor& rstd, const torch::Tensor& dx, const torch::Tensor& dw, const torch::Tensor& db,
                        const kernels::NormShape& s) {
  check_cuda_route(x, "norm backward");
  check_norm_tensors(x, w, torch::Tensor(), {&dy, &dx}, mean, rstd, s);
  for (const torch::Tensor* grad : {&dw, &db})
    DS_CHECK(!grad->defined() || (grad->scalar_type() == torch::kFloat32 && grad->numel() == s.cols && grad->is_contiguous() &&
                                  grad->device() == x.device()),
             "norm backward: dw (and db) fp32, one a column, contiguous, on x's device");
  DS_CHECK(dw.defined(), "norm backward: dw is required");
#ifdef DS_WITH_CUDA_KERNELS
  // The column sums' partials, from LibTorch's caching allocator on the current stream.
  const torch::Tensor scratch = torch::empty({kernels::cuda::norm_backward_scratch_floats(s)}, dw.options());
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::norm_backward_f32(dy.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), mean.data_ptr<float>(),
                                     rstd.data_ptr<float>(), dx.data_ptr<float>(), dw.data_ptr<float>(), data_or_null<float>(db),
                                     scratch.data_ptr<float>(), s, nullptr);
  else
    kernels::cuda::norm_backward_bf16(bf16_data(dy), bf16_data(x), bf16_data(w), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                      bf16_data(dx), dw.data_ptr<float>(), data_or_null<float>(db), scratch.data_ptr<float>(), s,
                                      nullptr);
#else
  (void)dy, (void)w, (void)mean, (void)rstd, (void)dx, (void)db;
#endif
}

void cuda_dropout(const torch::Tensor& x, const torch::Tensor& y, uint64_t key, uint32_t keep_below, float scale) {
  check_cuda_route(x, "dropout");
  DS_CHECK(x.is_contiguous() && y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.numel() == x.numel(),
           "dropout: x and y contiguous, of one dtype and size");
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::dropout_f32(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), key, keep_below, scale, nullptr);
  else
    kernels::cuda::dropout_bf16(bf16_data(x), bf16_data(y), x.numel(), key, keep_below, scale, nullptr);
#else
  (void)key, (void)keep_below, (void)scale;
#endif
}

void cuda_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                const torch::Tensor& row_loss) {
  check_cuda_route(logits, "softmax cross-entropy");
  DS_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && targets.scalar_type() == torch::kLong && targets.is_contiguous() &&
               row_loss.scalar_type() == torch::kFloat32,
           "softmax cross-entropy: (rows, vocab) logits of unit stride, int64 targets, fp32 row losses");
#ifdef DS_WITH_CUDA_KERNELS
  const int64_t rows = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  if (logits.scalar_type() == torch::kBFloat16)
    kernels::cuda::softmax_cross_entropy_bf16(bf16_data(logits), targets.data_ptr<int64_t>(), rows, vocab, ld, row_grad, write_grad,
                                              row_loss.data_ptr<float>(), nullptr);
  else
    kernels::cuda::softmax_cross_entropy_f32(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), rows, vocab, ld, row_grad,
                                             write_grad, row_loss.data_ptr<float>(), nullptr);
#else
  (void)targets, (void)row_grad, (void)write_grad, (void)row_loss;
#endif
}

void cuda_column_sums_add(const torch::Tensor& x, const torch::Tensor& out) {
  check_cuda_route(x, "column sums");
  DS_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
               out.device() == x.device() && out.numel() == x.size(1) && x.size(1) > 0,
           "column sums: x (rows, cols) contiguous, out of cols elements of x's dtype and device");
#ifdef DS_WITH_CUDA_KERNELS
  const int64_t rows = x.size(0), cols = x.size(1);
  const torch::Tensor scratch = torch::empty({kernels::cuda::column_sums_scratch_floats(rows, cols)}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::column_sums_add_f32(x.data_ptr<float>(), rows, cols, out.data_ptr<float>(), scratch.data_ptr<float>(), nullptr);
  else
    kernels::cuda::column_sums_add_bf16(bf16_data(x), rows, cols, bf16_data(out), scratch.data_ptr<float>(), nullptr);
#endif
}

namespace {

void check_elementwise(std::initializer_list<const torch::Tensor*> ts, const char* op) {
  const torch::Tensor& x = **ts.begin();
  check_cuda_route(x, op);
  for (const torch::Tensor* t : ts)
    DS_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->device() == x.device() && t->numel() == x.numel(), op,
             ": contiguous tensors of one dtype, device and size");
}

}  // namespace

void cuda_gelu_tanh_forward(const torch::Tensor& x, const torch::Tensor& y) {
  check_elementwise({&x, &y}, "gelu forward");
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::gelu_tanh_forward_f32(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), nullptr);
  else
    kernels::cuda::gelu_tanh_forward_bf16(bf16_data(x), bf16_data(y), x.numel(), nullptr);
#endif
}

void cuda_gelu_tanh_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& dx) {
  check_elementwise({&x, &dy, &dx}, "gelu backward");
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::gelu_tanh_backward_f32(dy.data_ptr<float>(), x.data_ptr<float>(), dx.data_ptr<float>(), x.numel(), nullptr);
  else
    kernels::cuda::gelu_tanh_backward_bf16(bf16_data(dy), bf16_data(x), bf16_data(dx), x.numel(), nullptr);
#endif
}

void cuda_swiglu_forward(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& y) {
  check_elementwise({&g, &u, &y}, "swiglu forward");
#ifdef DS_WITH_CUDA_KERNELS
  if (g.scalar_type() == torch::kFloat32)
    kernels::cuda::swiglu_forward_f32(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), g.numel(), nullptr);
  else
    kernels::cuda::swiglu_forward_bf16(bf16_data(g), bf16_data(u), bf16_data(y), g.numel(), nullptr);
#endif
}

void cuda_swiglu_backward(const torch::Tensor& dy, const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dg,
                          const torch::Tensor& du) {
  check_elementwise({&g, &dy, &u, &dg, &du}, "swiglu backward");
#ifdef DS_WITH_CUDA_KERNELS
  if (g.scalar_type() == torch::kFloat32)
    kernels::cuda::swiglu_backward_f32(dy.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(), dg.data_ptr<float>(),
                                       du.data_ptr<float>(), g.numel(), nullptr);
  else
    kernels::cuda::swiglu_backward_bf16(bf16_data(dy), bf16_data(g), bf16_data(u), bf16_data(dg), bf16_data(du), g.numel(), nullptr);
#endif
}

void cuda_rope(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin,
               const kernels::RopeShape& s) {
  check_elementwise({&x, &y}, "rotary");
  const int64_t half = s.D / 2;
  DS_CHECK(x.numel() == s.rows * s.heads * s.D && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
               cos.is_contiguous() && sin.is_contiguous() && cos.device() == x.device() && sin.device() == x.device() &&
               cos.numel() == s.T * half && sin.numel() == s.T * half,
           "rotary: x holds rows x heads x D; fp32 cos and sin (T, D/2), contiguous, on x's GPU");
#ifdef DS_WITH_CUDA_KERNELS
  if (x.scalar_type() == torch::kFloat32)
    kernels::cuda::rope_f32(x.data_ptr<float>(), y.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), s, nullptr);
  else
    kernels::cuda::rope_bf16(bf16_data(x), bf16_data(y), cos.data_ptr<float>(), sin.data_ptr<float>(), s, nullptr);
#endif
}

}  // namespace ds
