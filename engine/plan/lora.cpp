#include "engine/plan/lora.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <map>

#include "common/strings.hpp"

namespace ds {
namespace {

// A block's projection weight (2-D, inside a block): what an adapter may sit beside.
bool adaptable(const TensorSpec& t) { return t.layer >= 0 && t.shape.size() == 2; }

}  // namespace

std::vector<std::string> lora_module_names(ModelArch arch) { return arch_traits(arch).lora_modules; }

std::vector<std::string> lora_default_targets(ModelArch arch) { return arch_traits(arch).lora_default_targets; }

std::string lora_module_of(const std::string& tensor_name) {
  const size_t last = tensor_name.rfind('.');
  if (last == std::string::npos || last == 0) return tensor_name;
  const size_t before = tensor_name.rfind('.', last - 1);
  return tensor_name.substr(before == std::string::npos ? 0 : before + 1, last - (before == std::string::npos ? 0 : before + 1));
}

LoraPlan resolve_lora(const LoraConfig& c, const ModelSpec& base, std::vector<ConfigIssue>& errors) {
  LoraPlan p;
  if (!c.enabled) return p;
  p.enabled = true;
  p.r = c.r;
  p.alpha = c.alpha;
  p.scale = c.alpha / static_cast<double>(c.r);
  p.dropout = c.dropout;
  p.init = c.init;
  const ModelArch arch = base.hp.arch;
  const std::vector<std::string> names = lora_module_names(arch);
  const bool all_linear = c.target_modules.size() == 1 && c.target_modules[0] == kAllLinear;
  p.target_modules = c.target_modules.empty() ? lora_default_targets(arch) : all_linear ? names : c.target_modules;
  if (p.target_modules.empty())  // as PEFT, which has no default for the family either
    errors.push_back({"model.lora.target_modules", std::string("a ") + model_arch_name(arch) + " model has no default modules to adapt",
                      "name them: " + join(names, ", ") + ", or \"all-linear\""});
  for (const std::string& t : p.target_modules) {
    if (std::find(names.begin(), names.end(), t) == names.end())
      errors.push_back({"model.lora.target_modules",
                        "'" + t + "' is not a projection of this " + model_arch_name(arch) + " model",
                        "its modules are: " + join(names, ", ")});
    if (std::count(p.target_modules.begin(), p.target_modules.end(), t) > 1)
      errors.push_back({"model.lora.target_modules", "'" + t + "' is listed twice", "list each module once"});
  }
  p.layers = c.layers_to_transform;
  std::sort(p.layers.begin(), p.layers.end());
  p.layers.erase(std::unique(p.layers.begin(), p.layers.end()), p.layers.end());
  if (!p.layers.empty() && p.layers.back() >= base.hp.num_layers)
    errors.push_back({"model.lora.layers_to_transform",
                      "block " + std::to_string(p.layers.back()) + " is past the model's " + std::to_string(base.hp.num_layers) + " blocks",
                      "number the blocks from 0 to " + std::to_string(base.hp.num_layers - 1)});
  p.adapters.hp = base.hp;
  std::map<int, int64_t> per_block;
  for (size_t i = 0; i < base.tensors.size(); ++i) {
    const TensorSpec& t = base.tensors[i];
    if (!adaptable(t)) continue;
    if (!p.layers.empty() && !std::binary_search(p.layers.begin(), p.layers.end(), static_cast<int64_t>(t.layer))) continue;
    const std::string module = lora_module_of(t.name);
    if (std::find(p.target_modules.begin(), p.target_modules.end(), module) == p.target_modules.end()) continue;
    // nn.Linear stores (out, in); GPT-2's Conv1D (in, out).
    const bool in_out = arch_traits(arch).in_out;
    const int64_t in = in_out ? t.shape[0] : t.shape[1], out = in_out ? t.shape[1] : t.shape[0];
    const std::string stem = t.name.substr(0, t.name.rfind('.'));
    // PEFT trains with the Trainer's weight decay on every adapter matrix (no biases, no norms among them).
    p.adapters.tensors.push_back({stem + ".lora_A.weight", {c.r, in}, c.r * in, t.layer, true});
    p.adapters.tensors.push_back({stem + ".lora_B.weight", {out, c.r}, out * c.r, t.layer, true});
    p.adapted.push_back(static_cast<int>(i));
    p.adapted.push_back(static_cast<int>(i));
    const int64_t module_params = c.r * (in + out);
    p.adapters.num_params += module_params;
    p.adapters.largest_module_params = std::max(p.adapters.largest_module_params, module_params);
    per_block[t.layer] += module_params;
  }
  for (const auto& [layer, n] : per_block) p.adapters.largest_block_params = std::max(p.adapters.largest_block_params, n);
  return p;
}

std::vector<ConfigIssue> freeze_pattern_slips(const std::vector<std::string>& patterns) {
  std::vector<ConfigIssue> slips;
  for (const std::string& pattern : patterns)
    for (size_t open = pattern.find('['); open != std::string::npos; open = pattern.find('[', open + 1)) {
      const size_t close = pattern.find(']', open);
      if (close == std::string::npos) break;
      const std::string in = pattern.substr(open + 1, close - open - 1);
      const auto digit = [&](size_t i) { return i < in.size() && in[i] >= '0' && in[i] <= '9'; };
      if (digit(0) && in.size() > 3 && in[1] == '-' && digit(2) && digit(3))
        slips.push_back({"model.freeze",
                         "'" + pattern + "': [" + in + "] matches one character (" + in.substr(0, 3) + " or one of " + in.substr(3) +
                             "), not the numbers " + in.substr(0, 1) + " to " + in.substr(2),
                         "a pattern per digit count: e.g. for blocks 0-15 \"...layers.[0-9].*\" and \"...layers.1[0-5].*\""});
    }
  return slips;
}

std::vector<uint8_t> resolve_freeze(const std::vector<std::string>& patterns, const ModelSpec& model, std::vector<ConfigIssue>& errors) {
  if (patterns.empty()) return {};
  std::vector<uint8_t> frozen(model.tensors.size(), 0);
  for (const std::string& pattern : patterns) {
    bool matched = false;
    for (size_t i = 0; i < model.tensors.size(); ++i)
      if (fnmatch(pattern.c_str(), model.tensors[i].name.c_str(), 0) == 0) frozen[i] = matched = true;
    if (!matched)
      errors.push_back({"model.freeze", "'" + pattern + "' names no tensor of this model",
                        "tensors are named as in Hugging Face's state_dict, e.g. " + model.tensors.front().name + ", " +
                            model.tensors[std::min<size_t>(1, model.tensors.size() - 1)].name + " (ds plan --full-layout lists them all)"});
  }
  if (std::all_of(frozen.begin(), frozen.end(), [](uint8_t f) { return f != 0; }))
    errors.push_back({"model.freeze", "every tensor of the model is frozen: nothing would train", "freeze fewer, or train a LoRA adapter (model.lora)"});
  return frozen;
}

ModelSpec model_part(const ModelSpec& model, const std::vector<uint8_t>& keep) {
  ModelSpec s;
  s.hp = model.hp;
  std::map<int, int64_t> per_block;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    if (!keep[i]) continue;
    const TensorSpec& t = model.tensors[i];
    s.tensors.push_back(t);
    s.num_params += t.numel;
    s.largest_module_params = std::max(s.largest_module_params, t.numel);
    if (t.layer >= 0) per_block[t.layer] += t.numel;
  }
  for (const auto& [layer, n] : per_block) s.largest_block_params = std::max(s.largest_block_params, n);
  return s;
}

