// ds — the softmax of causal attention, over one block of query rows at a time, forward and
// backward. The fused attention (engine/runtime/model/fused_attention) multiplies a block of queries by
// the keys they may see, runs these on the scores in place, and multiplies by the values: the T x T
// matrix of probabilities never exists, and nothing of size T x T is kept for backward (only the
// log-sum-exp of each row; backward recomputes the probabilities from it).
//
// A block holds `rows` rows of `cols` scores each (row stride = cols). Row r is the query at position
// first_pos + r % block_rows (rows of several heads are stacked, block_rows each), so it may see the
// keys 0 .. first_pos + r % block_rows; the scores past that are masked (written as 0).
//
//   forward:    s <- exp(scale s - lse_r) over the visible keys, lse_r = log sum_j exp(scale s_j)
//   recompute:  s <- exp(scale s - lse_r)                  (the same probabilities, from the lse)
//   backward:   dp <- scale p (dp - sum_j p_j dp_j)
// so dQ = dp K and dK = dp^T Q without a further scale. Every row of a block holds all the keys it
// sees, so the sum is taken over the rounded p and dp themselves (not from dO . O as tiled kernels
// must): in bf16 the difference then cancels as exactly as in an unfused softmax backward. Math in fp32 (each row's sum of exponentials
// flushed to double every 1024 keys); bf16 results rounded to nearest even. Raw pointers, no
// allocation, no LibTorch; rows are split over OpenMP threads.
#pragma once

#include <cstdint>

namespace ds::kernels {

struct CausalBlock {
  int64_t rows = 0;        // rows in this call
  int64_t cols = 0;        // scores per row, keys 0 .. cols-1
  int64_t block_rows = 1;  // query positions per stacked head
  int64_t first_pos = 0;   // position of row 0
  float scale = 1;         // applied to the scores before the softmax (1/sqrt(head dim))

  // Keys row r may see.
  int64_t visible(int64_t r) const {
    const int64_t n = first_pos + r % block_rows + 1;
    return n < cols ? n : cols;
  }
};

void causal_softmax_forward_f32(float* s, float* lse, const CausalBlock& b);
void causal_softmax_forward_bf16(uint16_t* s, float* lse, const CausalBlock& b);
void causal_softmax_recompute_f32(float* s, const float* lse, const CausalBlock& b);
void causal_softmax_recompute_bf16(uint16_t* s, const float* lse, const CausalBlock& b);
void causal_softmax_backward_f32(const float* p, float* dp, const CausalBlock& b);
void causal_softmax_backward_bf16(const uint16_t* p, uint16_t* dp, const CausalBlock& b);

// Scalar versions (double math) the fast ones are tested against.
void causal_softmax_forward_f32_reference(float* s, float* lse, const CausalBlock& b);
void causal_softmax_forward_bf16_reference(uint16_t* s, float* lse, const CausalBlock& b);
void causal_softmax_recompute_f32_reference(float* s, const float* lse, const CausalBlock& b);
void causal_softmax_recompute_bf16_reference(uint16_t* s, const float* lse, const CausalBlock& b);
void causal_softmax_backward_f32_reference(const float* p, float* dp, const CausalBlock& b);
void causal_softmax_backward_bf16_reference(const uint16_t* p, uint16_t* dp, const CausalBlock& b);

}  // namespace ds::kernels
