#include "cli/version.hpp"

#include <CLI/Version.hpp>
#include <nlohmann/json.hpp>

#include <torch/version.h>

#include "build_info.hpp"
#include "engine/runtime/device/build_support.hpp"
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
  const BuildSupport build = build_support();
  // Compiled and linked without CUDA LibTorch, the kernels wait: training on the GPU needs both.
  const std::string cuda_kernels = build.cuda_kernels.empty() ? "not built in"
                                   : build.torch_cuda         ? "compiled (" + build.cuda_kernels + "), ds train runs on the GPU"
                                                              : "compiled (" + build.cuda_kernels + "), not used: this LibTorch has no CUDA, ds train runs on the CPU";
  const std::string torch_kind = build.torch_cuda ? "CUDA" : "CPU";
  return "ds " + version_short() +
         "\n  the native C++ training toolchain (config -> plan -> run); not DeepSpeed's Python `ds` launcher\n"
         "  build: " + std::string(DS_BUILD_TYPE) + ", " + compiler + ", C++17\n" +
         "  libraries: nlohmann/json " + std::to_string(NLOHMANN_JSON_VERSION_MAJOR) + "." +
         std::to_string(NLOHMANN_JSON_VERSION_MINOR) + "." + std::to_string(NLOHMANN_JSON_VERSION_PATCH) +
         ", CLI11 " CLI11_VERSION ", valijson (JSON Schema)\n"
         "  LibTorch " TORCH_VERSION " (" + torch_kind + "); CUDA kernels: " + cuda_kernels + "; NCCL: " + (build.nccl.empty() ? std::string("not built in") : build.nccl) + "; HDF5 " + hdf5_version() + "\n"
         "  fused optimizer kernel: " + std::string(kernels::adam_implementation()) + "\n"
         "  fp32 products of the layers: " DS_FP32_PRODUCTS "\n";
}

}  // namespace ds::cli
