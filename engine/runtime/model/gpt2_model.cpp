#include "engine/runtime/model/gpt2_model.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "common/error.hpp"
#include "common/strings.hpp"
#include "engine/runtime/model/fused_ops.hpp"

namespace ds {

Gpt2Model::Gpt2Model(const ModelHyper& hp, ModelWeights& w, const StageEnds& stage) : LanguageModel(stage), hp_(hp) {
  DS_CHECK(hp.arch == ModelArch::gpt2);
  if (stage.embeddings) {
    wte_ = w.next("wte.weight");
    wpe_ = w.next("wpe.weight");
  }
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    Block b;
    b.ln1_w = w.next("ln_1.weight");
    b.ln1_b = w.next("ln_1.bias");
    b.attn = w.linear("attn.c_attn.weight", "attn.c_attn.bias");
    b.proj = w.linear("attn.c_proj.weight", "attn.c_proj.bias");
    b.ln2_w = w.next("ln_2.weight");
    b.ln2_b = w.next("ln_2.bias");
    b.fc = w.linear("mlp.c_fc.weight", "mlp.c_fc.bias");
    b.fc_proj = w.linear("mlp.c_proj.weight", "mlp.c_proj.bias");
    blocks_.push_back(b);
  }
  if (stage.head) {
    lnf_w_ = w.next("ln_f.weight");
    lnf_b_ = w.next("ln_f.bias");
    if (!stage.embeddings) wte_ = w.next("wte.weight");  // the tied head's copy of the table
  }
  DS_CHECK(w.done(), "untied lm_head is not supported for gpt2 yet");
}

void Gpt2Model::initialise(const ModelHyper& hp, const ParamSlot& p, torch::Tensor t, at::Generator& gen) {
  auto ends = [&](const char* suffix) { return ends_with(p.name, suffix); };
  if (ends(".bias"))
    t.zero_();
  else if (ends("ln_1.weight") || ends("ln_2.weight") || ends("ln_f.weight"))
    t.fill_(1.0);
  else if (ends("c_proj.weight"))
    t.normal_(0.0, 0.02 / std::sqrt(2.0 * hp.num_layers), gen);
  else
    t.normal_(0.0, 0.02, gen);
}

torch::Tensor Gpt2Model::block(int64_t layer, const torch::Tensor& x_in) const {
  const Block& b = blocks_[static_cast<size_t>(layer - stage().first_block)];
  // (tensor parallel: NH is this rank's heads, D their width; c_attn and c_fc its columns, the c_proj's its rows)
  const int64_t B = x_in.size(0), T = x_in.size(1), C = hp_.hidden_size, NH = hp_.num_heads, D = hp_.head_dim();
  // The residual stream passed on beside each norm: its gradients meet in the norms' backward (fused_ops.hpp).
  torch::Tensor x, h;
  std::tie(x, h) = layer_norm_beside(x_in, b.ln1_w, b.ln1_b, hp_.norm_eps);
  const torch::Tensor qkv = linear(column_input(h).view({B * T, C}), b.attn, true);  // (BT, 3 NH D): q, k, v heads
  torch::Tensor y = attention(qkv.view({B, T, 3 * NH, D}), NH, hp_.attn_pdrop, layer).view({B * T, NH * D});
  std::tie(x, h) = add_layer_norm(x, dropout(row_linear(y, b.proj, true).view({B, T, C}), hp_.resid_pdrop, layer, 1), b.ln2_w,
                                  b.ln2_b, hp_.norm_eps);
  attention_half_done(layer, h);
  torch::Tensor f = gelu_tanh(linear(column_input(h).view({B * T, C}), b.fc, true));
  return x + dropout(row_linear(f, b.fc_proj, true).view({B, T, C}), hp_.resid_pdrop, layer, 2);
}

torch::Tensor Gpt2Model::embed(const torch::Tensor& inputs) const {
  const int64_t T = inputs.size(1);
  // Packed rows: each sample's positions count from 0.
  const torch::Tensor pos = packed() ? embedding_lookup(wpe_, positions(wpe_.device())) : wpe_.narrow(0, 0, T);
  return dropout(token_embedding(wte_, inputs) + pos, hp_.embd_pdrop, -1, 0);  // (B, T, C)
}

torch::Tensor Gpt2Model::head(const torch::Tensor& x, const torch::Tensor& targets) const {
  const int64_t B = x.size(0), T = x.size(1), C = hp_.hidden_size;
  return head_loss(layer_norm(x, lnf_w_, lnf_b_, hp_.norm_eps).view({B * T, C}), wte_, targets);  // tied head
}

}  // namespace ds
