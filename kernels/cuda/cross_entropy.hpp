// ds — softmax cross-entropy over rows of logits on a CUDA GPU, with the gradient of the logits written over
// them in the same call: the GPU's twin of kernels/cpu/cross_entropy (the same function and bf16 rounding;
// fp32 throughout where the CPU keeps the row's sum and lse in double, so a gradient may differ by one bf16
// step, a loss by about 1e-6 of a row's largest logit). One block per row reads the row once for its maximum and sum of exponentials (online),
// and again to write the gradient (or keeps it in shared memory between the two, CrossEntropyPath), instead of the
// ten library passes over a widened fp32 copy.
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

// How a row is read: twice from device memory (the gradient's pass reads it again), or once, kept in shared memory
// between the passes where it fits (else twice). The functions above take `automatic`, which is two passes: on the
// H200 the row in shared memory (then 256 threads a block, 16 warps an SM) ran slower than reading it twice.
// bench_cuda_optimizers times both, so a GPU visit can tell whether the wider block changed that.
enum class CrossEntropyPath { automatic, two_pass, row_in_shared };
void softmax_cross_entropy_bf16_by(CrossEntropyPath path, uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                   int64_t row_stride, float grad_scale, bool write_grad, float* row_loss, void* stream);

}  // namespace ds::kernels::cuda
