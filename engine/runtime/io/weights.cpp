#include "engine/runtime/io/weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "common/files.hpp"
#include "common/json_depth.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/strings.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/deepspeed_checkpoint.hpp"
#include "engine/runtime/io/safetensors.hpp"
#include "schema/rope_scaling.hpp"
#include "kernels/cpu/adam.hpp"

namespace ds {
namespace fs = std::filesystem;
using json = nlohmann::json;

const char* weights_kind_name(WeightsKind k) {
  switch (k) {
    case WeightsKind::ds_checkpoint: return "ds checkpoint";
    case WeightsKind::hf_directory: return "Hugging Face directory";
    case WeightsKind::safetensors_file: return "safetensors file";
    case WeightsKind::peft_adapter: return "PEFT adapter directory";
    case WeightsKind::deepspeed_checkpoint: return "DeepSpeed checkpoint";
  }
  return "?";
}

int64_t NamedShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const NamedShape* WeightSource::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {


bool is_ds_checkpoint(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p / "checkpoints", ec) || fs::exists(p / "state.h5", ec) || (p.filename() == "state.h5" && fs::is_regular_file(p, ec));
}

bool is_hf_directory(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && (fs::exists(p / "model.safetensors", ec) || fs::exists(p / "model.safetensors.index.json", ec));
}

// A ds checkpoint: its plan.json describes the tensors; each is read from the shards holding its pieces.
class DsCheckpointSource : public WeightSource {
 public:
  explicit DsCheckpointSource(const std::string& path) : reader_(path) {
    kind_ = WeightsKind::ds_checkpoint;
    dir_ = reader_.dir();
    path_ = dir_;
    const PlanRecord plan = read_checkpoint_plan(dir_);
    if (!plan.model || plan.params.empty())
      throw UserError("checkpoint '" + dir_ + "' has no readable plan.json (it records no model" +
                          std::string(plan.model ? "'s tensors)" : ")"),
                      "it was not written by ds, or is damaged; `ds convert-ckpt --info` reads only ds checkpoints and "
                      "Hugging Face files");
    model_ = *plan.model;
    has_model_ = true;
    frozen_part = plan.frozen;
    if (frozen_part) {
      json base;
      try {
        base = json::parse(read_checkpoint_text(dir_, "base_json"), nullptr, false);
      } catch (const UserError&) {  // no record of the base: exports go on without its path or checksum
      }
      if (base.is_object() && base.contains("path") && base["path"].is_string()) base_path = base["path"].get<std::string>();
      if (base.is_object() && base.contains("checksum") && base["checksum"].is_string()) base_checksum = base["checksum"].get<std::string>();
    }
    if (plan.lora)
      lora = PeftAdapter{plan.lora->r, plan.lora->alpha, plan.lora->dropout, plan.lora->target_modules, model_.traits().in_out,
                         plan.lora->layers_to_transform};
    model_numel_ = plan.layout_numel;
    world_size = plan.layout_world_size;
    tensor_parallel = plan.mesh_tensor;
    pipeline_stages = plan.mesh_pipeline;
    zero_stage = plan.zero_stage;
    precision = plan.precision;
    for (const RecordedTensor& t : plan.params) {
      tensors_.push_back({t.name, t.shape, "F32"});
      offsets_.push_back(t.offset);
    }
    const std::string leaf = fs::path(dir_).filename().string();
    if (leaf.rfind("step_", 0) == 0) step = std::strtoll(leaf.c_str() + 5, nullptr, 10);
  }

  void read_f32(const std::string& name, float* out) const override {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].name != name) continue;
      const int64_t n = tensors_[i].numel();
      CheckpointBuffers b;
      b.master = out;
      b.numel = n;
      b.segments = {OwnedSegment{static_cast<int>(i), offsets_[i], 0, n}};
      b.model_numel = model_numel_;
      b.verify = !verified_;  // every shard's checksums once, on the first tensor
      load_checkpoint(dir_, b);
      verified_ = true;
      return;
    }
    throw UserError("checkpoint '" + dir_ + "' has no tensor '" + name + "'", "");
  }

 private:
  CheckpointReader reader_;  // pruning leaves the checkpoint alone while it is read
  std::string dir_;
  std::vector<int64_t> offsets_;
  int64_t model_numel_ = 0;
  mutable bool verified_ = false;
};

