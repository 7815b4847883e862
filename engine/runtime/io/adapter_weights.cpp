// ds — what a frozen base and a trained part make together (LoRA, model.freeze): the checksum a run records
// of its base, the merged model convert-ckpt --merge writes (the trained tensors put back, each adapter
// folded into its projection), and the checks a PEFT adapter passes before a run continues it. The
// readers and writers of the formats themselves are weights.cpp's.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/strings.hpp"
#include "engine/runtime/io/weights.hpp"

namespace ds {

namespace {

class MergedSource : public WeightSource {
 public:
  MergedSource(const WeightSource& base, const WeightSource& adapter) : base_(base), adapter_(adapter) {
    DS_CHECK(adapter.frozen_part, "merged_weights: the checkpoint holds every weight");
    kind_ = base.kind();
    path_ = base.path() + " + " + adapter.path();
    tensors_ = base.tensors();
    has_model_ = base.has_model();
    model_ = base.model();
    if (adapter.lora) {
      scale_ = adapter.lora->alpha / static_cast<double>(adapter.lora->r);
      in_out_ = adapter.lora->fan_in_fan_out;
    }
    // A name as the base may spell it: ds's, or an original GPT-2 file's without "transformer.".
    const auto both = [](const std::string& name, const std::string& value, std::map<std::string, std::string>& into) {
      into[name] = value;
      if (name.rfind("transformer.", 0) == 0) into[name.substr(12)] = value;
    };
    for (const NamedShape& t : adapter.tensors()) {
      const std::string suffix = ".lora_A.weight";
      if (ends_with(t.name, suffix)) {
        const std::string stem = t.name.substr(0, t.name.size() - suffix.size());
        both(stem + ".weight", stem, stems_);
      } else if (!ends_with(t.name, ".lora_B.weight")) {
        both(t.name, t.name, trained_);  // model.freeze: a tensor that trained
      }
    }
  }

  void read_f32(const std::string& name, float* out) const override {
    if (const auto t = trained_.find(name); t != trained_.end()) return adapter_.read_f32(t->second, out);
    base_.read_f32(name, out);
    const auto it = stems_.find(name);
    if (it == stems_.end()) return;
    const NamedShape* a = adapter_.find(it->second + ".lora_A.weight");
    const NamedShape* b = adapter_.find(it->second + ".lora_B.weight");
    DS_CHECK(a && b && a->shape.size() == 2 && b->shape.size() == 2 && a->shape[0] == b->shape[1], "adapter of ", name, " is not (r, in), (out, r)");
    const int64_t r = a->shape[0], in = a->shape[1], out_dim = b->shape[0];
    std::vector<float> A(static_cast<size_t>(a->numel())), B(static_cast<size_t>(b->numel()));
    adapter_.read_f32(a->name, A.data());
    adapter_.read_f32(b->name, B.data());
    // W (out, in) += scale B A; GPT-2's Conv1D stores W^T (in, out). Summed in double, rounded once.
    for (int64_t o = 0; o < out_dim; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < r; ++k) d += static_cast<double>(B[static_cast<size_t>(o * r + k)]) * A[static_cast<size_t>(k * in + i)];
        float& w = out[in_out_ ? i * out_dim + o : o * in + i];
        w = static_cast<float>(static_cast<double>(w) + scale_ * d);
      }
  }

 private:
  const WeightSource& base_;
  const WeightSource& adapter_;
  double scale_ = 0;
  bool in_out_ = false;
  std::map<std::string, std::string> stems_;    // a base tensor's name -> its adapter's stem in the checkpoint
  std::map<std::string, std::string> trained_;  // a base tensor's name -> the checkpoint's tensor that replaces it
};

}  // namespace

std::string weights_checksum(const WeightSource& source, const ModelSpec& model, const std::vector<uint8_t>& frozen) {
  const std::vector<std::string> names = match_weights(source, model);
  uint64_t h = kWeightsChecksumSeed;
  std::vector<float> v;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!frozen.empty() && !frozen[i]) continue;
    v.resize(static_cast<size_t>(model.tensors[i].numel));
    source.read_f32(names[i], v.data());
    h = fold_weights_checksum(h, v.data(), model.tensors[i].numel);
  }
  return hex64(h);
}

