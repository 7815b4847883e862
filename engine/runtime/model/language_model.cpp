#include "engine/runtime/model/language_model.hpp"

#include <algorithm>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <ATen/CPUGeneratorImpl.h>

#include "common/error.hpp"
#include "common/hash.hpp"
#include "common/strings.hpp"

#include "engine/runtime/device/kernel_route.hpp"
#include "engine/runtime/model/fused_attention.hpp"
#include "engine/runtime/model/fused_ops.hpp"
#include "engine/runtime/model/fused_head_loss.hpp"
#include "engine/runtime/model/gpt2_model.hpp"
#include "engine/runtime/model/llama_model.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The blocks [first, first + count) applied to x in turn.
torch::Tensor run_range(const LanguageModel* model, int64_t first, int64_t count, torch::Tensor x) {
  for (int64_t l = first; l < first + count; ++l) x = model->block(l, x);
  return x;
}

// Activation checkpointing for a group of blocks (one, or pipeline.activation_checkpoint_interval's): forward
// runs them without recording a graph and keeps only the group's input; backward runs them again with the graph
// on and back-propagates through them, which accumulates the parameters' gradients into their .grad (the flat
// gradient buffer) and yields the input's gradient. LibTorch's C++ API has no torch.utils.checkpoint; this is
// its reentrant form.
class RecomputedBlocks : public torch::autograd::Function<RecomputedBlocks> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const LanguageModel* model, int64_t first, int64_t count) {
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["first"] = first;
    ctx->saved_data["count"] = count;
    ctx->save_for_backward({x});
    return run_range(model, first, count, x);  // grad mode is off inside forward
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto* model = reinterpret_cast<const LanguageModel*>(ctx->saved_data["model"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = run_range(model, ctx->saved_data["first"].toInt(), ctx->saved_data["count"].toInt(), x);
    }
    torch::autograd::backward({y}, {grad_out[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Blocks with ZeRO's hooks around each: one block, or with recomputation a group of them. Its backward is a unit
// of its own (a nested graph, or the recomputed blocks), so the hooks know exactly when the blocks' parameter
// gradients are complete: autograd's own order would not say when all of a block's accumulations have run.
class HookedBlocks : public torch::autograd::Function<HookedBlocks> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const LanguageModel* model, BlockHooks* hooks,
                               int64_t first, int64_t count, bool recompute) {
    DS_CHECK(recompute || count == 1, "a group of ", count, " blocks kept whole: only a recomputed group runs as one");
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(hooks);
    ctx->saved_data["first"] = first;
    ctx->saved_data["count"] = count;
    ctx->saved_data["recompute"] = recompute;
    const int64_t base = model->stage().first_block;  // ZeRO's blocks: the stage's own, from 0
    if (recompute) {
      ctx->save_for_backward({x});
      torch::Tensor y = x;
      for (int64_t l = first; l < first + count; ++l) {
        hooks->before_forward(l - base);
        y = model->block(l, y);  // grad mode is off inside forward
        hooks->after_forward(l - base);
      }
      return y;
    }
    hooks->before_forward(first - base);
    torch::AutoGradMode on(true);
    torch::Tensor xi = x.detach().requires_grad_(true);
    torch::Tensor y = model->block(first, xi);
    ctx->saved_data["x"] = xi;
    ctx->saved_data["y"] = y;
    hooks->after_forward(first - base);
    return y.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto* model = reinterpret_cast<const LanguageModel*>(ctx->saved_data["model"].toInt());
    auto* hooks = reinterpret_cast<BlockHooks*>(ctx->saved_data["hooks"].toInt());
    const int64_t first = ctx->saved_data["first"].toInt(), count = ctx->saved_data["count"].toInt();
    const int64_t base = model->stage().first_block;
    for (int64_t l = first + count - 1; l >= first; --l) hooks->before_backward(l - base);
    torch::Tensor x, y;
    if (ctx->saved_data["recompute"].toBool()) {
      x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
      torch::AutoGradMode on(true);
      y = run_range(model, first, count, x);
    } else {
      x = ctx->saved_data["x"].toTensor();
      y = ctx->saved_data["y"].toTensor();
      ctx->saved_data.erase("x");  // free the block's activations as soon as its backward is done
      ctx->saved_data.erase("y");
    }
    torch::autograd::backward({y}, {grad_out[0]});
    for (int64_t l = first + count - 1; l >= first; --l) hooks->after_backward(l - base);
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

namespace {
// The LoRA adapters' dropout masks come from streams of their own, past every block's dropout sites.
constexpr uint64_t kAdapterStreams = uint64_t{1} << 40;
// The stream of the adapter beside projection `l`: keyed by its whole tensor's number, so a split model's rank
// drops what one rank drops.
uint64_t adapter_stream(const Linear& l) { return kAdapterStreams + static_cast<uint64_t>(l.index); }
}  // namespace

torch::Tensor LanguageModel::dropout(const torch::Tensor& x, double p, int64_t layer, int site) const {
  DS_CHECK(site >= 0 && site < 8, "dropout site ", site, " is outside 0-7");
  return dropout_from(x, p, dropout_stream(layer, site));
}

torch::Tensor LanguageModel::dropout_from(const torch::Tensor& x, double p, uint64_t stream) const {
  if (p <= 0 || !training_) return x;
  // The mask is a function of this key and the element's index, computed where x is: a GPU run drops what
  // the CPU run drops (and compares with it), a recomputed block what its first forward dropped.
  return hashed_dropout(x, p, splitmix64(dropout_key_ ^ splitmix64(stream)));
}

torch::Tensor LanguageModel::linear(const torch::Tensor& x, const Linear& l, bool in_out) const {
  // On a GPU, an adapter over a frozen base is one node whose scales and sums ride in its GEMMs: its step is bound
  // by launches there. The host keeps the ops composed, its numerics as they were (the adapter's product rounded
  // before the add).
  if (l.lora_a.defined() && kernel_route(x) == KernelRoute::cuda && !tensor_.split() && !l.weight.requires_grad() &&
      !(l.bias.defined() && l.bias.requires_grad())) {
    const bool drops = lora_dropout_ > 0 && training_;
    return lora_projection(x, drops ? dropout_from(x, lora_dropout_, adapter_stream(l)) : torch::Tensor(), l.weight, l.bias, l.lora_a,
                           l.lora_b, lora_scale_, in_out);
  }
  const torch::Tensor y = projection(x, l.weight, l.bias, in_out);
  if (!l.lora_a.defined()) return y;
  const torch::Tensor dropped = dropout_from(x, lora_dropout_, adapter_stream(l));
  // Split over a tensor group (a column-parallel projection: B holds the rank's outputs), A is whole on every rank
  // and each rank's gradient of it a part: summed over the group, as the input's is.
  const torch::Tensor low = projection(dropped, column_input(l.lora_a), {}, false);  // (..., r)
  return torch::add(y, projection(low, l.lora_b, {}, false), lora_scale_);
}

torch::Tensor LanguageModel::column_input(const torch::Tensor& x) const {
  return tensor_.split() ? enter_tensor_group(x, *tensor_.comm) : x;
}

torch::Tensor LanguageModel::row_linear(const torch::Tensor& x, const Linear& l, bool in_out) const {
  if (!tensor_.split()) return linear(x, l, in_out);
  const torch::Tensor summed = leave_tensor_group(projection(x, l.weight, {}, in_out), *tensor_.comm);
  const torch::Tensor y = l.bias.defined() ? summed + l.bias : summed;
  if (!l.lora_a.defined()) return y;
  // LoRA: A holds the rank's input columns, so x A^T is summed over the group (r values a token) before the
  // whole B.
  const torch::Tensor low = leave_tensor_group(projection(row_dropout(x, l), l.lora_a, {}, false), *tensor_.comm);
  return torch::add(y, projection(low, l.lora_b, {}, false), lora_scale_);
}

torch::Tensor LanguageModel::row_dropout(const torch::Tensor& x, const Linear& l) const {
  if (lora_dropout_ <= 0 || !training_) return x;
  // The mask is a function of each element's index in the whole input, which the rank holds columns of: the whole
  // input's mask is made (every rank makes the same) and the rank's columns kept. Applied in fp32 and rounded once,
  // as the dropout kernel does, so the rank drops exactly what one rank would.
  const int64_t cols = x.size(-1), group = tensor_.comm->world_size();
  std::vector<int64_t> whole = x.sizes().vec();
  whole.back() = cols * group;
  const torch::Tensor kept =
      dropout_from(torch::ones(whole, x.options().dtype(torch::kFloat32)), lora_dropout_, adapter_stream(l))
          .narrow(-1, cols * tensor_.comm->rank(), cols);
  return (x.to(torch::kFloat32) * kept).to(x.scalar_type());
}

torch::Tensor LanguageModel::token_embedding(const torch::Tensor& table, const torch::Tensor& ids) const {
  return vocab_parallel_embedding(table, ids, tensor_);
}

void LanguageModel::set_tensor_group(const TensorGroup& group) {
  tensor_ = group;
  head_streams_ = group.split() ? splitmix64(0x7465'6e73'6f72ull + static_cast<uint64_t>(group.rank())) : 0;
}

torch::Tensor LanguageModel::attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p,
                                       int64_t layer, const AttentionForm& form, uint64_t sample) const {
  const bool dropped = p > 0 && training_;
  if (!dropped && form.plain(q.size(1))) return causal_attention(q, k, v);
  if (!dropped) return causal_attention_materialised(q, k, v, {}, form);
  // A packed sample's probabilities are dropped from a stream of its own (its masks would repeat another's);
  // a tensor rank's heads from streams of the rank's (head_streams_, 0 on one rank).
  constexpr uint64_t kSampleStreams = uint64_t{3} << 62;
  const auto drop = [&](const torch::Tensor& att) {
    if (!sample) return dropout_from(att, p, dropout_stream(layer, 0) ^ head_streams_);
    return dropout_from(att, p, kSampleStreams ^ splitmix64((static_cast<uint64_t>(layer) << 48) ^ sample) ^ head_streams_);
  };
  return causal_attention_materialised(q, k, v, drop, form);
}

torch::Tensor LanguageModel::attention(const torch::Tensor& qkv, int64_t heads, double p, int64_t layer) const {
  return per_sample({qkv}, heads, [&](const std::vector<torch::Tensor>& part, uint64_t sample, int64_t) {
    if (p <= 0 || !training_) return causal_attention_packed(part[0], heads);
    const auto [q, k, v] = unpack(part[0], heads);
    return attention(q, k, v, p, layer, {}, sample);
  });
}

void LanguageModel::set_segments(const std::vector<std::vector<int64_t>>* segments) {
  positions_ = device_positions_ = torch::Tensor();
  segments_.clear();
  ++segments_version_;
  if (!segments || segments->empty()) return;
  segments_ = *segments;
  bool several = false;  // rows of one sample each (then padding) are plain rows: causal attention never looks ahead
  for (const auto& row : segments_) several |= std::count_if(row.begin(), row.end(), [](int64_t l) { return l > 0; }) > 1;
  if (!several) return;
  const int64_t B = static_cast<int64_t>(segments_.size());
  int64_t T = 0;
  for (const int64_t length : segments_[0]) T += std::abs(length);
  positions_ = torch::empty({B, T}, torch::kLong);
  int64_t* p = positions_.data_ptr<int64_t>();
  for (const auto& row : segments_) {
    int64_t filled = 0;
    for (const int64_t length : row)
      for (int64_t t = 0; t < std::abs(length); ++t) *p++ = t, ++filled;
    DS_CHECK(filled == T, "set_segments: rows of ", filled, " and ", T, " positions");
  }
}

const torch::Tensor& LanguageModel::positions(const torch::Device& device) const {
  DS_CHECK(packed(), "positions: the rows are not packed");
  if (!device_positions_.defined() || device_positions_.device() != device) device_positions_ = ids_to_device(positions_, device);
  return device_positions_;
}

torch::Tensor LanguageModel::per_sample(const std::vector<torch::Tensor>& parts, int64_t heads, const SampleFn& f,
                                        bool by_length) const {
  if (!packed() && !(by_length && !segments_.empty())) return f(parts, 0, parts[0].size(1));
  const int64_t B = parts[0].size(0), T = parts[0].size(1), D = parts[0].size(3);
  DS_CHECK(static_cast<int64_t>(segments_.size()) == B, "per_sample: ", segments_.size(), " rows of segments for a batch of ",
           parts[0].sizes());
  std::vector<std::vector<torch::Tensor>> rows;  // per part, its rows (T, ...)
  for (const torch::Tensor& part : parts) rows.push_back(part.unbind(0));
  std::vector<torch::Tensor> joined;
  for (int64_t b = 0; b < B; ++b) {
    // The padding after the last sample goes with it (causal: the sample never looks at it), one piece fewer.
    const std::vector<int64_t>& row = segments_[static_cast<size_t>(b)];
    std::vector<int64_t> given = row;
    if (given.size() > 1 && given.back() < 0 && given[given.size() - 2] > 0) {
      given[given.size() - 2] -= given.back();
      given.pop_back();
    }
    std::vector<int64_t> lengths = given;
    for (int64_t& length : lengths) length = std::abs(length);
    std::vector<std::vector<torch::Tensor>> pieces;  // per part, its samples (L, ...)
    for (const auto& part_rows : rows) pieces.push_back(part_rows[static_cast<size_t>(b)].split_with_sizes(lengths, 0));
    std::vector<torch::Tensor> outs;
    int64_t start = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      if (given[s] < 0) {  // a row of padding alone
        outs.push_back(torch::zeros({1, lengths[s], heads, D}, parts[0].options()));
      } else {
        std::vector<torch::Tensor> args;
        for (const auto& part_pieces : pieces) args.push_back(part_pieces[s].unsqueeze(0));
        outs.push_back(f(args, static_cast<uint64_t>(b * T + start + 1), row[s]));
      }
      start += lengths[s];
    }
    joined.push_back(torch::cat(outs, 1));
  }
  return torch::cat(joined, 0);
}

void LanguageModel::attention_half_done(int64_t layer, torch::Tensor& mlp_input) const {
  if (!parts_) return;
  const int64_t own = layer - stage_.first_block;  // numbered as the hooks number the blocks: the stage's own, from 0
  parts_->attention_done(own);
  if (mlp_input.requires_grad()) {
    BlockParts* parts = parts_;
    mlp_input.register_hook([parts, own](const torch::Tensor&) { parts->mlp_backward_done(own); });
  }
}

torch::Tensor LanguageModel::head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                                       double softcap) const {
  // The batch's targets come from the host (a copy when they do not: the count below is read there).
  const torch::Tensor flat = on_host(targets) ? targets.reshape({-1}) : targets.reshape({-1}).cpu();
  // A negative target is one the loss does not count (padding, a prompt's token): those rows never reach
  // the head (no logits, no FLOPs), and the loss is the mean over the rows that do.
  const torch::Tensor t = flat.to(torch::kLong).contiguous();
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t counted = std::count_if(p, p + t.numel(), [](int64_t v) { return v >= 0; });
  // Tensor parallel: the head's rows are this rank's; x's gradient, its part, is summed over the group.
  const auto loss_of = [&](const torch::Tensor& rows, const torch::Tensor& ids) {
    if (!tensor_.split()) return fused_head_loss(rows, weight, ids, loss_gradient_, kHeadChunkElements, &head_logits_, softcap);
    return vocab_parallel_head_loss(column_input(rows), weight, ids, tensor_, loss_gradient_, kHeadChunkElements, &head_logits_,
                                    softcap);
  };
  if (counted == t.numel()) return loss_of(x, targets.reshape({-1}));
  if (counted == 0) {  // nothing to learn here: a zero loss whose gradient reaches x as zeros (the head's buffer is untouched)
    const torch::Tensor none = torch::zeros({0}, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
    return x.index_select(0, none).sum().to(torch::kFloat32);
  }
  const torch::Tensor kept = (t >= 0).nonzero().view({-1});
  return loss_of(x.index_select(0, ids_to_device(kept, x.device())), t.index_select(0, kept));  // (a pinned copy: the host runs on)
}

torch::Tensor LanguageModel::run_blocks(torch::Tensor x) const {
  const bool training = torch::GradMode::is_enabled();
  const bool recompute = checkpoint_activations_ && training;
  const auto forward_only = [&](int64_t l, const torch::Tensor& in) {  // parameters gathered, nothing kept or reduced
    if (!hooks_) return block(l, in);
    hooks_->before_forward(l - stage_.first_block);
    torch::Tensor out = block(l, in);
    hooks_->after_forward(l - stage_.first_block);
    return out;
  };
  const int64_t end = stage_.first_block + num_blocks();
  for (int64_t l = stage_.first_block; l < end; ++l) {
    if (!training) {  // evaluation
      x = forward_only(l, x);
      continue;
    }
    if (l < backward_from_) {  // nothing in or below this block trains: no graph
      torch::NoGradGuard no_graph;
      x = forward_only(l, x);
      continue;
    }
    // Frozen embeddings (LoRA) or blocks give the blocks an input that takes no gradient, and a Function wrapping
    // blocks (recomputed, hooked) passes gradients on only when its input takes one: make it a leaf that does.
    if (!x.requires_grad()) x = x.detach().requires_grad_(true);
    // Recomputed in groups of recompute_group_ blocks, counted from the first block whose backward runs.
    const int64_t count = recompute ? std::min(recompute_group_, end - l) : 1;
    if (hooks_) x = HookedBlocks::apply(x, this, hooks_, l, count, recompute);
    else x = recompute ? RecomputedBlocks::apply(x, this, l, count) : block(l, x);
    l += count - 1;
  }
  return x;
}

torch::Tensor LanguageModel::loss(const torch::Tensor& inputs, const torch::Tensor& targets) const {
  DS_CHECK(stage_.embeddings && stage_.head, "loss() of a pipeline stage's model: run stage_forward");
  return stage_forward(inputs, {}, targets);
}

torch::Tensor LanguageModel::stage_forward(const torch::Tensor& inputs, const torch::Tensor& x, const torch::Tensor& targets) const {
  const torch::Tensor out = run_blocks(stage_.embeddings ? embed(inputs) : x);
  return stage_.head ? head(out, targets) : out;
}

void BlockTimer::before_forward(int64_t layer) {
  started_ = clock_.record_timed();
  if (inner_) inner_->before_forward(layer);  // stage 3's gather counts as the block's time
}
void BlockTimer::record(int64_t layer, Part part) { timed_.push_back({part, layer, started_, clock_.record_timed()}); }
void BlockTimer::after_forward(int64_t layer) {
  record(layer, Part::forward);
  if (inner_) inner_->after_forward(layer);
}
void BlockTimer::attention_done(int64_t layer) {
  if (in_backward_ == layer) return;  // recomputation inside the block's backward
  record(layer, Part::attention_forward);
}
void BlockTimer::mlp_backward_done(int64_t layer) { record(layer, Part::mlp_backward); }
void BlockTimer::before_backward(int64_t layer) {
  in_backward_ = layer;
  started_ = clock_.record_timed();
  if (inner_) inner_->before_backward(layer);
}
void BlockTimer::after_backward(int64_t layer) {
  if (inner_) inner_->after_backward(layer);  // the block's gradient reduction counts as its backward
  record(layer, Part::backward);
  in_backward_ = -1;
}
BlockTimer::Taken BlockTimer::take(const Event& step_start) {
  clock_.synchronize();
  Taken t{std::vector<double>(blocks_), std::vector<double>(blocks_), std::vector<double>(blocks_), std::vector<double>(blocks_), {}};
  for (const Timed& x : timed_) {
    const double s = x.end->seconds_since(*x.begin);
    const auto at = static_cast<size_t>(x.layer);
    switch (x.part) {
      case Part::forward: t.forward[at] += s; break;
      case Part::backward: t.backward[at] += s; break;
      case Part::attention_forward: t.attention_forward[at] += s; break;
      case Part::mlp_backward: t.mlp_backward[at] += s; break;
    }
    if (x.part == Part::forward || x.part == Part::backward)
      t.spans.push_back(BlockSpan{static_cast<int>(x.layer), x.part == Part::backward, x.begin->seconds_since(step_start), s});
  }
  timed_.clear();
  return t;
}

ModelWeights::ModelWeights(const Plan& plan, const FlatParams& p)
    : plan_(plan), trained_(p.views, p.names), frozen_(p.frozen_views, p.frozen_names) {
  const StageShare& own = plan.own;  // the rank's tensors, in the order its model binds them
  if (!own.lora.enabled) return;
  DS_CHECK(p.frozen_views.size() == own.model.tensors.size() && p.views.size() == own.lora.adapted.size(),
           "the frozen base or the adapters are not the plan's");
  for (size_t i = 0; i + 1 < p.views.size(); i += 2)  // A then B, for one projection
    adapters_.push_back({static_cast<size_t>(own.lora.adapted[i]), p.views[i], p.views[i + 1]});
  trained_ = ParamCursor(p.views, p.names, p.views.size());  // the flat views are the adapters': none is a model tensor
}

const torch::Tensor& ModelWeights::next(const std::string& suffix) {
  return plan_.own.is_frozen(tensor_++) ? frozen_.next(suffix) : trained_.next(suffix);
}

Linear ModelWeights::linear(const std::string& weight_suffix, const std::string& bias_suffix) {
  Linear l;
  const size_t held = tensor_;
  // The whole model's number: LoRA dropout's stream is the tensor's, whichever stage holds it.
  l.index = static_cast<int64_t>(plan_.own.tensors.at(held).whole);
  l.weight = next(weight_suffix);
  if (!bias_suffix.empty()) l.bias = next(bias_suffix);
  if (adapter_ < adapters_.size() && adapters_[adapter_].base == held) {
    l.lora_a = adapters_[adapter_].a;
    l.lora_b = adapters_[adapter_].b;
    ++adapter_;
  }
  return l;
}

namespace {
// Tensor parallel: the group a split plan's model runs over, checked against the plan's mesh.
TensorGroup tensor_group_of(const Plan& plan, Communicator* comm) {
  const MeshShape& mesh = plan.mesh.shape;
  if (mesh.tensor == 1) return {};
  DS_CHECK(comm && comm->world_size() == mesh.tensor, "make_model: the plan splits the model over ", mesh.tensor,
           " tensor ranks, but the tensor group has ", comm ? comm->world_size() : 0);
  TensorGroup g;
  g.comm = comm;
  g.vocab = vocab_share(plan.model.hp.vocab_size, mesh.tensor, comm->rank());
  g.whole_vocab = plan.model.hp.vocab_size;
  return g;
}
}  // namespace

std::unique_ptr<LanguageModel> make_model(const Plan& plan, const FlatParams& params, Communicator* tensor_group) {
  std::unique_ptr<LanguageModel> m;
  ModelWeights weights(plan, params);
  const TensorGroup group = tensor_group_of(plan, tensor_group);
  // A rank of a split model has its share's sizes: its stage's blocks; its heads, kv heads, MLP channels and
  // vocabulary rows.
  const bool split = plan.mesh.shape.splits_the_model() && !plan.mesh.stages.empty();
  const int stage = own_stage(plan);
  const ModelHyper hp = split ? stage_share(plan.model, plan.mesh, stage).hp : plan.model.hp;
  StageEnds ends;
  if (split) {
    const PipelineStage& st = plan.mesh.stages[static_cast<size_t>(stage)];
    ends = {st.embeddings, st.head, st.first_block};
  }
  switch (hp.traits().positions) {  // the two blocks ds builds (schema/arch.hpp)
    case Positions::learned: m = std::make_unique<Gpt2Model>(hp, weights, ends); break;
    case Positions::rotary: m = std::make_unique<LlamaModel>(hp, weights, ends); break;
  }
  m->set_tensor_group(group);
  DS_CHECK(m != nullptr, "no model for architecture ", model_arch_name(plan.model.hp.arch));
  DS_CHECK(weights.done(), "the model left parameters or adapters unbound");
  m->set_checkpoint_activations(plan.activation_checkpointing);
  m->set_backward_from(plan.backward_from);
  m->set_recompute_group(plan.recompute_group);
  if (plan.lora.enabled) m->set_lora(plan.lora.scale, plan.lora.dropout);
  return m;
}

namespace {
// LoRA as PEFT initialises it: B zero (step 0 is the base), A uniform in +-1/sqrt(in) (Kaiming-uniform with
// a = sqrt(5), PEFT's default) or N(0, 1/r^2) ("gaussian").
void initialise_adapter(const LoraPlan& lora, const ParamSlot& p, torch::Tensor t, at::Generator& gen) {
  if (ends_with(p.name, "lora_B.weight"))
    t.zero_();
  else if (lora.init == LoraInit::gaussian)
    t.normal_(0.0, 1.0 / static_cast<double>(lora.r), gen);
  else
    t.uniform_(-1.0 / std::sqrt(static_cast<double>(p.shape[1])), 1.0 / std::sqrt(static_cast<double>(p.shape[1])), gen);
}

std::vector<ParamSlot> slots_of(const ModelSpec& model) {
  std::vector<ParamSlot> out;
  for (const TensorSpec& t : model.tensors) out.push_back({t.name, t.shape, t.numel, 0, 0, 0, t.weight_decay, t.layer});
  return out;
}
}  // namespace

InitialWeights::InitialWeights(const Plan& plan, uint64_t seed, bool base, int tensor_rank)
    : plan_(plan),
      adapters_(plan.lora.enabled && !base),
      // The adapter's draws come from a stream of their own, not the base's first values again.
      gen_(at::detail::createCPUGenerator(adapters_ ? splitmix64(seed ^ 0x4c6f5241ull) : seed)),
      tensor_rank_(tensor_rank),
      sharing_(!base && plan.mesh.shape.splits_the_model() && !plan.mesh.stages.empty()) {
  // The layout's tensors are some of the whole run's (a split model's share, or model.freeze's trained ones): each
  // drawn in the whole's order (the model's; the adapter's under LoRA) and kept.
  const StageShare& own = plan.own;
  if (!base && (sharing_ || (!plan.lora.enabled && !plan.frozen.empty()))) {
    for (size_t k = 0; k < own.trained.size(); ++k) {
      const StageTensor& t = own.trained[k];
      sources_.push_back({adapters_ ? t.whole : own.trained_model[k], t.tied_copy});
      if (t.tied_copy) tied_table_ = sources_.back().whole;
    }
  }
  DS_CHECK(sources_.empty() || sources_.size() == plan.layout.params.size(), "initial weights: the layout has ", plan.layout.params.size(),
           " tensors, the model's for it ", sources_.size());
  // The whole model's (or adapter's) tensors are drawn, in its order, unless the layout is the model's (or the adapter's) own.
  slots_ = base || !sources_.empty() ? slots_of(adapters_ ? plan.lora.adapters : plan.model) : plan.layout.params;
}

const float* InitialWeights::param(int asked) {
  // The layout's parameter `asked` is (a share of) one of the model's tensors, drawn in the model's order (a tied
  // head's copy: the table, kept when it was drawn).
  int i = asked;
  if (!sources_.empty()) {
    const StageTensor& source = sources_[static_cast<size_t>(asked)];
    if (source.tied_copy) {
      // (a ZeRO shard may begin inside the copy: the table is drawn first, in the model's order, then)
      if (!tied_.defined()) draw_through(tied_table_);
      return tied_.data_ptr<float>();
    }
    i = source.whole;
  }
  DS_CHECK(i >= drawn_ && i < static_cast<int>(slots_.size()), "initial weights asked for parameter ", i, " after ", drawn_);
  draw_through(i);
  const torch::Tensor& kept = sharing_ ? share_ : values_;
  if (sharing_)
    DS_CHECK(kept.numel() == plan_.layout.params[static_cast<size_t>(asked)].numel, "initial weights: ", slots_[static_cast<size_t>(i)].name,
             "'s share has ", kept.numel(), " elements, the layout ", plan_.layout.params[static_cast<size_t>(asked)].numel);
  return kept.data_ptr<float>();
}

void InitialWeights::draw_through(int i) {
  torch::NoGradGuard no_grad;
  while (drawn_ < i) {
    const ParamSlot& p = slots_[static_cast<size_t>(++drawn_)];
    values_ = torch::empty({p.numel}, torch::kFloat32);
    if (adapters_) {
      initialise_adapter(plan_.lora, p, values_, gen_);
    } else {
      switch (plan_.model.hp.traits().positions) {
        case Positions::learned: Gpt2Model::initialise(plan_.model.hp, p, values_, gen_); break;
        case Positions::rotary: LlamaModel::initialise(plan_.model.hp, p, values_, gen_); break;
      }
    }
    if (sharing_) {  // (an adapter's split follows its base's: tensor_split_of)
      const TensorSpec& whole = (adapters_ ? plan_.lora.adapters : plan_.model).tensors[static_cast<size_t>(drawn_)];
      share_ = take_share(values_.view(whole.shape), tensor_slice_of(plan_.model, whole, plan_.mesh.shape.tensor, tensor_rank_)).view(-1);
      if (drawn_ == tied_table_) tied_ = share_;
    }
  }
}

void initialise_model(const Plan& plan, torch::Tensor master, uint64_t seed, int tensor_rank) {
  InitialWeights w(plan, seed, false, tensor_rank);
  for (size_t i = 0; i < plan.layout.params.size(); ++i) {
    const ParamSlot& p = plan.layout.params[i];
    std::memcpy(master.data_ptr<float>() + p.offset, w.param(static_cast<int>(i)), static_cast<size_t>(p.numel) * 4);
  }
}

}  // namespace ds