ModelSpec unfrozen_part(const ModelSpec& model, const std::vector<uint8_t>& frozen) {
  std::vector<uint8_t> trains(frozen.size());
  for (size_t i = 0; i < frozen.size(); ++i) trains[i] = !frozen[i];
  return model_part(model, trains);
}

int64_t first_backward_block(const ModelSpec& model, const std::vector<uint8_t>& frozen, const LoraPlan& lora) {
  if (frozen.empty() && !lora.enabled) return 0;
  int64_t first = model.hp.num_layers;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    if (!frozen.empty() && frozen[i]) continue;
    const TensorSpec& t = model.tensors[i];
    if (is_embedding_table(t)) return 0;  // its gradient comes back through every block
    if (t.layer >= 0) first = std::min<int64_t>(first, t.layer);
  }
  for (const TensorSpec& t : lora.adapters.tensors)
    if (t.layer >= 0) first = std::min<int64_t>(first, t.layer);
  return first;
}

double attention_train_flops_per_token(const ModelSpec& model, int64_t forward_only, int64_t T) {
  const double L = static_cast<double>(model.hp.num_layers);
  if (L <= 0) return 0;
  return model.attention_train_flops_per_token(T) * (L - static_cast<double>(forward_only) * 2.0 / 3.0) / L;
}

