// ds — the device a plan trains on, decided once. The topology names its kind (from --device, or "auto":
// make_topology is the one place that chooses); every other question about it is answered here: what it is
// called, which library its ranks talk through, whether its memory is the host's, and what ds refuses on
// it with this build, each with the reason. The compiler, `ds plan` (text and plan.json), estimate-memory
// and the trainer ask these, never the kind itself.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/plan/comm.hpp"

namespace ds {

struct Plan;

enum class DeviceKind { cpu, cuda };
const char* device_kind_name(DeviceKind d);  // "cpu", "cuda": the one spelling (plan.json, ds plan)
// The kind a --device name asks for; "auto" and unknown names are not kinds (std::nullopt).
std::optional<DeviceKind> device_kind_from_name(const std::string& name);

// What this build of ds can train on, told once at start-up (engine/runtime/device/build_support.hpp reads
// it from how the binary was built). A plan made for another machine carries none: estimate-memory says
// what ds can do anywhere, not what this binary can.
struct BuildSupport {
  bool torch_cuda = false;    // LibTorch built with CUDA: tensors and autograd on a GPU, so ds trains there
  std::string cuda_kernels;   // "CUDA 13.0, sm_90" where kernels/cuda are compiled in; "" where not
  std::string nccl;           // "2.27.7": the Communicator over NCCL is built in (CUDA LibTorch, NCCL found); "" where not
  // ds trains on GPUs: CUDA LibTorch, and the CUDA Device and kernels built beside it (the toolkit found).
  bool trains_on_cuda() const { return torch_cuda && !cuda_kernels.empty(); }
};

struct DeviceTraits {
  DeviceKind kind = DeviceKind::cpu;
  const char* name = "cpu";
  const char* label = "CPU";  // in sentences: "2 CPU ranks", "on the CPU" / "on GPU 0"
  CommBackend communicator = CommBackend::gloo;  // between this device's ranks
  // The device's memory is this host's RAM: one pool per node (the fit is judged on the host alone, and the
  // device's buffers count in the host's figure), read back as the process's resident set.
  bool memory_is_host = true;
  const char* memory_measured_by = "the process's resident set";
  // fp16 products run in fp16 (LibTorch has no fp16 CPU kernels: there they run in fp32 on fp16 storage).
  bool computes_fp16 = false;
  // The causal attention is LibTorch's fused kernel (scaled_dot_product_attention; a GPU), not ds's own: with
  // grouped-query heads it takes k and v repeated to the query heads, and keeps those (the plan's activations count them).
  bool attention_by_library = false;
};
DeviceTraits device_traits(DeviceKind kind);

// What ds refuses to train on the plan's device, each with its reason: first what this build lacks (only when
// the topology carries the build), then what ds cannot do there yet. Empty: the device trains this plan.
std::vector<std::string> device_refusals(const Plan& plan);

}  // namespace ds
