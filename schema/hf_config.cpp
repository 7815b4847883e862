// Reading a Hugging Face config.json into model fields: GPT-2, and the rotary families of schema/arch.hpp
// (Llama, Mistral, Qwen2, Qwen3). Field names and defaults follow transformers' configuration_*.py of each.
#include <cmath>
#include <fstream>
#include <sstream>

#include "common/json_depth.hpp"
#include "schema/arch.hpp"
#include "schema/rope_scaling.hpp"
#include "schema/loader_internal.hpp"

namespace ds::loader {

namespace {

// config.json's keys read with their types checked: a wrong type is an error naming the key, not an exception.
struct HfKeys {
  const json& j;
  const std::string& path;
  std::vector<ConfigIssue>& errors;

  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  // The key's value as the file has it (a key left out takes transformers' default, which is what is refused).
  std::string shown(const char* k) const { return j.contains(k) ? j[k].dump() : "(left out: transformers' default)"; }
  void wrong(const char* k, const char* expected) const {
    errors.push_back({"model.hf_config", "'" + path + "': " + k + " is " + shown(k) + ", not " + expected, "check the file"});
  }
  // A key whose value changes what the model computes in a way ds does not implement: refused, never ignored.
  void unsupported(const char* k, const std::string& why) const {
    errors.push_back({"model.hf_config", "'" + path + "': " + k + " " + shown(k) + " is not supported: " + why,
                      "ds would train a different function than this config describes; remove the key only if that is intended"});
  }
  std::string text(const char* k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_string()) {
      wrong(k, "a string");
      return fallback;
    }
    return j[k].get<std::string>();
  }
  bool flag(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_boolean()) {
      wrong(k, "true or false");
      return fallback;
    }
    return j[k].get<bool>();
  }
  void real(const char* k, std::optional<double>& out) const {
    if (!has(k)) return;
    if (!j[k].is_number()) return wrong(k, "a number");
    out = j[k].get<double>();
  }
  // The first of `keys` present: a positive whole number (the model's limits are checked once resolved).
  void count(std::initializer_list<const char*> keys, std::optional<int64_t>& out) const {
    for (const char* k : keys)
      if (j.contains(k) && j[k].is_number()) {
        const double v = j[k].get<double>();
        if (!(v >= 1 && v <= 1e15) || v != std::floor(v)) {
          errors.push_back({"model.hf_config", "'" + path + "': " + k + " is " + shown(k) + ", not a positive whole number",
                            "check the file: it does not describe a model ds can build"});
          return;
        }
        out = static_cast<int64_t>(v);
        return;
      } else if (j.contains(k) && !j[k].is_null()) {
        return wrong(k, "a number");
      }
  }
};

// The file as one JSON object; null (with the error recorded) when it is not one.
json parse_hf_config(const std::string& path, std::vector<ConfigIssue>& errors) {
  std::string text;
  try {
    text = read_config_text_file(path);
  } catch (const UserError& e) {
    errors.push_back({"model.hf_config", e.what(), "give the path of a Hugging Face config.json"});
    return nullptr;
  }
  json j;
  try {
    check_json_nesting(text, path);
    j = json::parse(text, nullptr, true, true);
  } catch (const json::exception& e) {  // syntax, and numbers such as 1e999 that overflow a double
    errors.push_back({"model.hf_config", "'" + path + "' is not valid JSON: " + std::string(e.what()), ""});
    return nullptr;
  } catch (const UserError& e) {
    errors.push_back({"model.hf_config", e.what(), e.hint()});
    return nullptr;
  }
  if (!j.is_object()) {
    errors.push_back({"model.hf_config", "'" + path + "' is a JSON " + std::string(j.type_name()) + ", not an object",
                      "a Hugging Face config.json is one JSON object (model_type, hidden_size, ...)"});
    return nullptr;
  }
  return j;
}

void read_gpt2(const HfKeys& k, ModelFields& f, std::optional<double>& eps) {
  f.arch = ModelArch::gpt2;
  k.count({"n_embd", "hidden_size"}, f.hidden_size);
  k.count({"n_layer", "num_hidden_layers"}, f.num_layers);
  k.count({"n_head", "num_attention_heads"}, f.num_heads);
  k.count({"vocab_size"}, f.vocab_size);
  k.count({"n_positions", "max_position_embeddings"}, f.max_position_embeddings);
  k.count({"n_inner"}, f.intermediate_size);  // null means 4 x n_embd
  f.tie_word_embeddings = k.flag("tie_word_embeddings", true);
  k.real("layer_norm_epsilon", eps);
  k.real("attn_pdrop", f.attn_pdrop);
  k.real("resid_pdrop", f.resid_pdrop);
  k.real("embd_pdrop", f.embd_pdrop);
  const std::string act = k.text("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    k.errors.push_back({"model.hf_config", "'" + k.path + "': activation_function \"" + act + "\" is not supported",
                        "ds's gpt2 uses the tanh GELU (gelu_new)"});
  if (!k.flag("scale_attn_weights", true)) k.unsupported("scale_attn_weights", "ds always scales attention scores by 1/sqrt(head_dim)");
  if (k.flag("scale_attn_by_inverse_layer_idx", false))
    k.unsupported("scale_attn_by_inverse_layer_idx", "ds does not scale attention by 1/(layer index + 1)");
  // reorder_and_upcast_attn (type-checked only) is numerically the same function (fp32 attention scores): ds
  // computes its scores in fp32 already.
  k.flag("reorder_and_upcast_attn", false);
}