// Safetensors files: one, or a Hugging Face directory's (sharded through its index or not).
class SafetensorsSource : public WeightSource {
 public:
  explicit SafetensorsSource(const std::string& path) {
    path_ = path;
    std::vector<fs::path> files;
    if (fs::is_directory(path)) {
      kind_ = WeightsKind::hf_directory;
      const fs::path index = fs::path(path) / "model.safetensors.index.json";
      if (fs::exists(index) && fs::exists(fs::path(path) / "model.safetensors"))
        throw UserError("'" + path + "' holds both model.safetensors and model.safetensors.index.json: two exports mixed, "
                        "and which weights are meant cannot be told",
                        "remove the one that is stale (an index and its model-NNNNN-of-NNNNN.safetensors shards, or the single "
                        "file), or export again into an empty directory");
      if (fs::exists(index)) {
        std::set<std::string> names;
        try {
          std::error_code ec;
          if (fs::file_size(index, ec) > (uintmax_t{256} << 20)) throw UserError("'" + index.string() + "' is larger than 256 MiB: not an index", "");
          const std::string text = read_file_bytes(index.string());  // a regular file only: a FIFO would block
          check_json_nesting(text, index.string());
          const json map = json::parse(text).at("weight_map");  // held: a range-for over a temporary's items() reads freed memory
          for (const auto& [tensor, file] : map.items()) names.insert(file.get<std::string>());
        } catch (const json::exception& e) {
          throw UserError("'" + index.string() + "' is not a safetensors index (" + e.what() + ")", "");
        }
        for (const auto& n : names) {
          if (n.find('/') != std::string::npos || n.find("..") != std::string::npos)
            throw UserError("'" + index.string() + "' names a file outside its directory: '" + n + "'", "");
          files.push_back(fs::path(path) / n);
        }
      } else {
        files.push_back(fs::path(path) / "model.safetensors");
      }
    } else {
      kind_ = WeightsKind::safetensors_file;
      files.push_back(path);
    }
    for (const auto& f : files) {
      files_.push_back(std::make_unique<SafetensorsFile>(f.string()));
      const SafetensorsView& v = files_.back()->view();
      for (const StTensor& t : v.tensors()) {
        if (where_.count(t.name))
          throw UserError("tensor '" + t.name + "' is in both '" + where_[t.name]->view().source() + "' and '" + v.source() + "'", "");
        where_[t.name] = files_.back().get();
        tensors_.push_back({t.name, t.shape, st_dtype_name(t.dtype)});
      }
    }
  }

  void read_f32(const std::string& name, float* out) const override {
    const auto it = where_.find(name);
    if (it == where_.end()) throw UserError("'" + path_ + "' has no tensor '" + name + "'", "");
    it->second->read_f32(*it->second->view().find(name), out);
  }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// PEFT's LoRA adapter directory: the adapter's tensors without PEFT's "base_model.model." prefix, so they
// are named as a ds LoRA run names them.
class PeftAdapterSource : public WeightSource {
 public:
  explicit PeftAdapterSource(const std::string& path) : file_((fs::path(path) / "adapter_model.safetensors").string()) {
    kind_ = WeightsKind::peft_adapter;
    path_ = path;
    const std::string config_path = (fs::path(path) / "adapter_config.json").string();
    const auto refuse = [&](const std::string& what) { throw UserError("'" + config_path + "' " + what, "ds trains and reads LoRA adapters (PEFT's peft_type LORA) with bias none"); };
    json c;
    try {
      const std::string text = read_file_bytes(config_path);
      check_json_nesting(text, config_path);
      c = json::parse(text);
      if (c.value("peft_type", "") != "LORA") refuse("is not a LoRA adapter (peft_type " + c.value("peft_type", std::string("missing")) + ")");
      if (c.value("bias", "none") != "none") refuse("trains biases (bias " + c["bias"].dump() + ")");
      if (c.value("use_rslora", false)) refuse("uses rsLoRA (scale alpha / sqrt(r)), which ds does not train");
      if (!c.contains("target_modules") || !c["target_modules"].is_array())
        refuse("names its target_modules by a pattern, not a list of module names");
      refuse_peft_options(c, refuse);
      PeftAdapter a;
      if (!c.contains("r") || !c["r"].is_number_integer() || c["r"].get<int64_t>() < 1 || c["r"].get<int64_t>() > 65536)
        refuse("has r " + (c.contains("r") ? c["r"].dump() : std::string("missing")) + ": the rank is a whole number from 1 to 65536");
      a.r = c["r"].get<int64_t>();
      if (!c.contains("lora_alpha") || !c["lora_alpha"].is_number() || !(c["lora_alpha"].get<double>() > 0) ||
          !std::isfinite(c["lora_alpha"].get<double>()))
        refuse("has lora_alpha " + (c.contains("lora_alpha") ? c["lora_alpha"].dump() : std::string("missing")) + ": a positive number");
      a.alpha = c["lora_alpha"].get<double>();
      const json dropout = c.value("lora_dropout", json(0.0));
      if (!dropout.is_number() || !(dropout.get<double>() >= 0 && dropout.get<double>() < 1))
        refuse("has lora_dropout " + dropout.dump() + ": a probability from 0 up to (not including) 1");
      a.dropout = dropout.get<double>();
      if (c["target_modules"].size() > 4096) refuse("lists " + std::to_string(c["target_modules"].size()) + " target_modules: more than a model has");
      a.target_modules = c["target_modules"].get<std::vector<std::string>>();
      a.fan_in_fan_out = c.value("fan_in_fan_out", false);
      read_layers(c, a, refuse);
      lora = a;
      if (c.contains("base_model_name_or_path") && c["base_model_name_or_path"].is_string()) base_path = c["base_model_name_or_path"].get<std::string>();
      // A relative base is read from the adapter's own directory first (where ds exports record it from).
      if (!base_path.empty() && fs::path(base_path).is_relative() && fs::exists(fs::path(path) / base_path))
        base_path = (fs::path(path) / base_path).lexically_normal().string();
      read_recorded_base(path);
    } catch (const json::exception& e) {
      throw UserError("'" + config_path + "' is not a PEFT adapter config (" + e.what() + ")", "");
    }
    frozen_part = true;
    const std::string prefix = "base_model.model.";
    for (NamedShape t : file_.tensors()) {
      if (t.name.rfind(prefix, 0) != 0) throw UserError("'" + file_.path() + "' holds '" + t.name + "', not a PEFT adapter's tensor", "");
      t.name = t.name.substr(prefix.size());
      tensors_.push_back(t);
    }
  }
  void read_f32(const std::string& name, float* out) const override { file_.read_f32("base_model.model." + name, out); }

