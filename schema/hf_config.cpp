// Reading a Hugging Face config.json (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM) into
// model fields. Field names and defaults follow transformers' configuration_gpt2.py and
// configuration_llama.py (reference §6.3, §6.4).
#include <cmath>
#include <fstream>
#include <sstream>

#include "schema/loader_internal.hpp"

namespace ds::loader {

ModelFields read_hf_config(const std::string& path, std::vector<ConfigIssue>& errors) {
  ModelFields f;
  std::string text;
  try {
    text = read_config_text_file(path);
  } catch (const UserError& e) {
    errors.push_back({"model.hf_config", e.what(), "give the path of a Hugging Face config.json"});
    return f;
  }
  json j;
  try {
    j = json::parse(text, nullptr, true, true);
  } catch (const json::parse_error& e) {
    errors.push_back({"model.hf_config", "'" + path + "' is not valid JSON: " + std::string(e.what()), ""});
    return f;
  }
  const std::string type = j.value("model_type", std::string());
  auto num = [&](std::initializer_list<const char*> keys, std::optional<int64_t>& out) {
    for (const char* k : keys)
      if (j.contains(k) && j[k].is_number()) {
        const double v = j[k].get<double>();
        if (!(v >= 1 && v <= 1e15) || v != std::floor(v)) {  // the model's limits are checked once resolved
          errors.push_back({"model.hf_config", "'" + path + "': " + k + " is " + j[k].dump() + ", not a positive whole number",
                            "check the file: it does not describe a model ds can build"});
          return;
        }
        out = static_cast<int64_t>(v);
        return;
      }
  };
  auto prob = [&](const char* k, std::optional<double>& out) {
    if (j.contains(k) && j[k].is_number()) out = j[k].get<double>();
  };
  if (type == "gpt2") {
    f.arch = ModelArch::gpt2;
    num({"n_embd", "hidden_size"}, f.hidden_size);
    num({"n_layer", "num_hidden_layers"}, f.num_layers);
    num({"n_head", "num_attention_heads"}, f.num_heads);
    num({"vocab_size"}, f.vocab_size);
    num({"n_positions", "max_position_embeddings"}, f.max_position_embeddings);
    num({"n_inner"}, f.intermediate_size);  // null means 4 x n_embd
    f.tie_word_embeddings = j.value("tie_word_embeddings", true);
    if (j.contains("layer_norm_epsilon")) f.norm_eps = j["layer_norm_epsilon"].get<double>();
    prob("attn_pdrop", f.attn_pdrop);
    prob("resid_pdrop", f.resid_pdrop);
    prob("embd_pdrop", f.embd_pdrop);
    const std::string act = j.value("activation_function", std::string("gelu_new"));
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      errors.push_back({"model.hf_config", "'" + path + "': activation_function \"" + act + "\" is not supported",
                        "ds's gpt2 uses the tanh GELU (gelu_new)"});
  } else if (type == "llama" || type == "mistral") {
    f.arch = ModelArch::llama;
    num({"hidden_size"}, f.hidden_size);
    num({"num_hidden_layers"}, f.num_layers);
    num({"num_attention_heads"}, f.num_heads);
    num({"num_key_value_heads"}, f.num_kv_heads);
    num({"intermediate_size"}, f.intermediate_size);
    num({"vocab_size"}, f.vocab_size);
    num({"max_position_embeddings"}, f.max_position_embeddings);
    f.tie_word_embeddings = j.value("tie_word_embeddings", false);
    if (j.contains("rms_norm_eps")) f.norm_eps = j["rms_norm_eps"].get<double>();
    if (j.contains("rope_theta")) f.rope_theta = j["rope_theta"].get<double>();
    prob("attention_dropout", f.attn_pdrop);
    if (j.contains("head_dim") && j["head_dim"].is_number() && f.hidden_size && f.num_heads &&
        j["head_dim"].get<int64_t>() * *f.num_heads != *f.hidden_size)
      errors.push_back({"model.hf_config", "'" + path + "': head_dim != hidden_size / num_attention_heads is not supported", ""});
    if (j.value("attention_bias", false) || j.value("mlp_bias", false))
      errors.push_back({"model.hf_config", "'" + path + "': attention_bias / mlp_bias are not supported", ""});
  } else {
    errors.push_back({"model.hf_config", "'" + path + "': model_type \"" + type + "\" is not supported",
                      "ds models gpt2, llama and mistral"});
  }
  return f;
}

}  // namespace ds::loader
