#include "cli/version.hpp"

#include <CLI/Version.hpp>
#include <nlohmann/json.hpp>

#include <torch/version.h>

#include "build_info.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "kernels/cpu/adam.hpp"

namespace ds::cli {

std::string version_short() { return std::string(DS_VERSION) + " (git " + DS_GIT_REVISION + ")"; }

std::string version_text() {
  std::string compiler =
#if defined(__clang__)
      "clang " __clang_version__;
#elif defined(__GNUC__)
      "g++ " __VERSION__;
#else
      "unknown compiler";
#endif
#if defined(DS_CUDA_KERNELS) && defined(DS_TORCH_CUDA)
  const std::string cuda_kernels = "compiled (" DS_CUDA_KERNELS "), ds train runs on the GPU";
#elif defined(DS_CUDA_KERNELS)
  // Compiled and linked; training on the GPU needs a build against CUDA LibTorch as well.
  const std::string cuda_kernels = "compiled (" DS_CUDA_KERNELS "), not used: this LibTorch has no CUDA, ds train runs on the CPU";
#else
  const std::string cuda_kernels = "not built in";
#endif
#ifdef DS_TORCH_CUDA
  const std::string torch_kind = "CUDA";
#else
  const std::string torch_kind = "CPU";
#endif
  return "ds " + version_short() +
         "\n  the native C++ training toolchain (config -> plan -> run); not DeepSpeed's Python `ds` launcher\n"
         "  build: " + std::string(DS_BUILD_TYPE) + ", " + compiler + ", C++17\n" +
         "  libraries: nlohmann/json " + std::to_string(NLOHMANN_JSON_VERSION_MAJOR) + "." +
         std::to_string(NLOHMANN_JSON_VERSION_MINOR) + "." + std::to_string(NLOHMANN_JSON_VERSION_PATCH) +
         ", CLI11 " CLI11_VERSION ", valijson (JSON Schema)\n"
         "  LibTorch " TORCH_VERSION " (" + torch_kind + "); CUDA kernels: " + cuda_kernels + "; NCCL: not built in; HDF5 " + hdf5_version() + "\n"
         "  fused optimizer kernel: " + std::string(kernels::adam_implementation()) + "\n"
         "  fp32 products of the layers: " DS_FP32_PRODUCTS "\n";
}

}  // namespace ds::cli