 private:
  // What PEFT's adapter_config.json may carry beyond what ds reads: options that change what the adapter
  // computes are refused by name when set; the rest (bookkeeping) have no effect on the weights.
  static void refuse_peft_options(const json& c, const std::function<void(const std::string&)>& refuse) {
    const auto set = [&](const char* key) {
      if (!c.contains(key)) return false;
      const json& v = c[key];
      return !(v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) || (v.is_array() && v.empty()));
    };
    for (const auto& [key, what] : std::initializer_list<std::pair<const char*, const char*>>{
             {"alpha_pattern", "sets lora_alpha per module (alpha_pattern)"},
             {"rank_pattern", "sets r per module (rank_pattern)"},
             {"use_dora", "is a DoRA adapter (use_dora: a learned magnitude per output)"},
             {"modules_to_save", "trains whole modules besides the adapter (modules_to_save)"},
             {"layer_replication", "replicates layers (layer_replication)"},
             {"lora_bias", "trains a bias on lora_B (lora_bias)"},
             {"exclude_modules", "excludes modules from target_modules (exclude_modules)"},
             {"target_parameters", "adapts parameters rather than modules (target_parameters)"},
             {"trainable_token_indices", "trains some embedding rows (trainable_token_indices)"}})
      if (set(key)) refuse(std::string(what) + ", which ds does not train");
  }
  // PEFT's layers_to_transform (one block or a list; null: every block), with layers_pattern naming the blocks' list
  // as the model does (GPT-2's "h", the others' "layers"), or left out.
  static void read_layers(const json& c, PeftAdapter& a, const std::function<void(const std::string&)>& refuse) {
    const json layers = c.value("layers_to_transform", json(nullptr));
    if (layers.is_number_integer() && layers.get<int64_t>() >= 0) a.layers_to_transform = {layers.get<int64_t>()};
    else if (layers.is_array() && layers.size() <= 4096 && std::all_of(layers.begin(), layers.end(), [](const json& v) { return v.is_number_integer() && v.get<int64_t>() >= 0; }))
      a.layers_to_transform = layers.get<std::vector<int64_t>>();
    else if (!layers.is_null()) refuse("has layers_to_transform " + layers.dump() + ": a block number or a list of them");
    std::sort(a.layers_to_transform.begin(), a.layers_to_transform.end());
    a.layers_to_transform.erase(std::unique(a.layers_to_transform.begin(), a.layers_to_transform.end()), a.layers_to_transform.end());
    const json pattern = c.value("layers_pattern", json(nullptr));
    const bool named = pattern.is_null() || (pattern.is_string() && (pattern == "h" || pattern == "layers")) ||
                       (pattern.is_array() && pattern.size() == 1 && pattern[0].is_string() && (pattern[0] == "h" || pattern[0] == "layers"));
    if (!named) refuse("finds its layers by layers_pattern " + pattern.dump() + ", where ds numbers the blocks of h (GPT-2) or layers");
  }
  // ds's own exports record the base they were trained on (path and checksum of its frozen weights) in
  // ds_base.json beside adapter_config.json, which PEFT leaves alone.
  void read_recorded_base(const std::string& dir) {
    const fs::path record = fs::path(dir) / "ds_base.json";
    std::error_code ec;
    if (!fs::is_regular_file(record, ec)) return;
    const std::string text = read_file_bytes(record.string());
    check_json_nesting(text, record.string());
    const json r = json::parse(text, nullptr, false);
    if (r.is_object() && r.contains("checksum") && r["checksum"].is_string()) base_checksum = r["checksum"].get<std::string>();
  }
  SafetensorsSource file_;
};

