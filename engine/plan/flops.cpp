#include "engine/plan/flops.hpp"

#include <map>

namespace ds {
namespace {

// The depth-2 module a tensor belongs to: its block's prefix and the next component ("...h.0.attn"),
// or outside the blocks its own path without the parameter's name ("transformer.ln_f").
std::string module_of(const TensorSpec& t) {
  const size_t last_dot = t.name.rfind('.');
  if (t.layer < 0) return t.name.substr(0, last_dot);
  const std::string marker = "." + std::to_string(t.layer) + ".";
  const size_t at = t.name.find(marker) + marker.size();
  return t.name.substr(0, t.name.find('.', at));
}

}  // namespace

std::vector<ModuleFlops> module_flops(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, bool recompute,
                                      const std::vector<uint8_t>& frozen_tensors, const LoraPlan& lora) {
  const ModelHyper& hp = model.hp;
  const double N = static_cast<double>(micro_batch) * static_cast<double>(seq_len);  // tokens
  // Attention scores (Q K^T) and their weighted sum (P V): 2 x B x NH x T x T x D each, forward.
  const double attention_core = 2.0 * 2.0 * static_cast<double>(micro_batch) * static_cast<double>(hp.num_heads) *
                                static_cast<double>(seq_len) * static_cast<double>(seq_len) * static_cast<double>(hp.head_dim());
  std::vector<ModuleFlops> rows;
  std::map<std::string, size_t> index;
  std::map<std::string, double> frozen;  // per row: forward FLOPs of frozen weights (backward: the input's gradient only)
  auto row = [&](const std::string& name, int depth, int layer) -> ModuleFlops& {
    auto it = index.find(name);
    if (it != index.end()) return rows[it->second];
    index[name] = rows.size();
    rows.push_back(ModuleFlops{name, depth, layer, 0, 0, 0, 0});
    return rows.back();
  };
  // A matmul of `numel` weights in row `m`: trained, or frozen (no weight gradient).
  auto matmul = [&](ModuleFlops& m, int64_t numel, bool is_frozen) {
    const double f = 2.0 * N * static_cast<double>(numel);
    m.forward += f;
    if (is_frozen) frozen[m.name] += f;
  };
  bool embedding_frozen = false;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    const TensorSpec& t = model.tensors[i];
    const bool is_frozen = !frozen_tensors.empty() && frozen_tensors[i];
    if (is_token_table(t)) embedding_frozen = is_frozen;
    if (t.layer >= 0) {
      const std::string child = module_of(t);
      row(child.substr(0, child.rfind('.')), 1, t.layer);  // the block, before its first child
      ModuleFlops& m = row(child, 2, t.layer);
      m.params += t.numel;
      if (t.shape.size() == 2) matmul(m, t.numel, is_frozen);
      if (t.name.find("c_attn.weight") != std::string::npos || t.name.find("q_proj.weight") != std::string::npos)
        m.forward += attention_core;  // the attention module's own core, once per block
    } else {
      ModuleFlops& m = row(module_of(t), 1, -1);
      m.params += t.numel;
      if (t.shape.size() == 2 && !is_embedding_table(t)) matmul(m, t.numel, is_frozen);  // lm_head
    }
  }
  if (hp.tie_word_embeddings)  // the head reads the token embedding: its matmul, no parameters of its own
    matmul(row("lm_head", 1, -1), hp.vocab_size * hp.hidden_size, embedding_frozen);
  for (const TensorSpec& t : lora.adapters.tensors) {  // x A^T, then B: in the module of the projection they adapt
    ModuleFlops& m = row(module_of(t), 2, t.layer);
    m.params += t.numel;
    m.forward += 2.0 * N * static_cast<double>(t.numel);
  }
  for (ModuleFlops& m : rows) {
    if (m.depth == 2) {
      const std::string block_name = m.name.substr(0, m.name.rfind('.'));
      ModuleFlops& block = rows[index.at(block_name)];
      block.params += m.params;
      block.forward += m.forward;
      frozen[block_name] += frozen[m.name];
    }
  }
  const int64_t forward_only = first_backward_block(model, frozen_tensors, lora);  // below it: no backward, nothing recomputed
  for (ModuleFlops& m : rows) {
    const bool backward = m.layer < 0 || m.layer >= forward_only;
    m.backward = backward ? 2.0 * m.forward - frozen[m.name] : 0.0;
    m.recompute = recompute && m.layer >= 0 && backward ? m.forward : 0.0;
  }
  return rows;
}

}  // namespace ds
