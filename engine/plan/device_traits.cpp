#include "engine/plan/device_traits.hpp"

#include "engine/plan/plan.hpp"

namespace ds {

const char* device_kind_name(DeviceKind d) { return device_traits(d).name; }

std::optional<DeviceKind> device_kind_from_name(const std::string& name) {
  if (name == "cpu") return DeviceKind::cpu;
  if (name == "cuda") return DeviceKind::cuda;
  return std::nullopt;
}

DeviceTraits device_traits(DeviceKind kind) {
  DeviceTraits t;
  t.kind = kind;
  if (kind == DeviceKind::cuda) {
    t.name = "cuda";
    t.label = "GPU";
    t.computes_fp16 = true;
    t.attention_by_library = true;
    t.communicator = CommBackend::nccl;
    t.memory_is_host = false;
    t.memory_measured_by = "cudaMemGetInfo (in use by anything on the GPU)";
  }
  return t;
}

namespace {

// What a build without CUDA LibTorch, or without the CUDA toolkit, lacks on a GPU: everything.
void build_refusals(const Plan& plan, const DeviceTraits& device, std::vector<std::string>& why) {
  const std::optional<BuildSupport>& build = plan.topology.build;
  if (!build || device.kind != DeviceKind::cuda || build->trains_on_cuda()) return;
  why.push_back(build->torch_cuda ? "training on CUDA devices with this build: it was built without the CUDA toolkit (no kernels/cuda, "
                                    "no CUDA Device; rebuild where nvcc is found), so it trains on the CPU"
                                  : "training on CUDA devices with this build: its LibTorch has no CUDA (a build against CUDA LibTorch "
                                    "trains there; this one trains on the CPU)");
}

// What the GPU path does not run yet.
void not_yet_on_gpus(const Plan& plan, const DeviceTraits& device, std::vector<std::string>& why) {
  if (device.kind != DeviceKind::cuda) return;
  if (plan.topology.world_size > 1 && !(plan.topology.build && !plan.topology.build->nccl.empty()))
    why.push_back("several GPU ranks with this build: it has no NCCL communicator (a build with CUDA LibTorch where NCCL is found has "
                  "one), so one GPU per run");
  // One GPU trains fp16 (warned: plan.cpp); ZeRO's collectives have run in NCCL's terms on CPU ranks, which widen
  // fp16 to fp32, so fp16 gradients have never crossed them.
  if (plan.topology.world_size > 1 && plan.precision.param_dtype == Dtype::fp16)
    why.push_back("fp16 on several GPU ranks (ds's checks have not run fp16 gradients through ZeRO's NCCL collectives): one GPU "
                  "trains fp16, several train bf16");
  // Offload from GPUs is warned (plan.cpp). With several, a copy to the host may wait on NCCL's stream where no
  // bounded wait of the communicator's runs: the NCCL communicator's watchdog ends a rank whose collective never
  // finishes, naming it, so a dead peer ends the run rather than hanging it.
}

}  // namespace

std::vector<std::string> device_refusals(const Plan& plan) {
  const DeviceTraits device = device_traits(plan.topology.device);
  std::vector<std::string> why;
  build_refusals(plan, device, why);
  not_yet_on_gpus(plan, device, why);
  return why;
}

}  // namespace ds