double train_flops_per_token(const ModelSpec& model, const std::vector<uint8_t>& frozen, const LoraPlan& lora, int64_t T) {
  // Matmul parameters held frozen: 2-D weights but the embedding tables, and a tied head with its embedding.
  double frozen_matmul = 0;
  for (size_t i = 0; i < frozen.size(); ++i) {
    const TensorSpec& t = model.tensors[i];
    if (!frozen[i] || t.shape.size() != 2) continue;
    if (!is_embedding_table(t))
      frozen_matmul += static_cast<double>(t.numel);
    else if (model.hp.tie_word_embeddings && is_token_table(t))
      frozen_matmul += static_cast<double>(model.hp.vocab_size) * static_cast<double>(model.hp.hidden_size);
  }
  // A block running forward alone: 2 per parameter of its (frozen) matmuls, not 4.
  const int64_t forward_only = first_backward_block(model, frozen, lora);
  double forward_only_matmul = 0;
  for (const TensorSpec& t : model.tensors)
    if (t.layer >= 0 && t.layer < forward_only && t.shape.size() == 2) forward_only_matmul += static_cast<double>(t.numel);
  return 6.0 * model.matmul_params() - 2.0 * frozen_matmul - 2.0 * forward_only_matmul + 6.0 * static_cast<double>(lora.adapters.num_params) +
         attention_train_flops_per_token(model, forward_only, T);
}

double head_train_flops_per_token(const ModelSpec& model, const std::vector<uint8_t>& frozen) {
  const double VC = static_cast<double>(model.hp.vocab_size) * static_cast<double>(model.hp.hidden_size);
  for (size_t i = 0; i < frozen.size(); ++i) {
    const TensorSpec& t = model.tensors[i];
    const bool head = model.hp.tie_word_embeddings ? is_token_table(t) : t.name == "lm_head.weight";
    if (frozen[i] && head) return 4 * VC;
  }
  return 6 * VC;
}

double lora_activation_bytes_per_token(const LoraPlan& lora, int bytes, int64_t recompute_group) {
  if (!lora.enabled) return 0;
  std::map<int64_t, double> per_block;  // elements per token
  for (size_t i = 0; i + 1 < lora.adapters.tensors.size(); i += 2) {  // A then B, one module
    const TensorSpec& a = lora.adapters.tensors[i];
    per_block[a.layer] += static_cast<double>(lora.r) + (lora.dropout > 0 ? static_cast<double>(a.shape[1]) : 0.0);
  }
  double most = 0, all = 0;
  for (const auto& [layer, elements] : per_block) {
    all += elements;
    double window = 0;  // the group of G blocks ending at this one
    for (auto it = per_block.lower_bound(layer - recompute_group + 1); it != per_block.end() && it->first <= layer; ++it) window += it->second;
    most = std::max(most, window);
  }
  return (recompute_group > 0 ? most : all) * bytes;
}

}  // namespace ds
