#include "engine/runtime/language_model.hpp"

#include <cstring>

#include <ATen/CPUGeneratorImpl.h>

#include "common/error.hpp"
#include "common/hash.hpp"

#include "engine/runtime/fused_attention.hpp"
#include "engine/runtime/fused_head_loss.hpp"
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

// A block with ZeRO's hooks around it. Its backward is a unit of its own (a nested graph, or the
// recomputed block), so the hooks know exactly when the block's parameter gradients are complete:
// autograd's own order would not say when all of a block's accumulations have run.
class HookedBlock : public torch::autograd::Function<HookedBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const LanguageModel* model, BlockHooks* hooks,
                               int64_t layer, bool recompute) {
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(hooks);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["recompute"] = recompute;
    hooks->before_forward(layer);
    if (recompute) {
      ctx->save_for_backward({x});
      torch::Tensor y = model->block(layer, x);  // grad mode is off inside forward
      hooks->after_forward(layer);
      return y;
    }
    torch::AutoGradMode on(true);
    torch::Tensor xi = x.detach().requires_grad_(true);
    torch::Tensor y = model->block(layer, xi);
    ctx->saved_data["x"] = xi;
    ctx->saved_data["y"] = y;
    hooks->after_forward(layer);
    return y.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto* model = reinterpret_cast<const LanguageModel*>(ctx->saved_data["model"].toInt());
    auto* hooks = reinterpret_cast<BlockHooks*>(ctx->saved_data["hooks"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    hooks->before_backward(layer);
    torch::Tensor x, y;
    if (ctx->saved_data["recompute"].toBool()) {
      x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
      torch::AutoGradMode on(true);
      y = model->block(layer, x);
    } else {
      x = ctx->saved_data["x"].toTensor();
      y = ctx->saved_data["y"].toTensor();
      ctx->saved_data.erase("x");  // free the block's activations as soon as its backward is done
      ctx->saved_data.erase("y");
    }
    torch::autograd::backward({y}, {grad_out[0]});
    hooks->after_backward(layer);
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor LanguageModel::dropout(const torch::Tensor& x, double p, int64_t layer, int site) const {
  if (p <= 0 || !training_) return x;
  const uint64_t seed = splitmix64(dropout_key_ ^ splitmix64(static_cast<uint64_t>(layer + 1) * 8 + static_cast<uint64_t>(site)));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor keep = torch::empty(x.sizes(), x.options().dtype(torch::kFloat32)).bernoulli_(1.0 - p, gen);
  return x * (keep * (1.0 / (1.0 - p))).to(x.scalar_type());
}

torch::Tensor LanguageModel::attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                                       int64_t layer) const {
  if (p <= 0 || !training_) return causal_attention(q, k, v);
  return causal_attention_materialised(q, k, v, [&](const torch::Tensor& att) { return dropout(att, p, layer, 0); });
}

torch::Tensor LanguageModel::attention(const torch::Tensor& qkv, int64_t heads, double p, int64_t layer) const {
  if (p <= 0 || !training_) return causal_attention_packed(qkv, heads);
  const auto [q, k, v] = unpack(qkv, heads);
  return attention(q, k, v, p, layer);
}

void LanguageModel::attention_half_done(int64_t layer, torch::Tensor& x) const {
  if (!parts_) return;
  parts_->attention_done(layer);
  if (x.requires_grad()) {
    BlockParts* parts = parts_;
    x.register_hook([parts, layer](const torch::Tensor&) { parts->mlp_backward_done(layer); });
  }
}

torch::Tensor LanguageModel::head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets) const {
  return fused_head_loss(x, weight, targets.reshape({-1}), loss_gradient_, kHeadChunkElements, &head_logits_);
}

torch::Tensor LanguageModel::run_blocks(torch::Tensor x) const {
  const bool training = torch::GradMode::is_enabled();
  const bool recompute = checkpoint_activations_ && training;
  for (int64_t l = 0; l < num_blocks(); ++l) {
    if (hooks_ && training) {
      x = HookedBlock::apply(x, this, hooks_, l, recompute);
    } else if (hooks_) {  // evaluation: parameters gathered, nothing to reduce
      hooks_->before_forward(l);
      x = block(l, x);
      hooks_->after_forward(l);
    } else {
      x = recompute ? RecomputedBlock::apply(x, this, l) : block(l, x);
    }
  }
  return x;
}

namespace {
double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

void BlockTimer::before_forward(int64_t layer) {
  started_ = std::chrono::steady_clock::now();
  if (inner_) inner_->before_forward(layer);  // stage 3's gather counts as the block's time
}
void BlockTimer::record(int64_t layer, bool backward) {
  const auto now = std::chrono::steady_clock::now();
  const double s = seconds_between(started_, now);
  (backward ? backward_ : forward_)[static_cast<size_t>(layer)] += s;
  spans_.push_back({BlockSpan{static_cast<int>(layer), backward, 0, s}, started_});
}
void BlockTimer::after_forward(int64_t layer) {
  record(layer, false);
  if (inner_) inner_->after_forward(layer);
}
void BlockTimer::attention_done(int64_t layer) {
  if (in_backward_ == layer) return;  // recomputation inside the block's backward
  attention_forward_[static_cast<size_t>(layer)] += seconds_between(started_, std::chrono::steady_clock::now());
}
void BlockTimer::mlp_backward_done(int64_t layer) {
  mlp_backward_[static_cast<size_t>(layer)] += seconds_between(started_, std::chrono::steady_clock::now());
}
void BlockTimer::before_backward(int64_t layer) {
  in_backward_ = layer;
  started_ = std::chrono::steady_clock::now();
  if (inner_) inner_->before_backward(layer);
}
void BlockTimer::after_backward(int64_t layer) {
  if (inner_) inner_->after_backward(layer);  // the block's gradient reduction counts as its backward
  record(layer, true);
  in_backward_ = -1;
}
BlockTimer::Taken BlockTimer::take(std::chrono::steady_clock::time_point step_start) {
  Taken t{forward_, backward_, attention_forward_, mlp_backward_, {}};
  for (auto [span, began] : spans_) {
    span.start_s = seconds_between(step_start, began);
    t.spans.push_back(span);
  }
  spans_.clear();
  std::fill(forward_.begin(), forward_.end(), 0.0);
  std::fill(backward_.begin(), backward_.end(), 0.0);
  std::fill(attention_forward_.begin(), attention_forward_.end(), 0.0);
  std::fill(mlp_backward_.begin(), mlp_backward_.end(), 0.0);
  return t;
}

std::unique_ptr<LanguageModel> make_model(const Plan& plan, const FlatParams& params) {
  std::unique_ptr<LanguageModel> m;
  switch (plan.model.hp.arch) {  // one case per architecture of the registry (schema/config.hpp)
    case ModelArch::gpt2: m = std::make_unique<Gpt2Model>(plan.model.hp, params); break;
    case ModelArch::llama: m = std::make_unique<LlamaModel>(plan.model.hp, params); break;
  }
  DS_CHECK(m != nullptr, "no model for architecture ", model_arch_name(plan.model.hp.arch));
  m->set_checkpoint_activations(plan.activation_checkpointing);
  return m;
}

InitialWeights::InitialWeights(const Plan& plan, uint64_t seed) : plan_(plan), gen_(at::detail::createCPUGenerator(seed)) {}

const float* InitialWeights::param(int i) {
  DS_CHECK(i >= drawn_ && i < static_cast<int>(plan_.layout.params.size()), "initial weights asked for parameter ", i,
           " after ", drawn_);
  torch::NoGradGuard no_grad;
  while (drawn_ < i) {
    const ParamSlot& p = plan_.layout.params[static_cast<size_t>(++drawn_)];
    values_ = torch::empty({p.numel}, torch::kFloat32);
    switch (plan_.model.hp.arch) {
      case ModelArch::gpt2: Gpt2Model::initialise(plan_.model.hp, p, values_, gen_); break;
      case ModelArch::llama: LlamaModel::initialise(p, values_, gen_); break;
    }
  }
  return values_.data_ptr<float>();
}

void initialise_model(const Plan& plan, torch::Tensor master, uint64_t seed) {
  InitialWeights w(plan, seed);
  for (size_t i = 0; i < plan.layout.params.size(); ++i) {
    const ParamSlot& p = plan.layout.params[i];
    std::memcpy(master.data_ptr<float>() + p.offset, w.param(static_cast<int>(i)), static_cast<size_t>(p.numel) * 4);
  }
}

}  // namespace ds