bool is_peft_adapter(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::exists(p / "adapter_config.json", ec) && fs::exists(p / "adapter_model.safetensors", ec);
}

bool ignorable(const std::string& name, const ModelSpec& model) {
  if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias")) return model.hp.arch == ModelArch::gpt2;  // its causal mask buffers
  if (name == "lm_head.weight") return model.hp.tie_word_embeddings;
  return name == "rotary_emb.inv_freq" || ends_with(name, ".rotary_emb.inv_freq");
}

}  // namespace


WeightsKind detect_weights(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) throw UserError("'" + path + "' does not exist", "give a ds run or checkpoint directory, a Hugging Face model directory or a .safetensors file");
  if (is_peft_adapter(p)) return WeightsKind::peft_adapter;
  if (is_hf_directory(p)) return WeightsKind::hf_directory;
  if (fs::is_regular_file(p, ec) && p.extension() == ".safetensors") return WeightsKind::safetensors_file;
  if (is_ds_checkpoint(p) || fs::exists(p / "DONE", ec)) return WeightsKind::ds_checkpoint;
  if (is_deepspeed_checkpoint(path)) return WeightsKind::deepspeed_checkpoint;
  throw UserError("'" + path + "' is neither a ds run or checkpoint, a Hugging Face model directory (config.json with "
                      "model.safetensors or model.safetensors.index.json) nor a .safetensors file",
                  "");
}

std::unique_ptr<WeightSource> open_weights(const std::string& path) {
  switch (detect_weights(path)) {
    case WeightsKind::ds_checkpoint: return std::make_unique<DsCheckpointSource>(path);
    case WeightsKind::peft_adapter: return std::make_unique<PeftAdapterSource>(path);
    case WeightsKind::deepspeed_checkpoint:
      return std::make_unique<DeepSpeedSource>(std::make_shared<DeepSpeedCheckpoint>(path), false, false);
    case WeightsKind::hf_directory:
    case WeightsKind::safetensors_file: break;
  }
  return std::make_unique<SafetensorsSource>(path);
}

std::vector<std::string> match_weights(const WeightSource& source, const ModelSpec& model) {
  std::vector<std::string> names;
  std::set<std::string> used;
  for (const TensorSpec& t : model.tensors) {
    const NamedShape* s = source.find(t.name);
    if (!s && t.name.rfind("transformer.", 0) == 0) s = source.find(t.name.substr(12));  // original GPT-2 files
    if (!s)
      throw UserError("'" + source.path() + "' has no tensor '" + t.name + "' " + format_shape(t.shape) + " that the model needs",
                      "the model block (or model.hf_config) must describe the model the weights were trained as");
    if (s->shape != t.shape)
      throw UserError("tensor '" + t.name + "' is " + format_shape(s->shape) + " in '" + source.path() + "' but " +
                          format_shape(t.shape) + " in this model",
                      "the model block (or model.hf_config) must describe the model the weights were trained as");
    names.push_back(s->name);
    used.insert(s->name);
  }
  std::vector<std::string> extra;
  for (const NamedShape& s : source.tensors())
    if (!used.count(s.name) && !ignorable(s.name, model)) extra.push_back(s.name);
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 3; ++i) list += (i ? ", " : "") + extra[i];
    if (extra.size() > 3) list += ", ... (" + std::to_string(extra.size()) + " in all)";
    throw UserError("'" + source.path() + "' has tensors this model does not: " + list,
                    "the model block (or model.hf_config) must describe the model the weights were trained as");
  }
  return names;
}

