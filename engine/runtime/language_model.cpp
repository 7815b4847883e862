#include "engine/runtime/language_model.hpp"

#include "engine/runtime/gpt2_model.hpp"
#include "engine/runtime/llama_model.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Activation checkpointing for one block: forward runs the block without recording a graph and keeps
// only its input; backward runs the block again with the graph on and back-propagates through it,
// which accumulates the parameters' gradients into their .grad (the flat gradient buffer) and yields
// the input's gradient. LibTorch's C++ API has no torch.utils.checkpoint; this is its reentrant form.
class RecomputedBlock : public torch::autograd::Function<RecomputedBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const LanguageModel* model, int64_t layer) {
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({x});
    return model->block(layer, x);  // grad mode is off inside forward
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto* model = reinterpret_cast<const LanguageModel*>(ctx->saved_data["model"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = model->block(layer, x);
    }
    torch::autograd::backward({y}, {grad_out[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor LanguageModel::run_blocks(torch::Tensor x) const {
  const bool recompute = checkpoint_activations_ && torch::GradMode::is_enabled();
  for (int64_t l = 0; l < num_blocks(); ++l) x = recompute ? RecomputedBlock::apply(x, this, l) : block(l, x);
  return x;
}

std::unique_ptr<LanguageModel> make_model(const Plan& plan, const FlatParams& params) {
  std::unique_ptr<LanguageModel> m;
  if (plan.model.hp.arch == ModelArch::llama)
    m = std::make_unique<LlamaModel>(plan.model.hp, params);
  else
    m = std::make_unique<Gpt2Model>(plan.model.hp, params);
  m->set_checkpoint_activations(plan.activation_checkpointing);
  return m;
}

void initialise_model(const ModelHyper& hp, const Plan& plan, torch::Tensor master, uint64_t seed) {
  if (hp.arch == ModelArch::llama)
    LlamaModel::initialise(plan, master, seed);
  else
    Gpt2Model::initialise(hp, plan, master, seed);
}

}  // namespace ds
