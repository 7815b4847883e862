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
