// ds — Topology: how many ranks, where this one sits, what device it has. Built once at start-up from
// flags or the launcher environment (torchrun's variables); the plan takes it as an input.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace ds {

enum class DeviceKind { cpu, cuda };

struct Topology {
  int world_size = 1;        // data-parallel ranks in total
  int ranks_per_node = 1;
  int num_nodes = 1;
  int rank = 0, local_rank = 0;
  std::string master_addr;  // where ranks rendezvous (MASTER_ADDR); "" for one rank
  int master_port = 0;      // MASTER_PORT
  DeviceKind device = DeviceKind::cpu;
  double device_memory_bytes = 0;  // per rank; 0 = unknown
  double host_memory_bytes = 0;    // per node; 0 = unknown
  int cores_per_node = 1;
  std::string world_size_source;   // "--world-size", "WORLD_SIZE (launcher)", "default (one process)"
};

struct GpuInfo {
  std::string name;
  double memory_bytes = 0;
};

struct TopologyOptions {
  int world_size = 0;       // 0: not given
  int nproc_per_node = 0;
  int nnodes = 0;
  double device_memory_bytes = 0;  // 0: not given (a detected GPU's memory, else unknown)
  std::string device = "auto";     // "auto" | "cpu" | "cuda"
  std::vector<GpuInfo> gpus;       // detected GPUs (detect_gpus()), injectable for tests
};

// The device: "cuda" when asked, or on "auto" when a GPU is detected or --device-memory is given;
// otherwise "cpu". Flags win over the environment; the environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
// wins over defaults. `getenv` is injectable for tests. Throws UserError on contradictions.
Topology make_topology(const TopologyOptions& opt, const std::function<const char*(const char*)>& getenv_fn);

// GPUs the NVIDIA driver lists (via nvidia-smi); empty without a driver or GPU.
std::vector<GpuInfo> detect_gpus();

// This machine's total memory (/proc/meminfo) and online cores; 0 when unknown.
double detect_host_memory_bytes();
int detect_cores();

}  // namespace ds
