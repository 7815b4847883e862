// ds — the gradient of an embedding lookup added straight into the table's gradient, row by row:
//   grad[ids[i], :] += dy[i, :]   for i in [0, n)
// Only the rows the batch used are touched: no dense (vocab x width) gradient is made, zeroed and
// added (for GPT-2 124M in fp32 that was 154 MB per micro batch). Rows of the same id are summed in
// fp32 (double without AVX-512) in their order in the batch and added once, so a bf16 table sees one
// rounding per id, and the result does not depend on the thread count. Raw pointers, no LibTorch; ids must lie in [0, vocab).
#pragma once

#include <cstdint>

namespace ds::kernels {

void embedding_backward_f32(float* grad, const int64_t* ids, const float* dy, int64_t n, int64_t width);
void embedding_backward_bf16(uint16_t* grad, const int64_t* ids, const uint16_t* dy, int64_t n, int64_t width);

// Scalar versions (each id's rows summed in double) the fast ones are tested against.
void embedding_backward_f32_reference(float* grad, const int64_t* ids, const float* dy, int64_t n, int64_t width);
void embedding_backward_bf16_reference(uint16_t* grad, const int64_t* ids, const uint16_t* dy, int64_t n, int64_t width);

}  // namespace ds::kernels
