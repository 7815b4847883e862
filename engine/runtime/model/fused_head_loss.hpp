// ds — the language model's head and loss as one operation: the mean cross-entropy of `targets`
// under softmax(x W^T), computed a chunk of rows at a time so the (rows x vocab) logits of the whole
// batch never exist, let alone widened to fp32 with a gradient beside them. When a gradient is
// wanted, each chunk's logits are turned into their gradient in place (kernels/cpu/cross_entropy on
// the CPU, kernels/cuda/cross_entropy on a GPU) and
// multiplied straight into the gradients of x and W, during the forward pass: backward only hands
// them on. The gradients are computed for the gradient the loss is expected to receive
// (`expected_grad`: the loss scale over the micro batches and ranks), so fp16 gradients never
// underflow on the way; backward rescales them if the loss receives something else.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "engine/plan/model_spec.hpp"  // kHeadChunkElements: the plan counts the same chunk
#include "engine/runtime/model/tensor_parallel.hpp"

namespace ds {

// The vocabulary ids the head's main product covers: all `vocab` on the host; off it, up to the last multiple of
// the alignment cuBLAS's full-rate kernels need (the remaining ids go through a sliver of a product of their own).
int64_t head_product_vocab(int64_t vocab, bool host);

// x (N, C) and weight (V, C) in the model's dtype, targets (N) int64 in [0, V). Returns the mean
// loss as an fp32 scalar; differentiable in x and weight when grad mode is on and either needs it.
// `kept_logits` (optional): the chunk of logits is made there once and reused by every later call
// (made again only for a larger chunk or another dtype). A model passes one, because a chunk of about
// 100 MB made and freed every step fragments the heap: GPT-2 6x384 in fp32 at B=4, T=128 reached 1.28x
// the plan's memory after a dozen steps, 1.13x with the chunk kept.
// `softcap` > 0: the logits are soft-capped first, cap tanh(logits / cap) (Gemma 2's final_logit_softcapping),
// which keeps one more chunk, of the capped values' tanh, for the gradient.
torch::Tensor fused_head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                              double expected_grad, int64_t chunk_elements = kHeadChunkElements,
                              torch::Tensor* kept_logits = nullptr, double softcap = 0);

// Tensor parallel (Megatron's vocabulary-parallel cross-entropy): `weight` holds this rank's rows of the head,
// group.vocab (the last rows - real of them padding, never a target, their gradient zero), the other rows are
// the group's other ranks'; x and the targets (ids of the whole vocabulary) are the same on every rank. The
// logits never leave their rank: per chunk, one all-reduce over the group carries each rank's maximum logit
// and sum of exponentials below it per row, and the target's logit from the rank that holds it (2t + 1 fp32
// values a row), from which every rank computes the whole softmax's loss and its own columns' gradient. The
// loss returned is the whole one, on every rank; x's gradient is this rank's part: pass x through
// enter_tensor_group first so backward sums the parts.
torch::Tensor vocab_parallel_head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                                       const TensorGroup& group, double expected_grad, int64_t chunk_elements = kHeadChunkElements,
                                       torch::Tensor* kept_logits = nullptr, double softcap = 0);

}  // namespace ds
