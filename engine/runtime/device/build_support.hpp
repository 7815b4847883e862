// ds — what this binary was built with, said in one place: whether its LibTorch has CUDA (so ds trains on
// GPUs), whether kernels/cuda are compiled in, and what the CUDA runtime sees. The build's macros are read
// here and in the device's own files (device.cpp, kernel_route.cpp), nowhere else; the CLI gives the
// answer to the topology (engine/plan/device_traits.hpp), so `ds plan` refuses what this build lacks. No LibTorch.
#pragma once

#include <string>

#include "engine/plan/device_traits.hpp"

namespace ds {

BuildSupport build_support();

// GPUs the CUDA runtime sees, for `ds env` (0 without kernels/cuda in the build, or without a driver; `why`
// then says which).
struct CudaSeen {
  bool kernels_built = false;
  int devices = 0;
  std::string why;
};
CudaSeen cuda_seen();

}  // namespace ds
