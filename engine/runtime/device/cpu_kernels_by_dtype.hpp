// ds — the autograd functions' way to the CPU kernels: which tensors the kernels take, and the kernel for
// a tensor's dtype looked up once in a table (fp32: float, bf16: uint16_t) instead of an `if bf16 … else`
// in every function. A CUDA build adds its own table beside this one, keyed the same way.
#pragma once

#include <torch/torch.h>

#include <type_traits>

#include "common/error.hpp"
#include "engine/runtime/device/kernel_route.hpp"
#include "kernels/cpu/activation.hpp"
#include "kernels/cpu/attention_softmax.hpp"
#include "kernels/cpu/attention_tiles.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/layer_norm.hpp"
#include "kernels/cpu/rope.hpp"

namespace ds {

// The CPU kernels take fp32 and bf16 host tensors (kernel_route.hpp); anything else goes another way.
inline bool on_cpu_kernels(const torch::Tensor& x) { return kernel_route(x) == KernelRoute::host; }

template <class T>
T* raw(const torch::Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// The kernels for elements of type E (float: fp32, uint16_t: bf16).
template <class E>
struct CpuKernels;

template <>
struct CpuKernels<float> {
  static constexpr auto norm_forward = kernels::norm_forward_f32;
  static constexpr auto norm_backward = kernels::norm_backward_f32;
  static constexpr auto gelu_tanh_forward = kernels::gelu_tanh_forward_f32;
  static constexpr auto gelu_tanh_backward = kernels::gelu_tanh_backward_f32;
  static constexpr auto swiglu_forward = kernels::swiglu_forward_f32;
  static constexpr auto swiglu_backward = kernels::swiglu_backward_f32;
  static constexpr auto rope = kernels::rope_f32;
  static constexpr auto embedding_backward = kernels::embedding_backward_f32;
  static constexpr auto softmax_forward = kernels::causal_softmax_forward_f32;
  static constexpr auto softmax_recompute = kernels::causal_softmax_recompute_f32;
  static constexpr auto softmax_backward = kernels::causal_softmax_backward_f32;
  static constexpr auto attention_forward = kernels::causal_attention_forward_f32;
  static constexpr auto attention_backward = kernels::causal_attention_backward_f32;
};

template <>
struct CpuKernels<uint16_t> {
  static constexpr auto norm_forward = kernels::norm_forward_bf16;
  static constexpr auto norm_backward = kernels::norm_backward_bf16;
  static constexpr auto gelu_tanh_forward = kernels::gelu_tanh_forward_bf16;
  static constexpr auto gelu_tanh_backward = kernels::gelu_tanh_backward_bf16;
  static constexpr auto swiglu_forward = kernels::swiglu_forward_bf16;
  static constexpr auto swiglu_backward = kernels::swiglu_backward_bf16;
  static constexpr auto rope = kernels::rope_bf16;
  static constexpr auto embedding_backward = kernels::embedding_backward_bf16;
  static constexpr auto softmax_forward = kernels::causal_softmax_forward_bf16;
  static constexpr auto softmax_recompute = kernels::causal_softmax_recompute_bf16;
  static constexpr auto softmax_backward = kernels::causal_softmax_backward_bf16;
  // The bf16 attention kernels take the products this CPU runs best (their default argument).
  static void attention_forward(const kernels::AttentionShape& s, const kernels::HeadViewBf16& q, const kernels::HeadViewBf16& k,
                                const kernels::HeadViewBf16& v, const kernels::HeadViewBf16& y, float* lse) {
    kernels::causal_attention_forward_bf16(s, q, k, v, y, lse);
  }
  static void attention_backward(const kernels::AttentionShape& s, const kernels::HeadViewBf16& q, const kernels::HeadViewBf16& k,
                                 const kernels::HeadViewBf16& v, const kernels::HeadViewBf16& y, const float* lse,
                                 const kernels::HeadViewBf16& dy, const kernels::HeadViewBf16& dq, const kernels::HeadViewBf16& dk,
                                 const kernels::HeadViewBf16& dv) {
    kernels::causal_attention_backward_bf16(s, q, k, v, y, lse, dy, dq, dk, dv);
  }
};

// Calls f with a null E* for x's element type: by_dtype(x, [&](auto* e) { using E = ElementOf<decltype(e)>; … }).
template <class F>
decltype(auto) by_dtype(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == torch::kBFloat16) return f(static_cast<uint16_t*>(nullptr));
  DS_CHECK(x.scalar_type() == torch::kFloat32, "a CPU kernel asked for ", x.scalar_type());
  return f(static_cast<float*>(nullptr));
}
template <class P>
using ElementOf = std::remove_pointer_t<P>;

}  // namespace ds
