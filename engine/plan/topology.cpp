#include "engine/plan/topology.hpp"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "common/cpu_features.hpp"
#include "common/error.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"

namespace ds {
namespace {

int env_int(const std::function<const char*(const char*)>& getenv_fn, const char* name) {
  const char* v = getenv_fn(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > kMaxWorldSize)
    throw UserError(std::string("environment variable ") + name + "='" + v + "' is not a non-negative integer",
                    "unset it, or set it as torchrun does");
  return static_cast<int>(n);
}

// "auto": a GPU when one is seen or its memory given, unless the run happens here on a build that trains on
// the CPU only.
DeviceKind choose_device(const TopologyOptions& opt, std::string& note) {
  const std::optional<DeviceKind> asked = device_kind_from_name(opt.device);
  if (!asked && opt.device != "auto") throw UserError("unknown device '" + opt.device + "'", "use auto, cpu or cuda");
  const bool cpu_only_here = opt.runs_here && opt.build && !opt.build->trains_on_cuda();
  if (asked == DeviceKind::cuda && cpu_only_here)
    throw UserError(std::string("--device cuda: this build of ds trains on the CPU only (it was built without ") +
                        (opt.build->torch_cuda ? "the CUDA toolkit)" : "CUDA LibTorch)"),
                    "train on the CPU with --device cpu (or leave --device at auto); `ds plan --device cuda` and "
                    "`ds estimate-memory` still plan for GPUs");
  if (asked) return *asked;
  if (cpu_only_here) {
    if (!opt.gpus.empty())
      note = "training on the CPU: this build has no CUDA support, so the " + std::to_string(opt.gpus.size()) +
             (opt.gpus.size() == 1 ? " GPU nvidia-smi lists is" : " GPUs nvidia-smi lists are") + " not used (--device cpu says so explicitly)";
    return DeviceKind::cpu;
  }
  // --gpu plans for that GPU as --device-memory does; a run here trains on what is here, whatever --gpu says.
  const bool gpu_named = !opt.gpu.empty() && !opt.runs_here;
  return !opt.gpus.empty() || opt.device_memory_bytes > 0 || gpu_named ? DeviceKind::cuda : DeviceKind::cpu;
}

Link link_flag(const char* flag, const std::string& text, bool network) {
  const std::optional<Link> link = link_from_text(text, network);
  if (!link)
    throw UserError(std::string(flag) + " '" + text + "' is neither a link ds knows nor a rate",
                    "name one (" + known_link_names() + ") or give its bus bandwidth per GPU, e.g. 100GB/s, or a NIC's line rate, e.g. 400Gb/s");
  return *link;
}

// Whether the plan is for GPUs other than this machine's: none here, or --gpu names another model (planning only:
// a run here is on this machine's), or their memory is given (--device-memory, without --gpu).
bool plans_elsewhere(const TopologyOptions& opt) {
  if (opt.gpus.empty()) return true;
  if (opt.runs_here) return false;
  if (!opt.gpu.empty()) return gpu_from_device_name(opt.gpus.front().name) != gpu_by_name(opt.gpu);
  return opt.device_memory_bytes > 0;
}

// The GPU model (--gpu, else the first detected GPU's when the plan is for this machine and ds knows it), its
// rates and links, and the MFU.
HardwareRates hardware_rates(const TopologyOptions& opt, bool cuda) {
  HardwareRates hw;
  const GpuModel* gpu = nullptr;
  if (!opt.gpu.empty()) {
    gpu = gpu_by_name(opt.gpu);
    if (!gpu) throw UserError("--gpu '" + opt.gpu + "' is not a GPU model ds knows", "name one of " + known_gpu_names() +
                                                                                          ", or give --device-memory (and the link flags) for another");
    if (!cuda)
      throw UserError("--gpu " + opt.gpu + " is for GPUs, but this " + (opt.runs_here ? "run" : "plan") + " is on the CPU" +
                          (opt.device == "cpu"                                ? std::string(" (--device cpu)")
                           : opt.build && !opt.build->trains_on_cuda()       ? std::string(": this build of ds trains on the CPU only")
                                                                              : std::string(": no GPU is visible here")),
                      "drop --gpu; `ds plan --gpu " + opt.gpu + "` plans for that GPU");
  } else if (cuda && !plans_elsewhere(opt)) {
    gpu = gpu_from_device_name(opt.gpus.front().name);
  }
  if (gpu) {
    hw.gpu = gpu->label;
    hw.peak_flops_16bit = gpu->peak_flops_16bit;
    hw.peak_flops_fp32 = gpu->peak_flops_fp32;
    hw.intra_node = *link_from_text(gpu->intra_node_link, false);
  }
  if (gpu) hw.host_link = *host_link_from_text(gpu->host_link);
  if (!opt.host_link.empty()) {
    const std::optional<Link> l = host_link_from_text(opt.host_link);
    if (!l)
      throw UserError("--host-link '" + opt.host_link + "' is neither a link ds knows nor a rate in bytes",
                      "name one (" + known_host_link_names() + ") or give what a GPU's copies to its host's pinned memory sustain, e.g. 50GB/s");
    hw.host_link = *l;
  }
  const auto byte_rate = [](const char* flag, const std::string& text, const char* example) {
    if (text.empty()) return 0.0;
    const std::optional<double> rate = byte_rate_from_text(text);
    if (!rate) throw UserError(std::string(flag) + " '" + text + "' is not a rate in bytes a second", std::string("e.g. ") + flag + " " + example);
    return *rate;
  };
  hw.host_memory_bw = byte_rate("--host-memory-bw", opt.host_memory_bw, "200GB/s (a node's memory, all its cores streaming)");
  hw.nvme_bw = byte_rate("--nvme-bw", opt.nvme_bw, "6GB/s (a node's drives under nvme_path)");
  if (!opt.intra_node_link.empty()) hw.intra_node = link_flag("--intra-node-link", opt.intra_node_link, false);
  if (!opt.inter_node_link.empty()) hw.inter_node = link_flag("--inter-node-link", opt.inter_node_link, true);
  if (opt.mfu != 0) {
    if (!(opt.mfu >= 0.01 && opt.mfu <= 1))
      throw UserError("--mfu " + format_double(opt.mfu) + " is not a share from 0.01 to 1", "e.g. --mfu 0.4: a step's matmuls run at 40% of the peak rate");
    hw.mfu = opt.mfu;
    hw.mfu_given = true;
  }
  return hw;
}

}  // namespace

bool started_as_rank() { return std::getenv("RANK") != nullptr; }

Topology make_topology(const TopologyOptions& opt, const std::function<const char*(const char*)>& getenv_fn) {
  Topology t;
  t.cores_per_node = detect_cores();
  t.host_memory_bytes = detect_host_memory_bytes();
  t.cpu_widens_bf16_products = !cpu_has_avx512();
  t.build = opt.build;
  t.device = choose_device(opt, t.device_note);
  const bool cuda = !t.device_traits().memory_is_host;
  t.rates = hardware_rates(opt, cuda);
  // --gpu naming another model than this machine's plans for another machine: its memory is the model's. A run
  // here uses this machine's GPU, whatever --gpu says of the rates.
  const GpuModel* named = opt.gpu.empty() || opt.runs_here ? nullptr : gpu_by_name(opt.gpu);
  const bool elsewhere = plans_elsewhere(opt) && (opt.gpus.empty() || named);
  if (cuda)
    t.device_memory_bytes = opt.device_memory_bytes > 0 ? opt.device_memory_bytes
                            : !elsewhere                ? opt.gpus.front().memory_bytes
                            : named                     ? named->memory_bytes
                                                        : 0;
  else if (opt.device_memory_bytes > 0)
    throw UserError("--device-memory was given with --device cpu",
                    "a CPU run's memory is the host's; drop --device-memory, or plan for --device cuda");
  if (opt.host_memory_bytes > 0) t.host_memory_bytes = opt.host_memory_bytes;
  else if (cuda && elsewhere) t.host_memory_bytes = 0;  // GPUs of another machine: this one's RAM says nothing of theirs
  if (!(opt.headroom >= 0 && opt.headroom <= 0.9))
    throw UserError("--headroom " + std::to_string(opt.headroom) + " is not a share from 0 to 0.9", "e.g. --headroom 0.1 leaves 10% free");
  t.headroom = opt.headroom;

  const int env_world = env_int(getenv_fn, "WORLD_SIZE");
  const int env_local_world = env_int(getenv_fn, "LOCAL_WORLD_SIZE");
  if (opt.world_size > 0) {
    t.world_size = opt.world_size;
    t.world_size_source = "--world-size";
  } else if (opt.nproc_per_node > 0) {
    // In 64 bits: 65536 x 65536 must not wrap to a world of 0.
    const int64_t world = int64_t{opt.nproc_per_node} * (opt.nnodes > 0 ? opt.nnodes : 1);
    if (world > kMaxWorldSize)
      throw UserError("--nproc-per-node " + std::to_string(opt.nproc_per_node) + " x --nnodes " + std::to_string(opt.nnodes) + " is " +
                          std::to_string(world) + " ranks; ds plans for at most " + std::to_string(kMaxWorldSize),
                      "check the two flags: the world size is their product");
    t.world_size = static_cast<int>(world);
    t.world_size_source = opt.nproc_source.empty() ? "--nproc-per-node x --nnodes" : opt.nproc_source;
  } else if (env_world > 0) {
    t.world_size = env_world;
    t.world_size_source = "WORLD_SIZE (launcher environment)";
  } else {
    t.world_size = 1;
    t.world_size_source = "the default of one process";
  }

  if (opt.nproc_per_node > 0)
    t.ranks_per_node = opt.nproc_per_node;
  else if (opt.nnodes > 0)
    t.ranks_per_node = (t.world_size + opt.nnodes - 1) / opt.nnodes;
  else if (env_local_world > 0)
    t.ranks_per_node = env_local_world;
  else
    t.ranks_per_node = t.world_size;
  if (t.world_size % t.ranks_per_node != 0)
    throw UserError("world size " + std::to_string(t.world_size) + " is not a multiple of the ranks per node (" +
                        std::to_string(t.ranks_per_node) + ")",
                    "every node runs the same number of ranks: check --nproc-per-node and --nnodes");
  t.num_nodes = t.world_size / t.ranks_per_node;
  if (opt.nnodes > 0 && opt.nnodes != t.num_nodes)
    throw UserError("--nnodes " + std::to_string(opt.nnodes) + " does not match world size " + std::to_string(t.world_size) +
                        " / " + std::to_string(t.ranks_per_node) + " ranks per node",
                    "give --world-size or --nproc-per-node with --nnodes, not contradicting values");
  if (const char* addr = getenv_fn("MASTER_ADDR")) t.master_addr = addr;
  t.master_port = env_int(getenv_fn, "MASTER_PORT");
  if (t.master_port > 65535)
    throw UserError("MASTER_PORT=" + std::to_string(t.master_port) + " is not a port", "use 1-65535, as torchrun does");
  t.rank = env_int(getenv_fn, "RANK");
  t.local_rank = env_int(getenv_fn, "LOCAL_RANK");
  if (t.rank >= t.world_size)
    throw UserError("RANK=" + std::to_string(t.rank) + " is not below the world size " + std::to_string(t.world_size),
                    "the launcher environment and the flags disagree");
  return t;
}

namespace {

std::string trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// The listed GPU an entry of CUDA_VISIBLE_DEVICES names: an index, or a UUID ("GPU-..."), whole or a prefix that
// only one GPU's starts with.
std::optional<size_t> named_gpu(const std::vector<GpuInfo>& listed, const std::string& entry) {
  if (entry.rfind("GPU-", 0) == 0) {
    std::optional<size_t> found;
    for (size_t i = 0; i < listed.size(); ++i)
      if (listed[i].uuid.rfind(entry, 0) == 0) {
        if (found) return std::nullopt;  // a prefix of two
        found = i;
      }
    return found;
  }
  if (entry.empty() || entry.size() > 6 || entry.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const size_t index = std::stoul(entry);
  return index < listed.size() ? std::optional<size_t>(index) : std::nullopt;
}

}  // namespace

// Indices follow nvidia-smi's order (PCI bus), which is CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA's default puts
// the fastest first, so on a machine of mixed GPUs the count is right but the GPU an index names may not be.
std::vector<GpuInfo> visible_gpus(const std::vector<GpuInfo>& listed, const char* visible) {
  if (!visible) return listed;
  std::vector<GpuInfo> shown;
  std::vector<bool> taken(listed.size(), false);
  std::stringstream entries(visible);
  for (std::string entry; std::getline(entries, entry, ',');) {
    entry = trimmed(entry);
    if (entry.rfind("MIG-", 0) == 0) {  // CUDA runs on one MIG instance
      if (shown.empty() && !listed.empty()) shown.push_back(listed.front());
      break;
    }
    const std::optional<size_t> at = named_gpu(listed, entry);
    if (!at || taken[*at]) break;
    taken[*at] = true;
    shown.push_back(listed[*at]);
  }
  return shown;
}

std::vector<GpuInfo> detect_gpus() {
  std::vector<GpuInfo> listed;
  FILE* p = popen("nvidia-smi --query-gpu=name,memory.total,uuid --format=csv,noheader,nounits 2>/dev/null", "r");
  if (!p) return listed;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) {
    std::vector<std::string> fields;
    std::stringstream line(buf);
    for (std::string f; std::getline(line, f, ',');) fields.push_back(trimmed(f));
    if (fields.size() < 2) continue;
    GpuInfo g;
    g.name = fields[0];
    g.memory_bytes = std::strtod(fields[1].c_str(), nullptr) * 1024.0 * 1024.0;  // MiB ("[N/A]": 0)
    if (fields.size() > 2) g.uuid = fields[2];
    listed.push_back(g);  // (every row: CUDA_VISIBLE_DEVICES's indices count them all)
  }
  pclose(p);
  std::vector<GpuInfo> gpus = visible_gpus(listed, std::getenv("CUDA_VISIBLE_DEVICES"));
  gpus.erase(std::remove_if(gpus.begin(), gpus.end(), [](const GpuInfo& g) { return !(g.memory_bytes > 0); }), gpus.end());
  return gpus;
}

DefaultRanks default_ranks_for_gpus(int visible, std::optional<int> checkpoint_world,
                                    const std::function<std::vector<std::string>(int)>& refusals) {
  DefaultRanks d;
  if (visible < 2) return d;
  const std::string all = std::to_string(visible);
  const std::string seen = all + " GPUs visible: ";
  // A run continued on as many ranks as it was trained by (DeepSpeed's launcher would take every GPU, and the
  // accumulation would change under the user); more only when asked.
  const int n = checkpoint_world ? std::clamp(*checkpoint_world, 1, visible) : visible;
  const std::string ask = " (--nproc-per-node " + all + " for all, the global batch kept)";
  if (n == 1) {
    d.note = seen + "one rank, as the checkpoint being continued was trained" + ask;
    return d;
  }
  const std::vector<std::string> one = refusals(1);
  std::vector<std::string> only_several;
  for (const std::string& why : refusals(n))
    if (std::find(one.begin(), one.end(), why) == one.end()) only_several.push_back(why);
  if (!only_several.empty()) {
    d.note = seen + "one rank, since ds cannot run this plan on " + std::to_string(n) + ": " + join(only_several, "; ");
    return d;
  }
  d.ranks = n;
  d.note = seen + std::to_string(n) + " ranks, " +
           (n == visible ? "one on each (--nproc-per-node 1 for one)" : "as the checkpoint being continued was trained" + ask);
  return d;
}

double detect_host_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemTotal:") return kib * 1024.0;
  return 0;
}