void load_weights(const WeightSource& source, const ModelSpec& model, float* whole) {
  const std::vector<std::string> names = match_weights(source, model);
  int64_t at = 0;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    source.read_f32(names[i], whole + at);
    at += model.tensors[i].numel;
  }
}

FloatPieces weights_in_pieces(const WeightSource& source, const ModelSpec& model) {
  struct Cursor {
    std::vector<std::string> names;
    std::vector<int64_t> begins;  // each tensor's first element in the flat order, then the end
    size_t held = SIZE_MAX;      // the tensor in `values`
    std::vector<float> values;
  };
  auto c = std::make_shared<Cursor>();
  c->names = match_weights(source, model);
  c->begins.push_back(0);
  for (const auto& t : model.tensors) c->begins.push_back(c->begins.back() + t.numel);
  return [c, &source](int64_t at, int64_t n, float* out) {
    while (n > 0) {
      if (at >= c->begins.back()) {  // past the model: padding
        std::fill(out, out + n, 0.0f);
        return;
      }
      const size_t i = static_cast<size_t>(std::upper_bound(c->begins.begin(), c->begins.end(), at) - c->begins.begin()) - 1;
      if (c->held != i) {
        c->values.assign(static_cast<size_t>(c->begins[i + 1] - c->begins[i]), 0.0f);
        source.read_f32(c->names[i], c->values.data());
        c->held = i;
      }
      const int64_t from = at - c->begins[i], take = std::min(n, c->begins[i + 1] - at);
      std::copy_n(c->values.data() + from, take, out);
      out += take;
      at += take;
      n -= take;
    }
  };
}

namespace {
// A special token as Hugging Face writes it: null, one id, or a list of ids.
nlohmann::ordered_json special_token_json(const std::vector<int64_t>& ids) {
  if (ids.empty()) return nullptr;
  if (ids.size() == 1) return ids[0];
  return ids;
}
}  // namespace

