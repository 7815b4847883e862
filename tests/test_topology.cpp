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