std::unique_ptr<WeightSource> merged_weights(const WeightSource& base, const WeightSource& adapter) {
  return std::make_unique<MergedSource>(base, adapter);
}

void check_peft_adapter(const WeightSource& adapter, const LoraPlan& lora) {
  DS_CHECK(adapter.lora.has_value(), "check_peft_adapter: not an adapter");
  const PeftAdapter& a = *adapter.lora;
  const std::string hint = "model.lora must describe the adapter model.init_from continues (its adapter_config.json)";
  const auto differ = [&](const std::string& key, const std::string& peft, const std::string& mine) {
    throw UserError("model.lora." + key + " is " + mine + ", but the adapter '" + adapter.path() + "' has " + peft, hint);
  };
  if (a.r != lora.r) differ("r", std::to_string(a.r), std::to_string(lora.r));
  if (a.alpha != lora.alpha) differ("alpha", format_double(a.alpha), format_double(lora.alpha));
  std::vector<std::string> theirs = a.target_modules, mine = lora.target_modules;
  std::sort(theirs.begin(), theirs.end());
  std::sort(mine.begin(), mine.end());
  // A list shown in a message is cut to its first names: an adapter_config.json may list thousands.
  const auto some = [](const std::vector<std::string>& names) {
    std::vector<std::string> head(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(names.size(), 16)));
    return join(head, ", ") + (names.size() > 16 ? " and " + std::to_string(names.size() - 16) + " more" : "");
  };
  if (theirs != mine) differ("target_modules", some(a.target_modules), some(lora.target_modules));
  const auto blocks = [](const std::vector<int64_t>& layers) {
    if (layers.empty()) return std::string("every block (null)");
    std::vector<std::string> names;
    for (const int64_t l : layers) names.push_back(std::to_string(l));
    return "[" + join(names, ", ") + "]";
  };
  if (a.layers_to_transform != lora.layers) differ("layers_to_transform", blocks(a.layers_to_transform), blocks(lora.layers));
  for (const TensorSpec& t : lora.adapters.tensors) {
    const NamedShape* s = adapter.find(t.name);
    if (!s) throw UserError("the adapter '" + adapter.path() + "' has no tensor '" + t.name + "' " + format_shape(t.shape), hint);
    if (s->shape != t.shape)
      throw UserError("the adapter's tensor '" + t.name + "' is " + format_shape(s->shape) + " but " + format_shape(t.shape) + " here", hint);
  }
  if (adapter.tensors().size() != lora.adapters.tensors.size())
    throw UserError("the adapter '" + adapter.path() + "' has " + std::to_string(adapter.tensors().size()) + " tensors, this model's adapter " +
                        std::to_string(lora.adapters.tensors.size()),
                    hint);
}

std::unique_ptr<WeightSource> open_adapter_base(const WeightSource& adapter) {
  if (adapter.base_path.empty())
    throw UserError("the adapter '" + adapter.path() + "' names no base (base_model_name_or_path)",
                    "set base_model_name_or_path in its adapter_config.json to the base's local directory");
  std::error_code ec;
  if (!std::filesystem::exists(adapter.base_path, ec)) {
    // "meta-llama/Llama-3.1-8B": one slash, no ./ or / in front: a name on the Hugging Face Hub, not a path.
    const std::string& b = adapter.base_path;
    const bool hub_id = std::count(b.begin(), b.end(), '/') == 1 && b.front() != '/' && b.front() != '.' && b.back() != '/';
    if (hub_id)
      throw UserError("the adapter '" + adapter.path() + "' names its base '" + b + "', which is no directory here: a Hugging Face "
                          "Hub id? ds never downloads",
                      "download it first (huggingface-cli download " + b + " --local-dir DIR), then set base_model_name_or_path in "
                      "its adapter_config.json to DIR");
    throw UserError("the adapter '" + adapter.path() + "' names its base '" + b + "', which does not exist",
                    "set base_model_name_or_path in its adapter_config.json to the base's directory (relative paths are read "
                    "from the adapter's directory, then the working directory)");
  }
  return open_weights(adapter.base_path);
}

}  // namespace ds
