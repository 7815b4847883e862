#include "engine/plan/runnable.hpp"

#include "engine/plan/device_traits.hpp"

namespace ds {

std::vector<std::string> not_yet_runnable(const Plan& plan) {
  std::vector<std::string> why = device_refusals(plan);
  if (plan.has_model && plan.model.hp.arch == ModelArch::gpt2 && !plan.model.hp.tie_word_embeddings)
    why.push_back("an untied gpt2 output head");
  if (plan.mesh.shape.splits_the_model())
    why.push_back("the model split over ranks (tensor_parallel.autotp_size " + std::to_string(plan.mesh.shape.tensor) + ", pipeline.stages " +
                  std::to_string(plan.mesh.shape.pipeline) + "): ds plans the mesh but trains data parallel only yet");
  if (plan.precision.grad_dtype != plan.precision.param_dtype) why.push_back("data_types.grad_accum_dtype other than the parameters' dtype");
  return why;
}

}  // namespace ds
