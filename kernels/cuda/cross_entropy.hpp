// ds — softmax cross-entropy over rows of logits on a CUDA GPU, with the gradient of the logits written over
// them in the same call: the GPU's twin of kernels/cpu/cross_entropy (the same function and bf16 rounding;
// fp32 throughout where the CPU keeps the row's sum and lse in double, so a gradient may differ by one bf16
// step, a loss by about 1e-6 of a row's largest logit). One block per row reads the row once for its maximum and sum of exponentials (online),
// keeping it in shared memory where it fits (112 KiB: GPT-2's bf16 rows), and writes the gradient from there (else
// reads the row again), instead of the ten library passes over a widened fp32 copy.
//
// Per row r with target t:  lse = log sum_j exp(z_j);  row_loss[r] = lse - z_t
//                           z_j <- (exp(z_j - lse) - [j == t]) * grad_scale      (when write_grad)
// Targets must lie in [0, vocab): the caller checks (on the host, before the copy); a row whose target
// does not gets a NaN loss. `row_stride` is the distance between row starts in elements (>= vocab); rows
// that start 16 bytes aligned are read 16 bytes a load. Only queues work on `stream` (a cudaStream_t; null:
// the legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

namespace ds::kernels::cuda {

void softmax_cross_entropy_f32(float* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                               float grad_scale, bool write_grad, float* row_loss, void* stream);
void softmax_cross_entropy_bf16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                float grad_scale, bool write_grad, float* row_loss, void* stream);
// fp16 logits as their bits: the gradient written over them in fp16 (a loss scale keeps its small values normal).
void softmax_cross_entropy_fp16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                float grad_scale, bool write_grad, float* row_loss, void* stream);

}  // namespace ds::kernels::cuda
