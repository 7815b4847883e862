// ds — Topology: how many ranks, where this one sits, what device it has. Built once at start-up from
// flags or the launcher environment (torchrun's variables); the plan takes it as an input.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/plan/device_traits.hpp"
#include "engine/plan/hardware.hpp"

namespace ds {

// The most ranks ds plans for (flags, environment and convert-ckpt alike).
inline constexpr int kMaxWorldSize = 1 << 20;
// The share of device and host memory left free when judging what fits (engine/plan/fit.hpp): what the
// memory model does not count (allocator slack, the CUDA context, library workspaces).
inline constexpr double kDefaultHeadroom = 0.10;



struct Topology {
  int world_size = 1;        // data-parallel ranks in total
  int ranks_per_node = 1;
  int num_nodes = 1;
  int rank = 0, local_rank = 0;
  std::string master_addr;  // where ranks rendezvous (MASTER_ADDR); "" for one rank
  int master_port = 0;      // MASTER_PORT
  DeviceKind device = DeviceKind::cpu;
  DeviceTraits device_traits() const { return ds::device_traits(device); }
  // The library between ranks: the device's (Gloo between CPU ranks, NCCL between GPUs) unless set. Set by the
  // tests, which run ZeRO on thread ranks as it runs over NCCL (LocalGroup speaking NCCL's terms).
  std::optional<CommBackend> communicator;
  CommBackend comm_backend() const { return communicator.value_or(device_traits().communicator); }
  // Whether an offloaded optimizer's gradients leave the device block by block into host memory (DeepSpeed's
  // ZeRO-Offload on a GPU): where the device has memory of its own, unless set. Set by the tests, which run
  // that path on the CPU's separate-memory test device.
  std::optional<bool> gradients_leave_per_block;
  bool grads_leave_per_block() const { return gradients_leave_per_block.value_or(!device_traits().memory_is_host); }
  // Whether the optimizer's kernel, stepping states in one place, may write bf16 weights in another in place (one
  // memory holds both: the CPU device), unless set. Set by the tests that run the separate-memory test device, whose
  // weights cross between places by copies as a GPU's do.
  std::optional<bool> host_writes_device;
  bool host_writes_device_memory() const { return host_writes_device.value_or(device_traits().memory_is_host); }
  // The build of ds that plans (ds plan, train, profile): what it lacks on the device is refused in the plan.
  // None: a plan for any build (estimate-memory, the tests' plans).
  std::optional<BuildSupport> build;
  std::string device_note;  // why "auto" chose the device it did, where the choice is not the obvious one ("" none)
  double device_memory_bytes = 0;  // per rank; 0 = unknown
  double host_memory_bytes = 0;    // per node; 0 = unknown
  double headroom = kDefaultHeadroom;  // left free of each when judging fit (--headroom)
  int cores_per_node = 1;
  // The CPU device takes bf16 products in fp32 (no AVX-512, where LibTorch 1.13's own products accumulate in bf16;
  // engine/runtime/model/matmul.cpp), each holding fp32 copies of its operands while it runs: the plan counts them.
  bool cpu_widens_bf16_products = false;
  // What the device and the links between ranks can do, for the plan's time prediction: from --gpu or the
  // detected GPU's model, and the link flags (unknown where neither says).
  HardwareRates rates;
  std::string world_size_source;   // "--world-size", "WORLD_SIZE (launcher)", "default (one process)"
};

struct GpuInfo {
  std::string name;
  double memory_bytes = 0;
  std::string uuid;  // "GPU-..." as nvidia-smi lists it ("" unknown)
};

struct TopologyOptions {
  int world_size = 0;       // 0: not given
  int nproc_per_node = 0;
  int nnodes = 0;
  double device_memory_bytes = 0;  // 0: not given (a detected GPU's memory, else unknown)
  // 0: not given: this machine's, except when planning for GPUs this machine does not have (--device-memory
  // with none detected), whose host memory is then unknown.
  double host_memory_bytes = 0;
  double headroom = kDefaultHeadroom;
  std::string device = "auto";     // "auto" | "cpu" | "cuda"
  // The GPU model planned for (a known_gpus() name): its memory where --device-memory is not given, its peak
  // rates and its node's link; it plans for GPUs (on "auto") as --device-memory does. "": the detected GPU's.
  std::string gpu;
  std::string intra_node_link, inter_node_link;  // a known link's name or a rate; "": the GPU's own / unknown
  std::string host_link;                          // a GPU's link to its host: a name or a rate; "": the GPU's own
  std::string host_memory_bw, nvme_bw;            // rates, e.g. "200GB/s"; "": unknown
  double mfu = 0;                  // the share of peak a step reaches; 0: kAssumedMfu
  std::vector<GpuInfo> gpus;       // detected GPUs (detect_gpus()), injectable for tests
  std::string nproc_source;        // what set nproc_per_node, for world_size_source ("": the --nproc-per-node flag)
  std::optional<BuildSupport> build;  // this binary's (build_support()), carried into the Topology
  // The run happens here (ds train, ds profile): a build without CUDA LibTorch trains on the CPU, so "auto"
  // takes the CPU whatever GPUs are seen, and "cuda" is refused. Planning alone may plan for GPUs.
  bool runs_here = false;
};

// The device, the one place it is chosen: "cuda" when asked, or on "auto" when a GPU is detected or
// --device-memory is given; otherwise "cpu" (and always "cpu" on "auto" for a run here on a build that trains
// on the CPU only, saying why in device_note). Flags win over the environment; the environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
// wins over defaults. `getenv` is injectable for tests. Throws UserError on contradictions.
Topology make_topology(const TopologyOptions& opt, const std::function<const char*(const char*)>& getenv_fn);

// Whether this process is one rank of a run a launcher started (ds's own, torchrun, DeepSpeed's launcher,
// Slurm through them): RANK is in its environment. The launcher itself and a lone process are not. The one
// place that reads RANK outside make_topology; after the plan is compiled, its topology's rank says the rest.
bool started_as_rank();

// The GPUs this process's CUDA sees (via nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES); empty without a
// driver or GPU.
std::vector<GpuInfo> detect_gpus();

// Of the GPUs nvidia-smi lists, those CUDA shows a process whose CUDA_VISIBLE_DEVICES is `visible` (nullptr: unset,
// all of them), in its order. As CUDA reads it: a comma-separated list of indices or UUIDs ("GPU-" and a unique
// prefix of one), ending at the first entry that names no GPU or one already listed ("" or "NoDevFiles": none);
// a MIG instance ("MIG-...") is one device, counted here as its parent GPU (nvidia-smi's first), and ends the list.
std::vector<GpuInfo> visible_gpus(const std::vector<GpuInfo>& listed, const char* visible);

// How many ranks a run on this machine's GPUs starts when nothing says (no --nproc-per-node, --world-size,
// --hostfile or launcher environment): one per visible GPU, as DeepSpeed's launcher does, except where that
// would change the run unasked. `refusals(n)` compiles the plan for n ranks and returns what keeps ds from
// running it (the compiler's error, or the plan's not-yet-runnable reasons; empty when it runs). A checkpoint
// being continued keeps its world size (fewer when fewer GPUs are visible); a plan refused for several ranks for
// a reason one rank does not meet trains on one. `note` says what was chosen and why ("" with one GPU).
struct DefaultRanks {
  int ranks = 1;
  std::string note;
};
DefaultRanks default_ranks_for_gpus(int visible, std::optional<int> checkpoint_world,
                                    const std::function<std::vector<std::string>(int)>& refusals);

// This machine's total memory (/proc/meminfo); 0 when unknown.
double detect_host_memory_bytes();

// The CPUs this process may really use: the online cores narrowed by its affinity mask (taskset, Slurm and
// container cpusets) and by a cgroup CPU quota (docker --cpus, Kubernetes limits). More threads than
// this only wait on each other: a quota of 1 CPU shared by 2 spinning threads halves the rate or worse.
struct CoreBudget {
  int online = 0;     // std::thread::hardware_concurrency
  int affinity = 0;   // CPUs in sched_getaffinity's mask; 0 unknown
  double quota = 0;   // cgroup CPU quota in CPUs; 0 none
  int usable() const;            // the smallest of the three (the quota rounded up), at least 1
  std::string describe() const;  // "2 (2 online, affinity 2, no CPU quota)"
};
CoreBudget detect_core_budget();
int detect_cores();  // detect_core_budget().usable()
// CPUs granted by a cgroup v2 cpu.max text ("150000 100000" -> 1.5); 0 for "max ..." or anything unreadable.
double cgroup_quota_cpus(const std::string& cpu_max);

}  // namespace ds
