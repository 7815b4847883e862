// ds — dropout on a CUDA GPU: the host's kernels/cpu/dropout over device pointers, the same mask
// (kernels/dropout_mask.hpp) and the same rounding, so a GPU run drops what the CPU run drops. Only queues
// work on `stream` (a cudaStream_t; null: the legacy default stream). No LibTorch here.
#pragma once

#include <cstdint>

namespace ds::kernels::cuda {

void dropout_f32(const float* x, float* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream);
void dropout_bf16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream);
void dropout_fp16(const uint16_t* x, uint16_t* y, int64_t n, uint64_t key, uint32_t keep_below, float scale, void* stream);  // fp16's bits

}  // namespace ds::kernels::cuda
