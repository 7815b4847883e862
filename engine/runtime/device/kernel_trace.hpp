// ds — the GPU kernels a step ran, by name, with their time on the GPU: ds profile's kernel list, so one short
// GPU visit shows where a step's time goes down to the kernel (cuBLAS's GEMMs, SDPA's attention, ds's own and
// LibTorch's elementwise kernels alike). Recorded through CUPTI's activity API, which stamps every kernel the
// process runs with its start and end on the GPU's clock; CUPTI is loaded when a trace starts (dlopen: the
// one LibTorch's CUDA build already loaded, else the toolkit's), so ds itself does not depend on it. No
// LibTorch here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ds {

// One kernel's launches, or one copy between memories, as CUPTI stamped them.
struct KernelRun {
  std::string name;  // as the GPU names it: a C++ kernel's mangled name, cuBLAS's plain one; a copy's copy_name()
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t bytes = 0;  // a copy's
};

// A kernel's (a kind of copy's) total over some steps.
struct KernelTime {
  std::string name;  // short_kernel_name()
  double launches = 0;  // (a mean over steps: mean_kernel_times)
  double seconds = 0;
  double bytes = 0;  // copies
};

// Which way a copy went, and through what host memory: "device to host, pageable" (the host waits for the GPU to
// reach it: a step's read of a figure), "host to device, page-locked", "device to device", ...
enum class CopyWay { host_to_device, device_to_host, device_to_device, other };
enum class HostMemory { pageable, page_locked, none };
std::string copy_name(CopyWay way, HostMemory host);

// A kernel's name to list: demangled, without its parameter list, template arguments or return type
// ("void at::native::elementwise_kernel<128, 4, ...>(int, ...)" -> "at::native::elementwise_kernel<...>"),
// so the instantiations of one kernel add up; a name that is not mangled (cuBLAS's) as it is.
std::string short_kernel_name(const std::string& name);

// The runs added up by short name, the longest total first (ties by name).
std::vector<KernelTime> kernel_totals(const std::vector<KernelRun>& runs);
// Totals of several steps added up by name, each divided by `steps`: a step's mean.
std::vector<KernelTime> mean_kernel_times(const std::vector<std::vector<KernelTime>>& per_step, int64_t steps);

// Every kernel the GPU runs while it is alive, taken step by step. One at a time in a process.
class KernelTrace {
 public:
  // A started trace, or null with `why_not` saying why (this build has no CUDA toolkit, CUPTI cannot be
  // loaded, another profiler holds it).
  static std::unique_ptr<KernelTrace> start(std::string* why_not);
  virtual ~KernelTrace() = default;
  // The kernels that ended since the last take (the GPU's work must be waited for first).
  virtual std::vector<KernelRun> take() = 0;
  // The copies between memories (cudaMemcpy's, LibTorch's) that ended before the last take().
  virtual std::vector<KernelRun> take_copies() = 0;
};

}  // namespace ds
