// ds — the model's elementwise and normalisation ops on ds's own kernels, with their backward, as autograd
// functions: LayerNorm, RMSNorm, tanh-GELU, SwiGLU, rotary position embedding, the embedding lookup, and the
// projections (whose GEMMs are LibTorch's). Which kernels take a tensor is kernel_route's answer: fp32 and bf16
// CPU tensors kernels/cpu, fp32, bf16 and fp16 GPU tensors kernels/cuda (the embedding's backward: the CPU's
// only); anything else takes LibTorch's ops, so the models call these unconditionally. Numerics: statistics in fp32, one rounding of each output (tests/test_model_ops).
#pragma once

#include <torch/torch.h>

namespace ds {

// Over the last dimension of x; w and b have its size and x's dtype.
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps);
// w * x / sqrt(mean(x^2) + eps) over the last dimension (Llama's RMSNorm), the statistic in fp32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
// A pre-norm block's residual add and the norm after it: {x + r, norm(x + r)}, each value as the add and the norm
// apart give it bit for bit (the sum rounded to x's dtype first; in backward the norm's dx rounded, then the sum's
// other gradient added), in one kernel each way on a GPU (on the host, the add and the norm's kernels).
std::pair<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w,
                                                       const torch::Tensor& b, double eps);
std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps);
// A block's first norm with the residual stream passed on beside it: {x, norm(x)}, the first x itself as autograd
// returns an input (a view of it whose gradient comes through this node, or an alias without grad mode; a copy when
// x was not contiguous): never modify it in place. The stream's gradient and the norm's meet in one backward (one
// kernel on a GPU) instead of autograd adding them after, bit for bit the same. An x that takes no gradient is
// passed on as it is.
std::pair<torch::Tensor, torch::Tensor> layer_norm_beside(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps);
std::pair<torch::Tensor, torch::Tensor> rms_norm_beside(const torch::Tensor& x, const torch::Tensor& w, double eps);
// 1 / sqrt(mean(xf^2) + eps) over the last dimension, in LibTorch ops for autograd. The mean is a sum over the
// width: LibTorch's mean keeps its input (xf^2) for backward, a sum does not, and so this keeps only xf.
torch::Tensor inverse_rms(const torch::Tensor& xf, double eps);
// GPT-2's gelu_new: x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2.
torch::Tensor gelu_tanh(const torch::Tensor& x);
// The batch's token ids (from the host) as int64 on `device`: to a GPU through pinned memory, queued without
// waiting for the GPU's work to finish, so a step never stops the queue to hand it its ids.
torch::Tensor ids_to_device(const torch::Tensor& ids, const torch::Device& device);
// The rows of `weight` (V, C) at `ids` (any shape of int64): (..., C). In backward the rows' gradients
// are added straight into weight's gradient buffer when it has one of its dtype (the flat gradients
// ds binds to every parameter): no dense V x C gradient is made (kernels/cpu/embedding).
torch::Tensor embedding_lookup(const torch::Tensor& weight, const torch::Tensor& ids);
// Dropout with probability p in (0, 1): x / (1 - p) where the mask of `key` keeps an element, else 0. The mask
// is a function of the key and the element's index (kernels/dropout_mask.hpp): the CPU and a GPU drop the
// same elements, and backward recomputes it instead of keeping it.
torch::Tensor hashed_dropout(const torch::Tensor& x, double p, uint64_t key);
// Llama's rotary position embedding (Hugging Face's rotate_half layout) of x (B, T, heads, D) at
// positions 0 .. T-1, from fp32 tables cos and sin (T, D/2) of the angles t theta^(-2j/D).
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
// Llama's gated MLP activation: silu(gate) * up, with gate and up of one shape (silu(gate) is not kept).
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// A projection of x (..., in): y = x w^T + b with w (out, in) as nn.Linear stores it, or with
// `in_out` y = x w + b with w (in, out) as GPT-2's Conv1D does; b may be undefined. In backward the
// weight's and bias's gradients are added straight into their gradient buffers when they have ones
// of their dtype (ds's flat gradients): one GEMM that adds in fp32 and rounds once, where autograd
// would make a new gradient tensor and then add it in a second pass over the buffer.
torch::Tensor projection(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool in_out);

// A LoRA-adapted projection of a frozen base: projection(x, w, b, in_out) + scale (d a^T) bm^T, with a (r, in) and
// bm (out, r) as PEFT stores lora_A and lora_B and d = `dropped` (x through LoRA's dropout) or, undefined, x itself.
// One node whose scales and sums ride in the GEMMs, no elementwise kernel of its own (a GPU's LoRA step is bound by
// launches): the adapter's product is added into y by the GEMM in fp32 and rounded once (the ops composed round it
// before the add). Gradients of a and bm go into their buffers when bound.
torch::Tensor lora_projection(const torch::Tensor& x, const torch::Tensor& dropped, const torch::Tensor& w, const torch::Tensor& b,
                              const torch::Tensor& a, const torch::Tensor& bm, double scale, bool in_out);

// A parameter's gradient buffer when ds bound one of its dtype and shape (FlatParams binds every
// parameter's .grad to a view of the flat gradients), else undefined: the ops above add into it
// themselves, or hand autograd a gradient tensor where there is none.
torch::Tensor bound_gradient(const torch::Tensor& param);

}  // namespace ds