// A rotary family's sizes, biases, activation and dropout; Hugging Face's defaults for the keys a file
// leaves out are the family's (schema/arch.cpp).
void read_rotary_layers(const HfKeys& k, const ArchTraits& t, ModelFields& f, std::optional<double>& eps, std::optional<double>& theta) {
  const json& j = k.j;
  f.arch = t.arch;
  k.count({"hidden_size"}, f.hidden_size);
  k.count({"num_hidden_layers"}, f.num_layers);
  k.count({"num_attention_heads"}, f.num_heads);
  k.count({"num_key_value_heads"}, f.num_kv_heads);
  k.count({"intermediate_size"}, f.intermediate_size);
  k.count({"vocab_size"}, f.vocab_size);
  k.count({"max_position_embeddings"}, f.max_position_embeddings);
  if (t.head_dim_key) k.count({"head_dim"}, f.head_dim);
  if (!j.contains("head_dim") && t.default_head_dim > 0) f.head_dim = t.default_head_dim;
  f.tie_word_embeddings = k.flag("tie_word_embeddings", t.tied);
  if (!j.contains("rms_norm_eps")) f.norm_eps = t.norm_eps;
  if (!j.contains("rope_theta")) f.rope_theta = t.rope_theta;
  k.real("rms_norm_eps", eps);
  k.real("rope_theta", theta);
  k.real("attention_dropout", f.attn_pdrop);
  if (t.dropout_keys) k.real("resid_pdrop", f.resid_pdrop);  // Phi-3's, after each sub-layer (its embd_pdrop acts nowhere)
  if (j.contains("partial_rotary_factor") && !(j["partial_rotary_factor"].is_number() && j["partial_rotary_factor"].get<double>() == 1.0))
    k.unsupported("partial_rotary_factor", "ds rotates every dimension of each head");
  if (t.attention_bias_key) f.attention_bias = k.flag("attention_bias", false);
  else if (k.flag("attention_bias", false)) k.unsupported("attention_bias", std::string(t.name) + "'s attention has no such switch");
  if (t.mlp_bias_key) f.mlp_bias = k.flag("mlp_bias", false);
  else if (k.flag("mlp_bias", false)) k.unsupported("mlp_bias", std::string(t.name) + "'s MLP has no such switch");
  if (t.activation == Activation::geglu_tanh) {  // Gemma2MLP reads hidden_activation only (hidden_act acts nowhere)
    const std::string act = k.text("hidden_activation", "gelu_pytorch_tanh");
    if (act != "gelu_pytorch_tanh" && act != "gelu_new")
      k.unsupported("hidden_activation", "the MLP ds builds for " + std::string(t.name) + " is GeGLU with the tanh GELU");
  } else {
    const std::string act = k.text("hidden_act", "silu");
    if (act != "silu" && act != "swish") k.unsupported("hidden_act", "the MLP ds builds for " + std::string(t.name) + " is SwiGLU (silu)");
  }
}

// Gemma 2's caps and query scalar: the family's defaults when absent, null for "not capped".
void read_softcaps(const HfKeys& k, const ArchTraits& t, ModelFields& f) {
  if (!t.softcap_keys) return;
  for (const auto& [key, out, fallback] :
       {std::tuple<const char*, std::optional<double>*, double>{"attn_logit_softcapping", &f.attn_logit_softcapping, t.default_attn_softcap},
        {"final_logit_softcapping", &f.final_logit_softcapping, t.default_final_softcap},
        {"query_pre_attn_scalar", &f.query_pre_attn_scalar, t.default_query_pre_attn_scalar}}) {
    if (!k.j.contains(key)) *out = fallback;  // the family's default, as its configuration_*.py has it
    else if (k.j[key].is_null()) *out = 0.0;
    else k.real(key, *out);
    if (*out && !(**out >= 0)) k.wrong(key, "a positive number or null");
  }
}

