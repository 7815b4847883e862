// ds — rotary position embedding (Llama, in Hugging Face's rotate_half layout), forward and backward,
// over x laid out (rows, heads, D) with row r at position r % T (a linear layer's output viewed as
// (B, T, heads, D)). With c = cos(t f_j), s = sin(t f_j) from fp32 tables of (T, D/2):
//   y[j] = x[j] c - x[j + D/2] s,   y[j + D/2] = x[j + D/2] c + x[j] s     (j < D/2)
// The backward is the rotation by the opposite angle (`inverse`). Math in fp32, bf16 results rounded
// once (LibTorch's version rounded cos and sin to bf16 and each product and sum). Raw pointers, no
// allocation, no LibTorch; x and y may be the same buffer.
#pragma once

#include <cstdint>

namespace ds::kernels {

struct RopeShape {
  int64_t rows = 0, T = 1, heads = 1, D = 2;  // D even
  bool inverse = false;
};

void rope_f32(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s);
void rope_bf16(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s);

// Scalar versions (double math) the fast ones are tested against.
void rope_f32_reference(const float* x, float* y, const float* cos, const float* sin, const RopeShape& s);
void rope_bf16_reference(const uint16_t* x, uint16_t* y, const float* cos, const float* sin, const RopeShape& s);

}  // namespace ds::kernels
