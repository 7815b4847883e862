#include "engine/plan/runnable.hpp"

namespace ds {

std::vector<std::string> not_yet_runnable(const Plan& plan) {
  std::vector<std::string> why;
  if (plan.topology.device == DeviceKind::cuda) {
    // One GPU trains the whole step; what moves states off it, or spans GPUs, is still the CPU's.
    if (plan.topology.world_size > 1) why.push_back("several GPU ranks (NCCL between GPUs): one GPU per run for now");
    if (plan.precision.param_dtype == Dtype::fp16)
      why.push_back("fp16 on a GPU (its gradients need fp16 optimizer and norm kernels ds lacks for now): bf16 trains there");
    if (plan.zero.offload_optimizer.device != OffloadDevice::none || plan.zero.offload_param.device != OffloadDevice::none)
      why.push_back("offload from a GPU (zero_optimization.offload_optimizer / offload_param): offload trains on the CPU for now");
  }
  if (plan.has_model && plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings)
    why.push_back("an untied gpt2 output head");
  if (plan.precision.grad_dtype != plan.precision.param_dtype) why.push_back("data_types.grad_accum_dtype other than the parameters' dtype");
  return why;
}

}  // namespace ds
