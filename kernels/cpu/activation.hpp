// ds — the MLP activations, forward and backward, elementwise over fp32 or bf16:
//
// GELU with the tanh approximation (GPT-2's gelu_new; LibTorch 1.13's bf16 GELU forward + backward
// took ~11 ms at one GPT-2 MLP's shape):
//   u = sqrt(2/pi) (x + 0.044715 x^3),  y = x (1 + tanh u) / 2
//   dx = dy ((1 + tanh u) / 2 + x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2) / 2)
// SwiGLU's gate (Llama's MLP: silu(gate) * up, one op so silu(gate) is never kept for backward):
//   s = sigmoid(g),  y = g s u,  dg = dy u s (1 + g (1 - s)),  du = dy g s
// Math in fp32; bf16 results rounded to nearest even. Raw pointers, no allocation, no LibTorch.
#pragma once

#include <cstdint>

namespace ds::kernels {

void gelu_tanh_forward_f32(const float* x, float* y, int64_t n);
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n);
void gelu_tanh_backward_f32(const float* dy, const float* x, float* dx, int64_t n);
void gelu_tanh_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n);

void swiglu_forward_f32(const float* g, const float* u, float* y, int64_t n);
void swiglu_forward_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n);
void swiglu_backward_f32(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n);
void swiglu_backward_bf16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n);

// Scalar versions (double math) the fast ones are tested against.
void gelu_tanh_forward_f32_reference(const float* x, float* y, int64_t n);
void gelu_tanh_forward_bf16_reference(const uint16_t* x, uint16_t* y, int64_t n);
void gelu_tanh_backward_f32_reference(const float* dy, const float* x, float* dx, int64_t n);
void gelu_tanh_backward_bf16_reference(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n);

void swiglu_forward_f32_reference(const float* g, const float* u, float* y, int64_t n);
void swiglu_forward_bf16_reference(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n);
void swiglu_backward_f32_reference(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n);
void swiglu_backward_bf16_reference(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du,
                                    int64_t n);

}  // namespace ds::kernels
