// ds — a CUDA runtime call's error as an exception naming the call: one definition for the kernels' launch
// code, the CUDA Device and kernel table, and the NCCL group.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace ds::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace ds::cuda
