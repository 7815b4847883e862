// ds — the MLP activations on a CUDA GPU: the GPU's twin of kernels/cpu/activation (GELU with the tanh
// approximation, SwiGLU's gate; the same formulas, fp32 math, bf16 rounded as the CPU rounds it), one kernel
// a pass where LibTorch ran silu, mul and their backward (SwiGLU: four kernels and silu(gate) kept; now one
// each way, nothing kept but the inputs). Elementwise over n elements; 16-byte loads where every pointer is
// aligned and n a multiple of a load. Device pointers; only queues work on `stream` (a cudaStream_t; null: the
// legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

namespace ds::kernels::cuda {

void gelu_tanh_forward_f32(const float* x, float* y, int64_t n, void* stream);
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n, void* stream);
void gelu_tanh_backward_f32(const float* dy, const float* x, float* dx, int64_t n, void* stream);
void gelu_tanh_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n, void* stream);

// fp16 (IEEE binary16 bits, as the optimizers' fp16 entry points take them): the same fp32 math, rounded to fp16.
void gelu_tanh_forward_fp16(const uint16_t* x, uint16_t* y, int64_t n, void* stream);
void gelu_tanh_backward_fp16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n, void* stream);

void swiglu_forward_f32(const float* g, const float* u, float* y, int64_t n, void* stream);
void swiglu_forward_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n, void* stream);
void swiglu_backward_f32(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n, void* stream);
void swiglu_backward_bf16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n,
                          void* stream);
void swiglu_forward_fp16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n, void* stream);
void swiglu_backward_fp16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg, uint16_t* du, int64_t n,
                          void* stream);

}  // namespace ds::kernels::cuda
