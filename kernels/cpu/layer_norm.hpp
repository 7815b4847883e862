// ds — LayerNorm and RMSNorm over the last dimension of a (rows x C) matrix, forward and backward,
// for fp32 or bf16 data with fp32 statistics (LibTorch 1.13's bf16 layer_norm took ~15x its fp32
// time at GPT-2's shapes; this one reads and writes each element once per pass).
//
//   LayerNorm: y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps)   (biased variance)
//   RMSNorm:   y = x * rstd * w,                rstd = 1 / sqrt(mean(x^2) + eps)   (b null, mean 0)
//   backward:  xhat = (x - mean) * rstd,  g = dy * w
//              dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (RMSNorm: without mean(g))
//              dw += sum over rows of dy * xhat,  db += sum over rows of dy
// Statistics and sums in fp32; bf16 outputs rounded to nearest even. dw and db are fp32 and added
// to (the caller zeroes them). Raw pointers, no allocation, no LibTorch; OpenMP over rows (forward,
// dx) and over columns (dw, db).
#pragma once

#include <cstdint>

namespace ds::kernels {

struct NormShape {
  int64_t rows = 0, cols = 0;
  float eps = 1e-5f;
  bool rms = false;  // RMSNorm: no mean, no bias
};

// mean and rstd receive one fp32 per row (mean is 0 for RMSNorm); b is null for RMSNorm.
void norm_forward_f32(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, const NormShape& s);
void norm_forward_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, float* mean, float* rstd,
                       const NormShape& s);
// db may be null (RMSNorm).
void norm_backward_f32(const float* dy, const float* x, const float* w, const float* mean, const float* rstd, float* dx,
                       float* dw, float* db, const NormShape& s);
void norm_backward_bf16(const uint16_t* dy, const uint16_t* x, const uint16_t* w, const float* mean, const float* rstd,
                        uint16_t* dx, float* dw, float* db, const NormShape& s);

// Plain scalar versions (double statistics) the fast ones are tested against.
void norm_forward_f32_reference(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                                const NormShape& s);
void norm_forward_bf16_reference(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, float* mean,
                                 float* rstd, const NormShape& s);
void norm_backward_f32_reference(const float* dy, const float* x, const float* w, const float* mean, const float* rstd,
                                 float* dx, float* dw, float* db, const NormShape& s);
void norm_backward_bf16_reference(const uint16_t* dy, const uint16_t* x, const uint16_t* w, const float* mean,
                                  const float* rstd, uint16_t* dx, float* dw, float* db, const NormShape& s);

}  // namespace ds::kernels
