#include "engine/runtime/model/llama_model.hpp"

#include "engine/plan/rope.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <tuple>

#include "common/error.hpp"
#include "common/strings.hpp"
#include "engine/runtime/model/fused_ops.hpp"

namespace ds {

LlamaModel::LlamaModel(const ModelHyper& hp, ModelWeights& w, const StageEnds& stage) : LanguageModel(stage), hp_(hp), traits_(hp.traits()) {
  DS_CHECK(hp.traits().positions == Positions::rotary);
  if (stage.embeddings) embed_ = w.next("embed_tokens.weight");
  // A projection's weight, then its bias where the family has one (the order of build_rotary in model_spec).
  auto projection = [&](const std::string& name, bool bias) { return w.linear(name + ".weight", bias ? name + ".bias" : ""); };
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    Block b;
    if (hp.traits().fused_qkv) {
      b.o = projection("o_proj", hp.o_biased());
      b.q = projection("qkv_proj", hp.qkv_biased());
    } else {
      b.q = projection("q_proj", hp.qkv_biased());
      b.k = projection("k_proj", hp.qkv_biased());
      b.v = projection("v_proj", hp.qkv_biased());
      b.o = projection("o_proj", hp.o_biased());
    }
    if (hp.traits().qk_norm) {
      b.q_norm = w.next("q_norm.weight");
      b.k_norm = w.next("k_norm.weight");
    }
    if (hp.traits().fused_gate_up) {
      b.gate = projection("gate_up_proj", hp.mlp_biased());
    } else {
      b.gate = projection("gate_proj", hp.mlp_biased());
      b.up = projection("up_proj", hp.mlp_biased());
    }
    b.down = projection("down_proj", hp.mlp_biased());
    b.norm_in = w.next("input_layernorm.weight");
    b.norm_post = w.next("post_attention_layernorm.weight");
    if (hp.traits().sandwich_norms) {
      b.norm_pre_mlp = w.next("pre_feedforward_layernorm.weight");
      b.norm_post_mlp = w.next("post_feedforward_layernorm.weight");
    }
    blocks_.push_back(b);
  }
  if (stage.head) {
    norm_ = w.next("model.norm.weight");
    // A tied head on a later stage than the table: its copy of it, after the norm.
    head_ = !hp.tie_word_embeddings ? w.next("lm_head.weight") : stage.embeddings ? embed_ : w.next("embed_tokens.weight");
  }
  DS_CHECK(w.done(), "unexpected parameters after lm_head");
}

void LlamaModel::initialise(const ModelHyper& hp, const ParamSlot& p, torch::Tensor t, at::Generator& gen) {
  if (ends_with(p.name, ".bias"))
    t.zero_();
  else if (p.shape.size() == 1)
    t.fill_(hp.traits().norm_plus_one ? 0.0 : 1.0);  // RMSNorm gains: w, or Gemma's 1 + w
  else
    t.normal_(0.0, 0.02, gen);
}

std::pair<torch::Tensor, torch::Tensor> LlamaModel::norm_beside(const torch::Tensor& x, const torch::Tensor& w) const {
  if (!traits_.norm_plus_one) return ds::rms_norm_beside(x, w, hp_.norm_eps);
  return {x, rms_norm(x, w)};
}

std::pair<torch::Tensor, torch::Tensor> LlamaModel::add_then_norm(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w) const {
  if (!traits_.norm_plus_one) return ds::add_rms_norm(x, r, w, hp_.norm_eps);
  const torch::Tensor sum = x + r;
  return {sum, rms_norm(sum, w)};
}

torch::Tensor LlamaModel::rms_norm(const torch::Tensor& x, const torch::Tensor& w) const {
  if (!traits_.norm_plus_one) return ds::rms_norm(x, w, hp_.norm_eps);  // the statistic in fp32, like HF
  // Gemma's: x / rms(x) * (1 + w), all in fp32 and rounded once, as Hugging Face's Gemma2RMSNorm.
  if (x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32) return ds::rms_norm(x, w + 1.0, hp_.norm_eps);
  const torch::Tensor xf = x.to(torch::kFloat32);
  return (xf * inverse_rms(xf, hp_.norm_eps) * (w.to(torch::kFloat32) + 1.0)).to(x.scalar_type());
}

