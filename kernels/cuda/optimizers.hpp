// ds — the flat-buffer kernels on a CUDA GPU, the same operations kernels/cpu/ does on the host: the
// optimizers' updates (AdamW/Adam, SGD, Lamb's two halves) and sums of squares, over raw device pointers
// and sizes. Every call only queues work on `stream` (a cudaStream_t; null: the default stream) and returns.
// Reductions are deterministic: a fixed grid writes one partial per block, one block adds them in order,
// so the same input gives the same bits every run. No LibTorch, no CUDA types in this header.
#pragma once

#include <cstdint>

#include "kernels/cpu/adam.hpp"
#include "kernels/cpu/lamb.hpp"
#include "kernels/cpu/sgd.hpp"

namespace ds::kernels::cuda {

// Blocks a reduction's first pass runs: its scratch holds this many partials per value summed.
constexpr int kReduceBlocks = 256;

void adam_step_f32(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const float* grad, int64_t n,
                   const AdamStep& s, void* stream);
void adam_step_bf16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                    const AdamStep& s, void* stream);
void sgd_step_f32(float* master, float* momentum_buf, uint16_t* param_bf16, const float* grad, int64_t n, const SgdStep& s,
                  void* stream);
void sgd_step_bf16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n, const SgdStep& s,
                   void* stream);
// fp16 gradients (IEEE binary16 bits): each element widened exactly, then the same step.
void adam_step_fp16(float* master, float* exp_avg, float* exp_avg_sq, uint16_t* param_bf16, const uint16_t* grad, int64_t n,
                    const AdamStep& s, void* stream);
void sgd_step_fp16(float* master, float* momentum_buf, uint16_t* param_bf16, const uint16_t* grad, int64_t n, const SgdStep& s,
                   void* stream);

// Lamb's first half: the moments updated, and ||w||^2, ||u||^2 of this run added to sums[0], sums[1]
// (device doubles). scratch: 2 x kReduceBlocks doubles.
void lamb_moments_f32(const float* master, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const LambStep& s,
                      double* sums, double* scratch, void* stream);
void lamb_moments_bf16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                       const LambStep& s, double* sums, double* scratch, void* stream);
void lamb_moments_fp16(const float* master, float* exp_avg, float* exp_avg_sq, const uint16_t* grad, int64_t n,
                       const LambStep& s, double* sums, double* scratch, void* stream);
void lamb_apply(float* master, const float* exp_avg, const float* exp_avg_sq, uint16_t* param_bf16, int64_t n, const LambStep& s,
                float ratio, void* stream);

// The sum of squares of x in double into *out (device). scratch: kReduceBlocks doubles.
void sum_of_squares_f32(const float* x, int64_t n, double* out, double* scratch, void* stream);
void sum_of_squares_bf16(const uint16_t* x, int64_t n, double* out, double* scratch, void* stream);
void sum_of_squares_fp16(const uint16_t* x, int64_t n, double* out, double* scratch, void* stream);

// CUDA devices visible to this process (0 without a driver or a GPU), and the runtime's reason when none.
int device_count(const char** why = nullptr);

}  // namespace ds::kernels::cuda
