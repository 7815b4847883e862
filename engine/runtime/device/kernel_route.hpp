// ds — which kernels a model op runs on a tensor, answered in one place for every op in engine/runtime/model.
// The run's Device put the tensor where it is (it allocates the weights; the batch's ids and targets come
// from the host), so the answer follows the tensor's place and dtype: a GPU run holds host tensors too (the
// targets as read, an offloaded optimizer's states), and a CPU op must never be handed a GPU pointer. What
// this build has (kernels/cuda or not) is read here, not in the ops.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "engine/runtime/device/kernel_table.hpp"  // GradElements
#include "kernels/cpu/layer_norm.hpp"  // NormShape
#include "kernels/cpu/rope.hpp"        // RopeShape

namespace ds {

enum class KernelRoute {
  host,      // ds's CPU kernels (kernels/cpu): fp32 and bf16 tensors in host memory
  cuda,      // ds's CUDA kernels (kernels/cuda): fp32, bf16 and fp16 tensors on a GPU, in a build that has them
  libtorch,  // LibTorch's own operations: anything else (fp16 on the host, fp64, a GPU build without kernels/cuda)
};
KernelRoute kernel_route(const torch::Tensor& x);

// How a gradient buffer the optimizers' kernels read stores its elements (fp32, bf16, fp16; anything else is
// an internal error naming the dtype).
GradElements grad_elements_of(const torch::Tensor& grads);

// The bytes are in host memory (a pointer host code may read).
bool on_host(const torch::Tensor& x);
bool on_host(const torch::Device& d);

// kernels/cuda's model kernels, for tensors kernel_route sends there (checked; fp32, bf16 or fp16, each op's
// tensors of one dtype), queued on the legacy default stream: LibTorch's default and the CUDA Device's compute
// stream (a CUDAStreamGuard around the model would need the current stream passed here instead), on the current
// device (one GPU a process).
// y = x with dropout's mask of `key` applied (kernels/dropout_mask.hpp), x and y contiguous, of one dtype.
void cuda_dropout(const torch::Tensor& x, const torch::Tensor& y, uint64_t key, uint32_t keep_below, float scale);
// Each row's softmax cross-entropy into row_loss (fp32), and with write_grad its gradient times row_grad over
// the logits (rows x vocab, unit stride along the vocabulary); targets int64, contiguous, on the GPU.
void cuda_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                const torch::Tensor& row_loss);

// LayerNorm / RMSNorm (kernels/cpu/layer_norm.hpp's functions) over contiguous tensors of one dtype on the GPU;
// mean and rstd fp32 (rows); b and db undefined for RMSNorm; dw and db fp32 (C), added to. With `residual` (and
// `sum`, like x) the norm reads x + residual, written to sum; with `dsum`, dx is the norm's plus dsum (a residual
// sum's two gradients): kernels/cuda/norm.hpp.
void cuda_norm_forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& y,
                       const torch::Tensor& mean, const torch::Tensor& rstd, const kernels::NormShape& shape,
                       const torch::Tensor& residual = {}, const torch::Tensor& sum = {});
void cuda_norm_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& mean,
                        const torch::Tensor& rstd, const torch::Tensor& dx, const torch::Tensor& dw, const torch::Tensor& db,
                        const kernels::NormShape& shape, const torch::Tensor& dsum = {});
// out += the sums of x's columns (x rows x cols, contiguous; out cols elements of x's dtype): a bias's gradient.
void cuda_column_sums_add(const torch::Tensor& x, const torch::Tensor& out);
// The MLP activations (kernels/cpu/activation.hpp's functions) over contiguous tensors of one dtype and size.
void cuda_gelu_tanh_forward(const torch::Tensor& x, const torch::Tensor& y);
void cuda_gelu_tanh_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& dx);
void cuda_swiglu_forward(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& y);
void cuda_swiglu_backward(const torch::Tensor& dy, const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& dg,
                          const torch::Tensor& du);
// Rotary embedding (kernels/cpu/rope.hpp) of x (B, T, heads, D), read where it lies (D contiguous), into packed y,
// fp32 cos and sin (T, D/2) on x's GPU.
void cuda_rope(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin,
               const kernels::RopeShape& shape);

}  // namespace ds
