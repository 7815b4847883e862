// ds — softmax cross-entropy over rows of logits, with the gradient of the logits written over them
// in the same call. The fused head + loss (engine/runtime/model/fused_head_loss) runs it on one chunk of
// rows at a time, so neither the whole batch's logits nor a widened fp32 copy nor a separate gradient
// buffer ever exists.
//
// Per row r with target t:  lse = log sum_j exp(z_j);  loss_r = lse - z_t
//                           z_j <- (exp(z_j - lse) - [j == t]) * grad_scale      (when writing gradients)
// Math in fp32 (the sum of exponentials per lane, the row's total in double); bf16 rows are read
// widened and the gradient rounded to nearest even. Targets must lie in [0, vocab): the caller checks.
// Raw pointers, no allocation, no LibTorch; rows are split over OpenMP threads.
#pragma once

#include <cstdint>

namespace ds::kernels {

// Returns the sum over rows of loss_r (double). `row_stride` is the distance between row starts in
// elements (>= vocab). With write_grad false the logits are left as they were.
double softmax_cross_entropy_f32(float* logits, const int64_t* targets, int64_t rows, int64_t vocab, int64_t row_stride,
                                 float grad_scale, bool write_grad);
double softmax_cross_entropy_bf16(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                  int64_t row_stride, float grad_scale, bool write_grad);

// Plain scalar versions (double precision throughout) the fast ones are tested against.
double softmax_cross_entropy_f32_reference(float* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                           int64_t row_stride, float grad_scale, bool write_grad);
double softmax_cross_entropy_bf16_reference(uint16_t* logits, const int64_t* targets, int64_t rows, int64_t vocab,
                                            int64_t row_stride, float grad_scale, bool write_grad);

}  // namespace ds::kernels