// The MLP's gated activation: silu(gate) * up, or Gemma's gelu_tanh(gate) * up.
torch::Tensor LlamaModel::gated(const torch::Tensor& gate, const torch::Tensor& up) const {
  if (traits_.activation == Activation::geglu_tanh) return gelu_tanh(gate) * up;
  return swiglu(gate, up);
}

namespace {

// cos and sin (rows, D/2) of angle = t * inv_freq_j, the frequencies as the model's rope_scaling stretches them
// (engine/plan/rope.hpp), scaled by its attention factor (yarn); made on the host, then moved to `device`.
std::pair<torch::Tensor, torch::Tensor> cos_sin_of(const RotaryTables& rope, int64_t rows, const torch::Device& device) {
  const torch::Tensor inv_freq = torch::tensor(rope.inv_freq, torch::kFloat64).to(torch::kFloat32);
  const torch::Tensor angles = torch::outer(torch::arange(rows, torch::kFloat32), inv_freq);
  torch::Tensor cos = angles.cos(), sin = angles.sin();
  if (rope.attention_factor != 1.0) cos = cos * rope.attention_factor, sin = sin * rope.attention_factor;
  return {cos.to(device), sin.to(device)};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> LlamaModel::rotary_cos_sin(int64_t T, const torch::Device& device) const {
  if (rope_cos_.defined() && rope_cos_.size(0) == T && rope_cos_.device() == device) return {rope_cos_, rope_sin_};
  std::tie(rope_cos_, rope_sin_) = cos_sin_of(rotary_tables(hp_, T), T, device);
  return {rope_cos_, rope_sin_};
}

std::pair<torch::Tensor, torch::Tensor> LlamaModel::sample_cos_sin(int64_t L, int64_t length, int64_t T, const torch::Tensor& cos,
                                                                  const torch::Tensor& sin) const {
  const RotaryTables row = rotary_tables(hp_, T), own = rotary_tables(hp_, length);
  if (own.inv_freq == row.inv_freq && own.attention_factor == row.attention_factor) return {cos.narrow(0, 0, L), sin.narrow(0, 0, L)};
  return cos_sin_of(own, L, cos.device());  // scaling that depends on the length: the sample's own, as it would have alone
}

std::pair<torch::Tensor, torch::Tensor> LlamaModel::gathered_cos_sin(const torch::Tensor& cos, const torch::Tensor& sin) const {
  if (gathered_version_ != segments_version() || !gathered_cos_.defined() || gathered_cos_.device() != cos.device()) {
    const torch::Tensor at = positions(cos.device()).flatten();
    gathered_cos_ = cos.index_select(0, at);
    gathered_sin_ = sin.index_select(0, at);
    gathered_version_ = segments_version();
  }
  return {gathered_cos_, gathered_sin_};
}

torch::Tensor LlamaModel::block(int64_t layer, const torch::Tensor& x_in) const {
  const Block& b = blocks_[static_cast<size_t>(layer - stage().first_block)];
  const int64_t B = x_in.size(0), T = x_in.size(1), NH = hp_.num_heads, NKV = hp_.num_kv_heads;
  const int64_t D = hp_.head_dim();
  const auto [cos, sin] = rotary_cos_sin(T, x_in.device());
  // (tensor parallel: NH and NKV are this rank's heads, the intermediate size its MLP channels)
  // The residual stream passed on beside each norm: its gradients meet in the norms' backward (fused_ops.hpp).
  torch::Tensor x, h;
  std::tie(x, h) = norm_beside(x_in, b.norm_in);
  h = column_input(h);
  torch::Tensor q, k, v;
  if (traits_.fused_qkv) {  // one projection's heads: NH of q, then NKV of k, then NKV of v
    std::tie(q, k, v) = unpack(linear(h, b.q, false).view({B, T, NH + 2 * NKV, D}), NH);
    v = v.contiguous();  // its own: a view kept by the attention would keep the whole projection (q and k are rotated copies)
  } else {
    q = linear(h, b.q, false).view({B, T, NH, D});
    k = linear(h, b.k, false).view({B, T, NKV, D});
    v = linear(h, b.v, false).view({B, T, NKV, D});
  }
  if (b.q_norm.defined()) q = rms_norm(q, per_head_weight(b.q_norm)), k = rms_norm(k, per_head_weight(b.k_norm));  // each head's, over its D
  AttentionForm form;
  form.window = hp_.window_of(layer);
  form.softcap = hp_.attn_softcap;
  form.scale = hp_.attention_scale();
  // Packed rows rotate each sample from position 0: where the scaling does not depend on the length (all but
  // dynamic and longrope) the whole batch at once, by the tables gathered at each position's place in its
  // sample; else each sample by the tables of its own length, as it would have them alone.
  const RopeType scaling = hp_.rope_scaling.type;
  const bool by_length = scaling == RopeType::dynamic || scaling == RopeType::longrope;
  const bool own_tables = has_segments() && by_length;  // a row of one sample too: the tables of its length, not T's
  if (packed() && !own_tables) {
    const auto [c, s] = gathered_cos_sin(cos, sin);  // (B T, D/2)
    q = rotary(q.view({1, B * T, NH, D}), c, s).view({B, T, NH, D});
    k = rotary(k.view({1, B * T, NKV, D}), c, s).view({B, T, NKV, D});
  } else if (!own_tables) {
    q = rotary(q, cos, sin);  // (B, T, NH, D)
    k = rotary(k, cos, sin);
  }
  const auto attend = [&](const std::vector<torch::Tensor>& qkv, uint64_t sample, int64_t length) {
    if (!own_tables) return attention(qkv[0], qkv[1], qkv[2], hp_.attn_pdrop, layer, form, sample);
    const auto [c, s] = sample_cos_sin(qkv[0].size(1), length, T, cos, sin);
    return attention(rotary(qkv[0], c, s), rotary(qkv[1], c, s), qkv[2], hp_.attn_pdrop, layer, form, sample);
  };
  torch::Tensor y = per_sample({q, k, v}, NH, attend, own_tables).view({B, T, NH * D});  // kv heads serve groups
  y = row_linear(y, b.o, false);
  const bool sandwich = b.norm_pre_mlp.defined();  // Gemma 2: each sub-layer's output normalised before the add
  if (sandwich) y = rms_norm(y, b.norm_post);
  std::tie(x, h) = add_then_norm(x, dropout(y, hp_.resid_pdrop, layer, 1), sandwich ? b.norm_pre_mlp : b.norm_post);
  attention_half_done(layer, h);
  h = column_input(h);
  torch::Tensor act;
  if (traits_.fused_gate_up) {  // gate the first half, up the second (Hugging Face's chunk(2))
    const torch::Tensor gate_up = linear(h, b.gate, false);
    const int64_t I = hp_.intermediate_size;
    act = gated(gate_up.narrow(-1, 0, I), gate_up.narrow(-1, I, I));
  } else {
    act = gated(linear(h, b.gate, false), linear(h, b.up, false));
  }
  torch::Tensor out = row_linear(act, b.down, false);
  if (sandwich) out = rms_norm(out, b.norm_post_mlp);
  return x + dropout(out, hp_.resid_pdrop, layer, 2);
}

torch::Tensor LlamaModel::embed(const torch::Tensor& inputs) const {
  torch::Tensor x = token_embedding(embed_, inputs);  // (B, T, C)
  // Gemma: times sqrt(width), that factor rounded to the activations' dtype as Hugging Face rounds it.
  if (traits_.embedding_scaled)
    x = x * torch::scalar_tensor(std::sqrt(static_cast<double>(hp_.hidden_size)), torch::kFloat64).to(x.scalar_type()).item<double>();
  return dropout(x, hp_.embd_pdrop, -1, 0);
}

torch::Tensor LlamaModel::head(const torch::Tensor& x, const torch::Tensor& targets) const {
  const int64_t B = x.size(0), T = x.size(1), C = hp_.hidden_size;
  return head_loss(rms_norm(x, norm_).view({B * T, C}), head_, targets, hp_.final_softcap);
}

}  // namespace ds
