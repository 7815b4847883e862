// ds — DS_HOST_DEVICE marks a small function that the CPU's code and the CUDA kernels both call (the
// optimizers' arithmetic on one element, the counter hash behind dropout), so the two compile one text.
#pragma once

#if defined(__CUDACC__)
#define DS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DS_HOST_DEVICE inline
#endif
