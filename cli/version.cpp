#include "cli/version.hpp"

#include <CLI/Version.hpp>
#include <nlohmann/json.hpp>

#include "build_info.hpp"

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
  return "ds " + version_short() +
         "\n  the native C++ training toolchain (config -> plan -> run); not DeepSpeed's Python `ds` launcher\n"
         "  build: " + std::string(DS_BUILD_TYPE) + ", " + compiler + ", C++17\n" +
         "  libraries: nlohmann/json " + std::to_string(NLOHMANN_JSON_VERSION_MAJOR) + "." +
         std::to_string(NLOHMANN_JSON_VERSION_MINOR) + "." + std::to_string(NLOHMANN_JSON_VERSION_PATCH) +
         ", CLI11 " CLI11_VERSION ", valijson (JSON Schema)\n"
         "  LibTorch: not linked in this build; CUDA: not linked; NCCL: not linked; HDF5: not linked\n"
         "  (this build plans and estimates memory; training, checkpoint conversion and profiling are not built in yet)\n";
}

}  // namespace ds::cli
