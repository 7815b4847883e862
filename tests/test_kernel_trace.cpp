// ds profile's GPU kernel list, the parts that need no GPU: a kernel's name as listed (real names as nvcc and
// LibTorch's CUDA build mangle them, written out here by hand), and the runs CUPTI hands back added up by that
// name, step by step and as a step's mean. The trace itself runs in the GPU test of ds profile.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/runtime/device/kernel_trace.hpp"

using namespace ds;

TEST(KernelTrace, AKernelIsListedByItsNameWithoutTemplateArgumentsParametersOrAnonymousNamespaces) {
  // ds's cross-entropy (nvcc names the anonymous namespace _GLOBAL__N_...), its GELU through map_kernel, and
  // LibTorch's fill.
  EXPECT_EQ(short_kernel_name("_ZN2ds7kernels4cuda49_GLOBAL__N__cbfb395e_16_cross_entropy_cu_00fa555520cross_entropy_kernelIfLb0EEEvPT_PKlllfbPf"),
            "ds::kernels::cuda::cross_entropy_kernel<...>");
  EXPECT_EQ(short_kernel_name("_ZN2ds7kernels4cuda46_GLOBAL__N__d0328036_13_activation_cu_cb74eb6f10map_kernelIfLi4ELi1ENS2_"
                              "11GeluForwardEEEvNS2_6InputsIT_XT1_EEEPS6_lT2_"),
            "ds::kernels::cuda::map_kernel<...>");
  EXPECT_EQ(short_kernel_name("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"),
            "at::native::vectorized_elementwise_kernel<...>");
  // cuBLAS's kernels are not mangled; nor is a C kernel. A name that only looks mangled stays as it is.
  EXPECT_EQ(short_kernel_name("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"),
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1");
  EXPECT_EQ(short_kernel_name("_Znot a mangled name"), "_Znot a mangled name");
  EXPECT_EQ(short_kernel_name(""), "");
}

TEST(KernelTrace, RunsAddUpByListedNameTheLongestFirst) {
  const std::string fill = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_";
  const std::string fill_bf16 = "_ZN2at6native29vectorized_elementwise_kernelILi8ENS0_11FillFunctorIN3c108BFloat16EEESt5arrayIPcLm1EEEEviT0_T1_";
  const std::vector<KernelRun> runs = {
      {"gemm", 1000, 4000},       // 3 us
      {fill, 5000, 5500},         // 0.5 us
      {"gemm", 6000, 8000},       // 2 us
      {fill_bf16, 9000, 9250},    // 0.25 us: another instantiation of the same kernel
      {"late", 10000, 9000},      // an end before its start (never seen): no time, one launch
      {"memset_like", 20000, 20100}};
  const std::vector<KernelTime> t = kernel_totals(runs);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].name, "gemm");
  EXPECT_EQ(t[0].launches, 2);
  EXPECT_NEAR(t[0].seconds, 5e-6, 1e-15);
  EXPECT_EQ(t[1].name, "at::native::vectorized_elementwise_kernel<...>");
  EXPECT_EQ(t[1].launches, 2);
  EXPECT_NEAR(t[1].seconds, 0.75e-6, 1e-15);
  EXPECT_EQ(t[2].name, "memset_like");
  EXPECT_NEAR(t[2].seconds, 0.1e-6, 1e-15);
  EXPECT_EQ(t[3].name, "late");
  EXPECT_EQ(t[3].launches, 1);
  EXPECT_EQ(t[3].seconds, 0);
  EXPECT_TRUE(kernel_totals({}).empty());
}

TEST(KernelTrace, AStepsMeanIsEachKernelsTotalOverTheStepsEvenWhereAStepDidNotRunIt) {
  const std::vector<std::vector<KernelTime>> steps = {{{"gemm", 10, 0.010}, {"norm", 4, 0.002}},
                                                      {{"gemm", 10, 0.012}},
                                                      {{"norm", 4, 0.003}, {"gemm", 10, 0.011}, {"rare", 1, 0.040}}};
  const std::vector<KernelTime> mean = mean_kernel_times(steps, 3);
  ASSERT_EQ(mean.size(), 3u);
  EXPECT_EQ(mean[0].name, "rare");  // 0.040 / 3
  EXPECT_NEAR(mean[0].seconds, 0.040 / 3, 1e-15);
  EXPECT_NEAR(mean[0].launches, 1.0 / 3, 1e-15);
  EXPECT_EQ(mean[1].name, "gemm");
  EXPECT_NEAR(mean[1].seconds, 0.011, 1e-15);
  EXPECT_EQ(mean[1].launches, 10);
  EXPECT_EQ(mean[2].name, "norm");
  EXPECT_NEAR(mean[2].seconds, 0.005 / 3, 1e-15);
  EXPECT_NEAR(mean[2].launches, 8.0 / 3, 1e-15);
}

// Copies between memories are listed by way and host memory, their bytes added up like their time; a step's mean
// divides both by the steps.
TEST(KernelTrace, CopiesAreNamedByWayAndHostMemoryAndTheirBytesAddUp) {
  EXPECT_EQ(copy_name(CopyWay::device_to_host, HostMemory::pageable), "device to host, pageable");
  EXPECT_EQ(copy_name(CopyWay::device_to_host, HostMemory::page_locked), "device to host, page-locked");
  EXPECT_EQ(copy_name(CopyWay::host_to_device, HostMemory::page_locked), "host to device, page-locked");
  EXPECT_EQ(copy_name(CopyWay::device_to_device, HostMemory::none), "device to device");
  EXPECT_EQ(copy_name(CopyWay::other, HostMemory::none), "other");
  const std::string back = copy_name(CopyWay::device_to_host, HostMemory::pageable);
  const std::string in = copy_name(CopyWay::host_to_device, HostMemory::page_locked);
  const std::vector<KernelTime> t = kernel_totals({{back, 0, 4000, 48}, {in, 0, 1000, 4096}, {in, 5000, 7000, 4096}});
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].name, back);  // (4 us against 1 + 2)
  EXPECT_EQ(t[0].bytes, 48);
  EXPECT_EQ(t[1].name, in);
  EXPECT_EQ(t[1].launches, 2);
  EXPECT_EQ(t[1].bytes, 8192);
  const std::vector<KernelTime> mean = mean_kernel_times({t, {{back, 1, 1e-6, 48}}}, 2);
  ASSERT_EQ(mean.size(), 2u);
  EXPECT_EQ(mean[0].name, back);
  EXPECT_EQ(mean[0].launches, 1);
  EXPECT_EQ(mean[0].bytes, 48);
  EXPECT_EQ(mean[1].bytes, 4096);
}