std::string hf_config_json(const ModelHyper& hp, const std::string& torch_dtype) {
  nlohmann::ordered_json j;
  const ArchTraits& t = hp.traits();
  j["architectures"] = {t.hf_class};
  j["model_type"] = t.hf_model_type;
  switch (t.positions) {
  case Positions::learned:  // GPT-2
    j["vocab_size"] = hp.vocab_size;
    j["n_positions"] = hp.max_position_embeddings;
    j["n_ctx"] = hp.max_position_embeddings;
    j["n_embd"] = hp.hidden_size;
    j["n_layer"] = hp.num_layers;
    j["n_head"] = hp.num_heads;
    j["n_inner"] = hp.intermediate_size == 4 * hp.hidden_size ? json(nullptr) : json(hp.intermediate_size);
    j["activation_function"] = "gelu_new";  // the tanh approximation ds computes
    j["layer_norm_epsilon"] = hp.norm_eps;
    j["resid_pdrop"] = hp.resid_pdrop;
    j["embd_pdrop"] = hp.embd_pdrop;
    j["attn_pdrop"] = hp.attn_pdrop;
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = true;
    break;
  case Positions::rotary:  // Llama and the families of its block
    j["vocab_size"] = hp.vocab_size;
    j["hidden_size"] = hp.hidden_size;
    j["intermediate_size"] = hp.intermediate_size;
    j["num_hidden_layers"] = hp.num_layers;
    j["num_attention_heads"] = hp.num_heads;
    j["num_key_value_heads"] = hp.num_kv_heads > 0 ? hp.num_kv_heads : hp.num_heads;
    j["head_dim"] = hp.head_dim();
    j["max_position_embeddings"] = hp.max_position_embeddings;
    j["rms_norm_eps"] = hp.norm_eps;
    j["rope_theta"] = hp.rope_theta;
    j["rope_scaling"] = rope_scaling_json(hp.rope_scaling);
    if (t.rope_original_at_top) {
      // Phi3Config keeps longrope's original context at the top level, and (transformers 4.4x) wants exactly
      // type, short_factor and long_factor in rope_scaling.
      j["original_max_position_embeddings"] = hp.rope_scaling.type == RopeType::longrope ? hp.rope_scaling.original_max_position_embeddings
                                                                                            : hp.max_position_embeddings;
      if (hp.rope_scaling.type == RopeType::longrope) {
        nlohmann::ordered_json r;
        r["type"] = "longrope";
        r["short_factor"] = hp.rope_scaling.short_factor;
        r["long_factor"] = hp.rope_scaling.long_factor;
        if (hp.rope_scaling.attention_factor) r["attention_factor"] = *hp.rope_scaling.attention_factor;
        j["rope_scaling"] = r;
      }
    }
    if (t.activation == Activation::geglu_tanh) {
      j["hidden_act"] = "gelu_pytorch_tanh";
      j["hidden_activation"] = "gelu_pytorch_tanh";
    } else {
      j["hidden_act"] = "silu";
    }
    if (t.softcap_keys) {
      j["attn_logit_softcapping"] = hp.attn_softcap > 0 ? json(hp.attn_softcap) : json(nullptr);
      j["final_logit_softcapping"] = hp.final_softcap > 0 ? json(hp.final_softcap) : json(nullptr);
      j["query_pre_attn_scalar"] = hp.query_pre_attn_scalar > 0 ? hp.query_pre_attn_scalar : static_cast<double>(hp.head_dim());
    }
    if (t.attention_bias_key) j["attention_bias"] = hp.attention_bias;
    if (t.mlp_bias_key) j["mlp_bias"] = hp.mlp_bias;
    if (t.sliding_window_key) {
      const json window = hp.sliding_window > 0 ? json(hp.sliding_window) : json(nullptr);
      if (!t.use_sliding_window_key) {
        j["sliding_window"] = window;
      } else {  // Qwen: the window acts only with use_sliding_window, on the layers from max_window_layers on
        j["use_sliding_window"] = hp.sliding_window > 0;
        j["sliding_window"] = window;
        j["max_window_layers"] = hp.sliding_window > 0 ? 0 : hp.num_layers;
      }
    }
    j["attention_dropout"] = hp.attn_pdrop;
    if (t.dropout_keys) j["resid_pdrop"] = hp.resid_pdrop;  // Phi3Config's dropout after each sub-layer
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = hp.tie_word_embeddings;
    break;
  }
  // Written even when the vocabulary has none (null): transformers would otherwise take its own default
  // (GPT-2's 50256), an id outside a small vocabulary.
  j["bos_token_id"] = special_token_json(hp.bos_token_id >= 0 ? std::vector<int64_t>{hp.bos_token_id} : std::vector<int64_t>{});
  j["eos_token_id"] = special_token_json(hp.eos_token_id);
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::string hf_generation_config_json(const ModelHyper& hp) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["_from_model_config"] = true;
  j["bos_token_id"] = special_token_json(hp.bos_token_id >= 0 ? std::vector<int64_t>{hp.bos_token_id} : std::vector<int64_t>{});
  j["eos_token_id"] = special_token_json(hp.eos_token_id);
  return j.dump(2) + "\n";
}

