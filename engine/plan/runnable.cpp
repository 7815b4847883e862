#include "engine/plan/runnable.hpp"

#include "common/error.hpp"
#include "engine/plan/device_traits.hpp"

namespace ds {

namespace {

// What keeps ds from measuring a step of this plan phase by phase (ds profile, the flops_profiler block).
std::vector<std::string> profiling_refusals(const Plan& plan) {
  std::vector<std::string> why;
  // A GPU's phases and blocks are timed on its clock (CUDA events); the collectives' spans still on the host's, from issue
  // to the moment the compute stream was told to wait for them: over NCCL, the launches'.
  if (!plan.topology.device_traits().memory_is_host && plan.topology.world_size > 1)
    why.push_back("ds profile and the flops_profiler block on several GPU ranks (the collectives' times are not yet taken on the GPU's "
                  "clock): profile one GPU (--nproc-per-node 1), or several CPU ranks");
  if (plan.activation_checkpointing && plan.recompute_group > 1)
    why.push_back("ds profile and the flops_profiler with pipeline.activation_checkpoint_interval " + std::to_string(plan.recompute_group) +
                  " (a group of blocks recomputed together has one backward, not one per block): an interval of 1 profiles each block");
  return why;
}

}  // namespace

std::vector<std::string> not_yet_runnable(const Plan& plan, bool profiling) {
  std::vector<std::string> why = device_refusals(plan);
  if (plan.has_model && plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings)
    why.push_back("an untied gpt2 output head");
  // (ZeRO stage 2-3 with a pipeline is the plan's error: check_zero)
  if (plan.activation_checkpointing && plan.recompute_group > 1 && plan.zero_stage() >= 2)
    why.push_back("pipeline.activation_checkpoint_interval " + std::to_string(plan.recompute_group) + " at ZeRO stage " +
                  std::to_string(plan.zero_stage()) +
                  " (each block's gradients, and at stage 3 its weights, pass through one of two buffers; a group recomputed together "
                  "needs one per block): an interval of 1, or ZeRO stage 0-1");
  // Gradients accumulate in the weights' dtype, or in fp32 over bf16 weights (DeepSpeed's BF16_Optimizer). A narrower
  // accumulation would round every micro-batch's sum; fp16 weights take their loss scale's overflow from fp16 sums.
  const PrecisionPolicy& pp = plan.precision;
  if (pp.grad_dtype != pp.param_dtype && !(pp.param_dtype == Dtype::bf16 && pp.grad_dtype == Dtype::fp32))
    why.push_back(std::string("data_types.grad_accum_dtype ") + dtype_name(pp.grad_dtype) + " with " + dtype_name(pp.param_dtype) +
                  " weights (gradients accumulate in the weights' dtype, or in fp32 with bf16 weights): remove the key, or train in bf16 "
                  "(bf16.enabled) to sum in fp32");
  if (profiling || plan.run.flops_profiler.enabled)
    for (std::string& w : profiling_refusals(plan)) why.push_back(std::move(w));
  if (!profiling && plan.run.flops_profiler.enabled && plan.mesh.shape.pipeline > 1)
    why.push_back("the flops_profiler block with pipeline stages (ds train's report holds rank 0's measurements alone, one stage's): "
                  "drop the block to train, and run ds profile, which gathers every stage's");
  return why;
}

void refuse_not_runnable(const Plan& plan, const std::vector<std::string>& why) {
  if (why.empty()) return;
  std::string list;
  for (const auto& w : why) list += "\n    - " + w;
  // Where only the GPU path is missing, the same plan trains on the CPU: say so.
  Plan on_cpu = plan;
  on_cpu.topology.device = DeviceKind::cpu;
  const bool cpu_trains_it = !plan.topology.device_traits().memory_is_host && not_yet_runnable(on_cpu).empty();
  throw UserError("this build of ds cannot train this plan yet:" + list,
                  cpu_trains_it ? "--device cpu trains this plan on the CPU (the items above are the GPU path's limits for now; "
                                  "`ds plan --device cuda` lists them before a run)"
                                : "`ds plan` shows the plan; the items above are on the roadmap (see README)");
}

}  // namespace ds
