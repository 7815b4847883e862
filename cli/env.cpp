#include "cli/env.hpp"

#include <sys/statvfs.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/version.hpp"
#include "common/format.hpp"
#include "engine/plan/topology.hpp"
#include "engine/runtime/device/build_support.hpp"
#include "kernels/cpu/attention_tiles.hpp"

namespace ds::cli {
namespace {

using ojson = nlohmann::ordered_json;

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

std::set<std::string> cpu_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream ss(line.substr(line.find(':') + 1));
      std::set<std::string> out;
      std::string w;
      while (ss >> w) out.insert(w);
      return out;
    }
  return {};
}

std::vector<std::string> other_ds_on_path() {
  std::vector<std::string> out;
  char self[PATH_MAX] = {0};
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  std::string me = n > 0 ? std::string(self, n) : "";
  const char* path = std::getenv("PATH");
  if (!path) return out;
  std::istringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    std::string cand = dir + "/ds";
    if (access(cand.c_str(), X_OK) != 0) continue;
    char real[PATH_MAX] = {0};
    if (realpath(cand.c_str(), real) && me != real) out.push_back(cand);
  }
  return out;
}

}  // namespace

Subcommand setup_env(CLI::App& app) {
  auto args = std::make_shared<EnvArgs>();
  CLI::App* sub = app.add_subcommand("env", "report versions, cores, memory, CPU features, GPUs and /dev/shm");
  sub->add_flag("--json", args->json, "print the report as JSON");
  sub->footer(R"(Examples:
  ds env
      the report to paste into a bug report
  ds env --json | jq .shm_bytes
      one field for a script)");
  return {sub, [args] { return run_env(*args); }};
}

int run_env(const EnvArgs& a) {
  return run_guarded("env", [&] {
    const auto flags = cpu_flags();
    struct statvfs shm {};
    double shm_bytes = statvfs("/dev/shm", &shm) == 0 ? static_cast<double>(shm.f_blocks) * shm.f_frsize : 0;
    const auto gpus = detect_gpus();
    const CudaSeen cuda = cuda_seen();
    const auto others = other_ds_on_path();
    std::vector<std::string> launcher;
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_CORETYPE", "OPENBLAS_THREAD_TIMEOUT",
                          "CUDA_VISIBLE_DEVICES"})
      if (const char* val = std::getenv(v)) launcher.push_back(std::string(v) + "=" + val);
    const bool bf16_fast = flags.count("avx512_bf16") || flags.count("amx_bf16");

    if (a.json) {
      ojson j;
      j["schema_version"] = 1;
      j["ds_version"] = version_short();
      j["cpu"] = cpu_model();
      const CoreBudget cores = detect_core_budget();
      j["cores"] = cores.usable();
      j["cores_detail"] = {{"online", cores.online}, {"affinity", cores.affinity}, {"cgroup_quota_cpus", cores.quota}};
      j["memory_bytes"] = static_cast<int64_t>(detect_host_memory_bytes());
      j["cpu_features"] = {{"avx2", flags.count("avx2") > 0},
                           {"avx512f", flags.count("avx512f") > 0},
                           {"avx512_bf16", flags.count("avx512_bf16") > 0},
                           {"amx_bf16", flags.count("amx_bf16") > 0}};
      j["attention_tiles"] = {{"fp32", kernels::causal_attention_tiles_available()},
                              {"bf16", kernels::causal_attention_tiles_bf16_available()}};
      j["attention_bf16_products"] = kernels::bf16_products_name(kernels::attention_tiles_bf16_products());
      ojson g = ojson::array();
      for (const auto& gpu : gpus) g.push_back({{"name", gpu.name}, {"memory_bytes", static_cast<int64_t>(gpu.memory_bytes)}});
      j["gpus"] = g;
      j["cuda"] = {{"kernels_built", cuda.kernels_built}, {"devices_visible", cuda.devices}, {"reason", cuda.why}};
      j["shm_bytes"] = static_cast<int64_t>(shm_bytes);
      j["environment"] = launcher;
      j["other_ds_on_path"] = others;
      std::cout << j.dump(2) << "\n";
      return 0;
    }
    std::cout << version_text() << "\n";
    std::cout << "machine\n";
    std::cout << "  cpu          " << cpu_model() << "\n";
    std::cout << "  cores        " << detect_core_budget().describe() << "\n";
    std::cout << "  memory       " << format_bytes(detect_host_memory_bytes()) << "\n";
    std::cout << "  cpu features avx2 " << (flags.count("avx2") ? "yes" : "no") << ", avx512f "
              << (flags.count("avx512f") ? "yes" : "no") << ", avx512_bf16 " << (flags.count("avx512_bf16") ? "yes" : "no")
              << ", amx_bf16 " << (flags.count("amx_bf16") ? "yes" : "no")
              << (bf16_fast ? "  (bf16 matmuls run natively: prefer bf16 on CPU)" : "") << "\n";
    // Which attention kernels a run here gets (engine/runtime/model/fused_attention): tiles, or the block path.
    std::cout << "  attention    fp32 " << (kernels::causal_attention_tiles_available() ? "tiles (AVX-512)" : "blocks")
              << ", bf16 "
              << (kernels::causal_attention_tiles_bf16_available()
                      ? std::string("tiles (") + kernels::bf16_products_name(kernels::attention_tiles_bf16_products()) + ")"
                      : std::string("blocks"))
              << "\n";
    std::cout << "  gpus         " << (gpus.empty() ? "none found (no nvidia-smi or no GPU)" : "") << "\n";
    for (const auto& g : gpus) std::cout << "    " << g.name << ", " << format_bytes(g.memory_bytes) << "\n";
    std::cout << "  cuda         "
              << (!cuda.kernels_built            ? std::string("not built into this ds (no CUDA toolkit at build time)")
                  : cuda.devices > 0     ? std::to_string(cuda.devices) + " device(s) visible to the CUDA runtime"
                                         : "no device visible to the CUDA runtime (" + cuda.why + ")")
              << "\n";
    std::cout << "  /dev/shm     " << format_bytes(shm_bytes) << "\n";
    std::cout << "environment\n";
    if (launcher.empty()) std::cout << "  (no launcher or threading variables set)\n";
    for (const auto& l : launcher) std::cout << "  " << l << "\n";
    if (shm_bytes > 0 && shm_bytes < 512.0 * 1024 * 1024)
      std::cerr << "ds env: " << yellow("warning:", stderr) << " /dev/shm is only " << format_bytes(shm_bytes)
                << "; multi-process collectives can fail or slow down (in Docker, pass --shm-size=1g or more)\n";
    for (const auto& o : others)
      std::cerr << "ds env: " << yellow("warning:", stderr) << " another `ds` is on PATH: " << o
                << " (DeepSpeed's Python package installs one); check `ds --version` names this toolchain\n";
    return 0;
  });
}

}  // namespace ds::cli