namespace {

StDtype export_dtype(const std::string& d) {
  if (d == "fp32") return StDtype::F32;
  if (d == "bf16") return StDtype::BF16;
  if (d == "fp16") return StDtype::F16;
  throw UserError("--dtype " + d + ": expected fp32, bf16 or fp16", "");
}

const char* torch_dtype_of(StDtype d) { return d == StDtype::BF16 ? "bfloat16" : d == StDtype::F16 ? "float16" : "float32"; }

// One tensor of an export: the source's name, the name written, its shape.
struct ExportTensor {
  std::string from, to;
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

std::vector<ExportTensor> export_tensors(const std::vector<std::string>& names, const ModelSpec& model) {
  std::vector<ExportTensor> out;
  for (size_t i = 0; i < model.tensors.size(); ++i)
    out.push_back({names[i], model.tensors[i].name, model.tensors[i].shape, model.tensors[i].numel});
  return out;
}

// Before an fp16 export writes anything: every value checked against fp16's range. A value beyond
// +-65504 would become inf (refused unless allowed, naming the first); nonzero values below half its
// smallest subnormal (2^-25) become 0 (counted, as every fp16 cast does it).
void check_fp16_range(const WeightSource& src, const std::vector<ExportTensor>& tensors, const ExportOptions& options, ExportSummary& s) {
  std::vector<float> v;
  for (const ExportTensor& t : tensors) {
    v.resize(static_cast<size_t>(t.numel));
    src.read_f32(t.from, v.data());
    for (size_t k = 0; k < v.size(); ++k) {
      const float a = std::fabs(v[k]);
      if (a > 65504.0f && std::isfinite(a)) {
        if (!options.allow_fp16_overflow)
          throw UserError("tensor '" + t.to + "' holds " + format_double(v[k]) + " (element " + std::to_string(k) +
                              "), beyond fp16's range (+-65504): exported in fp16 it would become " + (v[k] > 0 ? "+inf" : "-inf"),
                          "export in bf16 (--dtype bf16: fp32's range) or fp32; --allow-fp16-overflow writes the infinities anyway");
        ++s.fp16_overflowed;
      } else if (a != 0.0f && a < 2.98023224e-8f) {  // 2^-25: rounds to zero in fp16
        ++s.fp16_flushed;
      }
    }
  }
}

// A tensor of the source, converted on demand to `dtype`.
StTensorSource converted(const WeightSource& src, const std::string& from, const std::string& to, const std::vector<int64_t>& shape,
                         StDtype dtype) {
  StTensorSource t;
  t.name = to;
  t.dtype = dtype;
  t.shape = shape;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.fill = [&src, from, dtype, n](uint8_t* out) {
    // fp32 straight into the writer's buffer (malloc'd, so aligned for floats): one copy of the tensor in memory.
    if (dtype == StDtype::F32) {
      src.read_f32(from, reinterpret_cast<float*>(out));
      return;
    }
    std::vector<float> v(static_cast<size_t>(n));
    src.read_f32(from, v.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = dtype == StDtype::BF16 ? kernels::float_to_bf16(v[static_cast<size_t>(i)]) : f32_to_f16(v[static_cast<size_t>(i)]);
      std::memcpy(out + 2 * i, &h, 2);
    }
  };
  return t;
}

}  // namespace

namespace {

// The weights of a Hugging Face directory: model.safetensors, or shards of at most max_shard_bytes (a tensor
// larger than that gets a shard of its own) with model.safetensors.index.json; `s.files` holds what was
// written before them. The previous export's weight files that this one did not write are removed.
void write_hf_weights(const WeightSource& source, const std::vector<ExportTensor>& tensors, const fs::path& dir, StDtype dtype,
                      const ExportOptions& options, ExportSummary& s) {
  std::vector<std::vector<StTensorSource>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const ExportTensor& t : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel) * static_cast<uint64_t>(st_dtype_bytes(dtype));
    if (!shards.back().empty() && in_shard + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(converted(source, t.from, t.to, t.shape, dtype));
    in_shard += bytes;
    total += bytes;
  }
  if (shards.size() == 1) {
    s.tensor_bytes = write_safetensors((dir / "model.safetensors").string(), shards[0]);
    s.files.push_back((dir / "model.safetensors").string());
  } else {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = nlohmann::ordered_json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      s.tensor_bytes += write_safetensors((dir / name).string(), shards[k]);
      s.files.push_back((dir / name).string());
      for (const auto& t : shards[k]) index["weight_map"][t.name] = name;
    }
    write_text_atomically((dir / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    s.files.push_back((dir / "model.safetensors.index.json").string());
  }
  s.tensors = static_cast<int64_t>(tensors.size());
  // The previous export's weight files that this one did not write (an index and shards where there is now one
  // file, or the other way round, or more shards than now): removed, so the directory holds one export only.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool weights = n == "model.safetensors" || n == "model.safetensors.index.json" ||
                         (n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos && n.size() > 12 &&
                          n.compare(n.size() - 12, 12, ".safetensors") == 0);
    if (weights && std::find(s.files.begin(), s.files.end(), e.path().string()) == s.files.end()) s.removed.push_back(e.path().string());
  }
  for (const std::string& f : s.removed) fs::remove(f, ec);
}

}  // namespace

ExportSummary export_hf_directory(const WeightSource& source, const ModelHyper& hp, const std::string& out_dir,
                                  const ExportOptions& options) {
  const ModelSpec model = build_model_spec(hp);
  const std::vector<ExportTensor> tensors = export_tensors(match_weights(source, model), model);
  const StDtype dtype = export_dtype(options.dtype);
  ExportSummary s;
  if (dtype == StDtype::F16) check_fp16_range(source, tensors, options, s);
  fs::create_directories(out_dir);
  const fs::path dir(out_dir);
  write_text_atomically((dir / "config.json").string(), hf_config_json(hp, torch_dtype_of(dtype)));
  write_text_atomically((dir / "generation_config.json").string(), hf_generation_config_json(hp));
  s.files = {(dir / "config.json").string(), (dir / "generation_config.json").string()};
  write_hf_weights(source, tensors, dir, dtype, options, s);
  return s;
}