double cgroup_quota_cpus(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max" || period <= 0) return 0;
  char* end = nullptr;
  const double q = std::strtod(quota.c_str(), &end);
  return *end == '\0' && q > 0 ? q / period : 0;
}

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// The quota of this process's cgroup: v2 (cpu.max under the path /proc/self/cgroup names, or the root's)
// or v1 (cpu.cfs_quota_us / cpu.cfs_period_us).
double detect_cgroup_quota() {
  std::ifstream cg("/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);)
    if (line.rfind("0::", 0) == 0) {
      const double q = cgroup_quota_cpus(read_first_line("/sys/fs/cgroup" + line.substr(3) + "/cpu.max"));
      if (q > 0) return q;
    }
  if (const double q = cgroup_quota_cpus(read_first_line("/sys/fs/cgroup/cpu.max")); q > 0) return q;
  const std::string v1 = read_first_line("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  return v1.empty() || v1[0] == '-' ? 0 : cgroup_quota_cpus(v1 + " " + read_first_line("/sys/fs/cgroup/cpu/cpu.cfs_period_us"));
}

}  // namespace

int CoreBudget::usable() const {
  int n = online > 0 ? online : 1;
  if (affinity > 0) n = std::min(n, affinity);
  if (quota > 0) n = std::min(n, static_cast<int>(std::ceil(quota - 1e-9)));
  return std::max(1, n);
}

std::string CoreBudget::describe() const {
  std::ostringstream o;
  o << usable() << " (" << online << " online, affinity " << (affinity > 0 ? std::to_string(affinity) : std::string("unknown")) << ", ";
  if (quota > 0)
    o << "CPU quota " << quota;
  else
    o << "no CPU quota";
  o << ")";
  return o.str();
}

CoreBudget detect_core_budget() {
  CoreBudget b;
  b.online = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) b.affinity = CPU_COUNT(&set);
  b.quota = detect_cgroup_quota();
  return b;
}

int detect_cores() { return detect_core_budget().usable(); }

}  // namespace ds