void read_rope(const HfKeys& k, const ArchTraits& t, ModelFields& f) {
  if (k.j.contains("rope_scaling")) f.rope_scaling = read_rope_scaling(k.j["rope_scaling"], "model.hf_config", "'" + k.path + "': ", k.errors);
  // longrope's original context: in rope_scaling, or config.json's top-level key (Phi-3; its default 4096).
  if (f.rope_scaling && f.rope_scaling->type == RopeType::longrope && f.rope_scaling->original_max_position_embeddings < 1) {
    std::optional<int64_t> original;
    k.count({"original_max_position_embeddings"}, original);
    f.rope_scaling->original_max_position_embeddings = original.value_or(t.rope_original_at_top ? 4096 : 0);
  }
}

// The attention window: Mistral's and Phi-3's apply when set; Qwen2's and Qwen3's only with use_sliding_window,
// and then to the layers from max_window_layers on (all of them when it covers none).
void read_window(const HfKeys& k, const ArchTraits& t, ModelFields& f) {
  const json& j = k.j;
  if (t.default_window > 0 && !j.contains("sliding_window")) f.sliding_window = t.default_window;  // null turns it off
  // Qwen's window switched on without its size: Qwen2Config's and Qwen3Config's 4096.
  if (t.use_sliding_window_key && k.flag("use_sliding_window", false) && !k.has("sliding_window"))
    k.unsupported("use_sliding_window", "without a sliding_window (transformers then takes 4096): give the window");
  if (t.sliding_window_key && k.has("sliding_window") && (!t.use_sliding_window_key || k.flag("use_sliding_window", false))) {
    std::optional<int64_t> window;
    k.count({"sliding_window"}, window);
    // Qwen's layers from max_window_layers on slide (transformers' default 28); the ones before attend to all.
    double from = 0;
    if (t.use_sliding_window_key)
      from = j.contains("max_window_layers") && j["max_window_layers"].is_number() ? j["max_window_layers"].get<double>() : 28;
    if (window && f.num_layers && from >= static_cast<double>(*f.num_layers)) {
      // no layer slides
    } else if (window && from > 0) {
      k.unsupported("max_window_layers", "ds applies one attention window to every layer (max_window_layers 0) or to none");
    } else if (window) {
      f.sliding_window = *window;
    }
  }
  // layer_types (newer files write it out): what the family's rule gives each layer, or refused.
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    size_t i = 0;
    for (const json& l : j["layer_types"]) {
      const bool slides = f.sliding_window && *f.sliding_window > 0 && (!t.window_on_even_layers || i % 2 == 0);
      if (!l.is_string() || l.get<std::string>() != (slides ? "sliding_attention" : "full_attention")) {
        k.unsupported("layer_types", t.window_on_even_layers ? "ds slides the window on the even layers only, as Gemma 2 does"
                                                             : "ds gives every layer the same attention");
        break;
      }
      ++i;
    }
  }
}

// The special tokens, as the file has them (null: none; absent: the family's default stays).
void read_special_tokens(const HfKeys& k, ModelFields& f) {
  const json& j = k.j;
  if (j.contains("bos_token_id")) {
    if (j["bos_token_id"].is_null()) f.bos_token_id = -1;
    else if (j["bos_token_id"].is_number_integer() && j["bos_token_id"].get<int64_t>() >= 0) f.bos_token_id = j["bos_token_id"].get<int64_t>();
    else k.wrong("bos_token_id", "a token id or null");
  }
  if (j.contains("eos_token_id")) {
    const json& e = j["eos_token_id"];
    std::vector<int64_t> ids;
    bool ok = true;
    for (const json& v : e.is_array() ? e : e.is_null() ? json::array() : json::array({e}))
      if (v.is_number_integer() && v.get<int64_t>() >= 0) ids.push_back(v.get<int64_t>());
      else ok = false;
    if (ok) f.eos_token_id = ids;
    else k.wrong("eos_token_id", "a token id, a list of them, or null");
  }
}

}  // namespace

ModelFields read_hf_config(const std::string& path, std::vector<ConfigIssue>& errors) {
  ModelFields f;
  const json j = parse_hf_config(path, errors);
  if (j.is_null()) return f;
  const HfKeys k{j, path, errors};
  const std::string type = k.text("model_type", "");
  std::optional<double> eps, theta;
  if (type == "gpt2") {
    read_gpt2(k, f, eps);
  } else if (const ArchTraits* t = arch_of_hf_model_type(type); t && t->positions == Positions::rotary) {
    read_rotary_layers(k, *t, f, eps, theta);
    read_softcaps(k, *t, f);
    read_rope(k, *t, f);
    read_window(k, *t, f);
  } else {
    errors.push_back({"model.hf_config", "'" + path + "': model_type \"" + type + "\" is not supported", "ds models " + hf_model_types()});
  }
  if (eps) f.norm_eps = *eps;
  if (theta) f.rope_theta = *theta;
  read_special_tokens(k, f);
  return f;
}

}  // namespace ds::loader