namespace {
// `tensors` as one .safetensors file, after fp16's range check.
ExportSummary write_one_file(const WeightSource& source, const std::vector<ExportTensor>& tensors, const std::string& file,
                             const ExportOptions& options) {
  const StDtype dtype = export_dtype(options.dtype);
  ExportSummary s;
  if (dtype == StDtype::F16) check_fp16_range(source, tensors, options, s);
  std::vector<StTensorSource> out;
  for (const ExportTensor& t : tensors) out.push_back(converted(source, t.from, t.to, t.shape, dtype));
  // Its folder made as a directory export's is (out/model.safetensors into a new out/).
  if (const fs::path parent = fs::path(file).parent_path(); !parent.empty()) fs::create_directories(parent);
  s.tensor_bytes = write_safetensors(file, out);
  s.files = {file};
  s.tensors = static_cast<int64_t>(out.size());
  return s;
}
}  // namespace

ExportSummary export_as_named(const WeightSource& source, const std::string& dst, const std::string& config_json,
                              const std::vector<std::pair<std::string, std::string>>& extra_files, const ExportOptions& options) {
  std::vector<ExportTensor> tensors;
  for (const NamedShape& t : source.tensors()) tensors.push_back({t.name, t.name, t.shape, t.numel()});
  if (config_json.empty()) return write_one_file(source, tensors, dst, options);
  const StDtype dtype = export_dtype(options.dtype);
  ExportSummary s;
  if (dtype == StDtype::F16) check_fp16_range(source, tensors, options, s);
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(config_json);
  config["torch_dtype"] = torch_dtype_of(dtype);
  const fs::path dir(dst);
  fs::create_directories(dir);
  write_text_atomically((dir / "config.json").string(), config.dump(2) + "\n");
  s.files.push_back((dir / "config.json").string());
  for (const auto& [name, bytes] : extra_files) {
    write_text_atomically((dir / name).string(), bytes);
    s.files.push_back((dir / name).string());
  }
  write_hf_weights(source, tensors, dir, dtype, options, s);
  return s;
}

ExportSummary export_peft_adapter(const WeightSource& source, const std::string& out_dir, const ExportOptions& options) {
  DS_CHECK(source.lora.has_value(), "export_peft_adapter: the source holds no adapter");
  const PeftAdapter& a = *source.lora;
  const StDtype dtype = export_dtype(options.dtype);
  std::vector<ExportTensor> adapter;  // the source's tensors under PEFT's names
  for (const NamedShape& t : source.tensors()) adapter.push_back({t.name, "base_model.model." + t.name, t.shape, t.numel()});
  ExportSummary s;
  if (dtype == StDtype::F16) check_fp16_range(source, adapter, options, s);
  std::vector<StTensorSource> tensors;
  for (const ExportTensor& t : adapter) tensors.push_back(converted(source, t.from, t.to, t.shape, dtype));
  nlohmann::ordered_json c;
  c["peft_type"] = "LORA";
  c["task_type"] = "CAUSAL_LM";
  c["base_model_name_or_path"] = source.base_path.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(source.base_path);
  c["r"] = a.r;
  c["lora_alpha"] = a.alpha;
  c["lora_dropout"] = a.dropout;
  c["target_modules"] = a.target_modules;
  c["layers_to_transform"] = a.layers_to_transform.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(a.layers_to_transform);
  c["layers_pattern"] = nullptr;
  c["bias"] = "none";
  c["fan_in_fan_out"] = a.fan_in_fan_out;
  c["inference_mode"] = true;
  c["init_lora_weights"] = true;
  c["modules_to_save"] = nullptr;
  c["use_rslora"] = false;
  const fs::path dir(out_dir);
  fs::create_directories(dir);
  write_text_atomically((dir / "adapter_config.json").string(), c.dump(2) + "\n");
  s.tensor_bytes = write_safetensors((dir / "adapter_model.safetensors").string(), tensors);
  s.files = {(dir / "adapter_config.json").string(), (dir / "adapter_model.safetensors").string()};
  if (!source.base_checksum.empty()) {  // checked when ds continues the adapter or merges it
    nlohmann::ordered_json b;
    b["path"] = source.base_path;
    b["checksum"] = source.base_checksum;
    b["what"] = "the checksum of the frozen base weights this adapter was trained on, as ds computes it";
    write_text_atomically((dir / "ds_base.json").string(), b.dump(2) + "\n");
    s.files.push_back((dir / "ds_base.json").string());
  }
  s.tensors = static_cast<int64_t>(tensors.size());
  return s;
}

ExportSummary export_safetensors_file(const WeightSource& source, const ModelSpec& model, const std::string& file,
                                      const ExportOptions& options) {
  return write_one_file(source, export_tensors(match_weights(source, model), model), file, options);
}

}  // namespace ds
