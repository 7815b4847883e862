#include "engine/runtime/run/runtime_library.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <vector>

namespace ds {
namespace {

std::string g_loaded_from;

RuntimeTrainFn load() {
  static RuntimeTrainFn fn = nullptr;
  if (fn) return fn;
  std::vector<std::string> tried;
  if (const char* env = std::getenv("DS_RUNTIME_LIBRARY"); env && *env) {
    tried.push_back(env);
  } else {
    char self[PATH_MAX] = {0};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    const std::filesystem::path dir = n > 0 ? std::filesystem::path(std::string(self, static_cast<size_t>(n))).parent_path()
                                            : std::filesystem::current_path();
    tried.push_back((dir / "libds_train.so").string());                       // the build tree
    tried.push_back((dir.parent_path() / "lib" / "ds" / "libds_train.so").string());  // cmake --install
  }
  std::string errors;
  for (const auto& path : tried) {
    // RTLD_LOCAL: the library's copies of ds's own code stay its own; only the entry point is looked up.
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      fn = reinterpret_cast<RuntimeTrainFn>(dlsym(h, "ds_runtime_train"));
      if (!fn) throw std::runtime_error("'" + path + "' has no ds_runtime_train: not ds's training runtime");
      g_loaded_from = path;
      return fn;
    }
    const char* why = dlerror();
    errors += "\n    " + path + ": " + (why ? why : "not found");
  }
  throw std::runtime_error("cannot load ds's training runtime (libds_train.so, LibTorch):" + errors +
                           "\n    hint: build it (scripts/build.sh) or install ds with cmake --install; DS_RUNTIME_LIBRARY names it");
}

}  // namespace

TrainResult train_with_runtime(const Plan& plan, const TrainOptions& options) {
  TrainResult result;
  load()(&plan, &options, &result);
  return result;
}

std::string runtime_library_path() { return g_loaded_from; }

}  // namespace ds
