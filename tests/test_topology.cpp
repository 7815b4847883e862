#include <gtest/gtest.h>

#include <map>

#include "common/error.hpp"
#include "engine/plan/topology.hpp"

using namespace ds;

namespace {
std::function<const char*(const char*)> env(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST(Topology, DefaultsToOneCpuProcess) {
  Topology t = make_topology({}, env({}));
  EXPECT_EQ(t.world_size, 1);
  EXPECT_EQ(t.device, DeviceKind::cpu);
  EXPECT_NE(t.world_size_source.find("default"), std::string::npos);
}

TEST(Topology, ReadsTheTorchrunEnvironment) {
  Topology t = make_topology({}, env({{"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}, {"RANK", "5"}, {"LOCAL_RANK", "1"}}));
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.ranks_per_node, 4);
  EXPECT_EQ(t.num_nodes, 2);
  EXPECT_EQ(t.rank, 5);
  EXPECT_EQ(t.local_rank, 1);
}

TEST(Topology, FlagsWinOverTheEnvironment) {
  TopologyOptions o;
  o.nproc_per_node = 4;
  o.nnodes = 2;
  Topology t = make_topology(o, env({{"WORLD_SIZE", "3"}}));
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.num_nodes, 2);
}

TEST(Topology, ContradictionsAreUserErrors) {
  TopologyOptions o;
  o.world_size = 6;
  o.nproc_per_node = 4;
  EXPECT_THROW(make_topology(o, env({})), UserError);
  EXPECT_THROW(make_topology({}, env({{"WORLD_SIZE", "two"}})), UserError);
  EXPECT_THROW(make_topology({}, env({{"WORLD_SIZE", "2"}, {"RANK", "2"}})), UserError);
}

TEST(Topology, DeviceMemoryMeansPlanningForGpus) {
  TopologyOptions o;
  o.device_memory_bytes = 80.0 * (1 << 30);
  Topology t = make_topology(o, env({}));
  EXPECT_EQ(t.device, DeviceKind::cuda);
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 80.0 * (1 << 30));
  o.device = "cpu";
  EXPECT_THROW(make_topology(o, env({})), UserError);
}

TEST(Topology, DetectedGpuMemoryIsTheDefault) {
  TopologyOptions o;
  o.gpus = {{"NVIDIA H100", 79.6 * (1 << 30)}};
  Topology t = make_topology(o, env({}));
  EXPECT_EQ(t.device, DeviceKind::cuda);
  EXPECT_DOUBLE_EQ(t.device_memory_bytes, 79.6 * (1 << 30));
  o.device = "cpu";
  EXPECT_EQ(make_topology(o, env({})).device, DeviceKind::cpu);
}

// One place chooses the device: a run here on a build whose LibTorch has no CUDA takes the CPU on "auto"
// (saying why when a GPU is seen) and refuses "cuda"; planning alone still plans for the GPU it sees.
TEST(Topology, TheDeviceIsChosenOnceByWhatThisBuildTrainsOn) {
  TopologyOptions o;
  o.gpus = {{"NVIDIA H200", 140.0 * (1 << 30)}};
  o.build = BuildSupport{};  // CPU LibTorch
  Topology planned = make_topology(o, env({}));
  EXPECT_EQ(planned.device, DeviceKind::cuda);
  EXPECT_TRUE(planned.device_note.empty());
  ASSERT_TRUE(planned.build.has_value());
  EXPECT_FALSE(planned.build->torch_cuda);
  o.runs_here = true;
  Topology here = make_topology(o, env({}));
  EXPECT_EQ(here.device, DeviceKind::cpu);
  EXPECT_NE(here.device_note.find("the 1 GPU nvidia-smi lists is not used"), std::string::npos) << here.device_note;
  o.device = "cuda";
  try {
    make_topology(o, env({}));
    ADD_FAILURE() << "--device cuda ran on a CPU-only build";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("trains on the CPU only"), std::string::npos) << e.what();
  }
  o.build->torch_cuda = true;  // CUDA LibTorch without the CUDA toolkit's Device and kernels: still the CPU's
  EXPECT_THROW(make_topology(o, env({})), UserError);
  o.build->cuda_kernels = "CUDA 13.0, sm_90";  // a CUDA build: the GPU it sees, on auto too
  EXPECT_EQ(make_topology(o, env({})).device, DeviceKind::cuda);
  o.device = "auto";
  EXPECT_EQ(make_topology(o, env({})).device, DeviceKind::cuda);
  o.gpus.clear();  // nothing seen, nothing said
  Topology none = make_topology(o, env({}));
  EXPECT_EQ(none.device, DeviceKind::cpu);
  EXPECT_TRUE(none.device_note.empty());
  o.device = "tpu";
  EXPECT_THROW(make_topology(o, env({})), UserError);
}

// CUDA_VISIBLE_DEVICES as CUDA reads it: indices or UUIDs (a unique prefix will do), in its order, up to the first
// entry that names no GPU or one already listed; unset shows all, "" none.
TEST(Topology, VisibleGpusAreTheOnesCudaVisibleDevicesNames) {
  const std::vector<GpuInfo> listed = {{"NVIDIA H100 80GB HBM3", 80.0 * (1 << 30), "GPU-aaaa1111-0000"},
                                       {"NVIDIA H100 80GB HBM3", 80.0 * (1 << 30), "GPU-bbbb2222-0000"},
                                       {"NVIDIA A100-SXM4-40GB", 40.0 * (1 << 30), "GPU-aaaa3333-0000"},
                                       {"NVIDIA H100 80GB HBM3", 80.0 * (1 << 30), "GPU-cccc4444-0000"}};
  const auto uuids = [&](const char* visible) {
    std::string out;
    for (const GpuInfo& g : visible_gpus(listed, visible)) out += (out.empty() ? "" : " ") + g.uuid.substr(4, 4);
    return out;
  };
  EXPECT_EQ(uuids(nullptr), "aaaa bbbb aaaa cccc");
  EXPECT_EQ(uuids(""), "");
  EXPECT_EQ(uuids("NoDevFiles"), "");  // what Slurm sets when it grants no GPU
  EXPECT_EQ(uuids("3,1"), "cccc bbbb");
  EXPECT_EQ(uuids(" 2 , 0"), "aaaa aaaa");
  EXPECT_EQ(uuids("0,1,9,2"), "aaaa bbbb");   // 9 names no GPU: the list ends there
  EXPECT_EQ(uuids("0,1,-1,3"), "aaaa bbbb");  // the usual way to hide the rest
  EXPECT_EQ(uuids("1,1,2"), "bbbb");          // listed twice: ends
  EXPECT_EQ(uuids("0,1,"), "aaaa bbbb");
  EXPECT_EQ(uuids("GPU-cccc4444-0000,GPU-bbbb"), "cccc bbbb");
  EXPECT_EQ(uuids("GPU-bbbb,GPU-aaaa"), "bbbb");  // GPU-aaaa starts two UUIDs: names neither
  EXPECT_EQ(uuids("MIG-0e9a7d3c-1111,1"), "aaaa");  // one MIG instance, read as the first GPU
  EXPECT_EQ(visible_gpus(listed, "2").front().name, "NVIDIA A100-SXM4-40GB");
  EXPECT_TRUE(visible_gpus({}, "0").empty());
}

// With several GPUs and nothing saying how many ranks: one per GPU, unless a checkpoint being continued was
// trained by fewer (kept), or the plan is refused for several ranks where one runs (one, naming why).
TEST(Topology, SeveralVisibleGpusDefaultToOneRankEachUnlessThatChangesTheRun) {
  std::vector<int> compiled;
  const auto runs = [&](int n) { compiled.push_back(n); return std::vector<std::string>{}; };
  DefaultRanks d = default_ranks_for_gpus(8, std::nullopt, runs);
  EXPECT_EQ(d.ranks, 8);
  EXPECT_EQ(d.note, "8 GPUs visible: 8 ranks, one on each (--nproc-per-node 1 for one)");
  EXPECT_EQ(compiled, (std::vector<int>{1, 8}));
  compiled.clear();
  d = default_ranks_for_gpus(1, std::nullopt, runs);  // one GPU: nothing to choose, nothing said, nothing compiled
  EXPECT_EQ(d.ranks, 1);
  EXPECT_TRUE(d.note.empty());
  EXPECT_TRUE(compiled.empty());
  d = default_ranks_for_gpus(8, 2, runs);
  EXPECT_EQ(d.ranks, 2);
  EXPECT_EQ(d.note, "8 GPUs visible: 2 ranks, as the checkpoint being continued was trained (--nproc-per-node 8 for all, "
                    "the global batch kept)");
  d = default_ranks_for_gpus(4, 16, runs);  // trained on more GPUs than this machine has: all of these
  EXPECT_EQ(d.ranks, 4);
  compiled.clear();
  d = default_ranks_for_gpus(4, 1, runs);
  EXPECT_EQ(d.ranks, 1);
  EXPECT_NE(d.note.find("one rank, as the checkpoint being continued was trained"), std::string::npos) << d.note;
  EXPECT_TRUE(compiled.empty());
  // Refused for several ranks only: one, saying why. Refused alike for one (a build without CUDA, planning): kept.
  const auto offload = [](int n) {
    std::vector<std::string> why = {"training on CUDA devices with this build"};
    if (n > 1) why.push_back("offload from several GPU ranks");
    return why;
  };
  d = default_ranks_for_gpus(4, std::nullopt, offload);
  EXPECT_EQ(d.ranks, 1);
  EXPECT_EQ(d.note, "4 GPUs visible: one rank, since ds cannot run this plan on 4: offload from several GPU ranks");
  d = default_ranks_for_gpus(4, std::nullopt, [](int) { return std::vector<std::string>{"training on CUDA devices with this build"}; });
  EXPECT_EQ(d.ranks, 4);
  d = default_ranks_for_gpus(3, std::nullopt, [](int n) {  // a batch that 3 ranks cannot divide
    return n == 3 ? std::vector<std::string>{"train_batch_size: 8 is not a multiple of 3"} : std::vector<std::string>{};
  });
  EXPECT_EQ(d.ranks, 1);
  EXPECT_NE(d.note.find("train_batch_size: 8 is not a multiple of 3"), std::string::npos) << d.note;
}

// What the plan asks of its device: the communicator, where memory is, fp16 arithmetic, the spellings.
TEST(Topology, TheDevicesTraitsAnswerWhatThePlanAsks) {
  const DeviceTraits cpu = device_traits(DeviceKind::cpu), gpu = device_traits(DeviceKind::cuda);
  EXPECT_EQ(cpu.communicator, CommBackend::gloo);
  EXPECT_EQ(gpu.communicator, CommBackend::nccl);
  EXPECT_TRUE(cpu.memory_is_host);
  EXPECT_FALSE(gpu.memory_is_host);
  EXPECT_FALSE(cpu.computes_fp16);
  EXPECT_TRUE(gpu.computes_fp16);
  for (const DeviceKind k : {DeviceKind::cpu, DeviceKind::cuda})
    EXPECT_EQ(device_kind_from_name(device_kind_name(k)), k);
  EXPECT_FALSE(device_kind_from_name("auto").has_value());
  EXPECT_STREQ(gpu.label, "GPU");
}

TEST(Topology, CarriesTheRendezvousAddressSoTheRuntimeReadsNoEnvironment) {
  Topology t = make_topology({}, env({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "29511"}}));
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.master_addr, "10.0.0.7");
  EXPECT_EQ(t.master_port, 29511);
  EXPECT_THROW(make_topology({}, env({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})), UserError);
}

TEST(Topology, CgroupCpuQuotaIsReadAsCpus) {
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus("150000 100000"), 1.5);
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus("200000 100000\n"), 2.0);
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus("max 100000"), 0.0);  // no quota
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus(""), 0.0);
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus("50000"), 0.0);
  EXPECT_DOUBLE_EQ(cgroup_quota_cpus("12x 100000"), 0.0);
  // The budget: the least of online cores, the affinity mask and the quota rounded up.
  EXPECT_EQ((CoreBudget{8, 0, 0}.usable()), 8);
  EXPECT_EQ((CoreBudget{8, 4, 0}.usable()), 4);
  EXPECT_EQ((CoreBudget{8, 4, 1.5}.usable()), 2);
  EXPECT_EQ((CoreBudget{8, 8, 0.5}.usable()), 1);
  EXPECT_EQ((CoreBudget{0, 0, 0}.usable()), 1);
  EXPECT_EQ((CoreBudget{8, 4, 1.5}.describe()), "2 (8 online, affinity 4, CPU quota 1.5)");
}
