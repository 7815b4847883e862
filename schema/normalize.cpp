// Legacy DeepSpeed spellings rewritten to the canonical keys, so that everything after this step
// sees one spelling. Deprecated forms warn (as DeepSpeed does); aliases (two current spellings of one
// key, e.g. prefetch_bucket_size / stage3_prefetch_bucket_size) are rewritten silently. Giving both
// spellings is an error, as in DeepSpeed.
#include <algorithm>
#include <cctype>

#include "schema/loader_internal.hpp"

namespace ds::loader {
namespace {

void deprecated(std::vector<ConfigIssue>& warnings, const std::string& old_path, const std::string& new_path) {
  warnings.push_back({old_path, "deprecated spelling; read as " + new_path, "write " + new_path + " instead"});
}

// Moves doc[from] to doc[to] (both keys of the same object).
void rename_key(json& obj, const std::string& prefix, const std::string& from, const std::string& to, bool warn,
                std::vector<ConfigIssue>& errors, std::vector<ConfigIssue>& warnings) {
  if (!obj.is_object() || !obj.contains(from)) return;
  if (obj.contains(to)) {
    errors.push_back({prefix + from, "both '" + from + "' and '" + to + "' are given; they are the same setting",
                      "keep only " + prefix + to});
    obj.erase(from);  // reported once, even though normalisation runs again after the overrides
    return;
  }
  obj[to] = obj[from];
  obj.erase(from);
  if (warn) deprecated(warnings, prefix + from, prefix + to);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

void normalize_legacy(json& doc, std::vector<ConfigIssue>& errors, std::vector<ConfigIssue>& warnings) {
  if (!doc.is_object()) return;
  rename_key(doc, "", "bfloat16", "bf16", true, errors, warnings);

  // "zero_optimization": true/false (DeepSpeed's oldest form) means stage 1/0.
  if (doc.contains("zero_optimization") && doc["zero_optimization"].is_boolean()) {
    const bool on = doc["zero_optimization"].get<bool>();
    doc["zero_optimization"] = json{{"stage", on ? 1 : 0}};
    warnings.push_back({"zero_optimization", std::string("deprecated boolean form; read as {\"stage\": ") + (on ? "1" : "0") + "}",
                        "write \"zero_optimization\": {\"stage\": " + std::string(on ? "1" : "0") + "}"});
  }
  if (doc.contains("allgather_size")) {
    if (!doc.contains("zero_optimization") || !doc["zero_optimization"].is_object()) doc["zero_optimization"] = json::object();
    json& z = doc["zero_optimization"];
    if (!z.contains("allgather_bucket_size")) z["allgather_bucket_size"] = doc["allgather_size"];
    doc.erase("allgather_size");
    deprecated(warnings, "allgather_size", "zero_optimization.allgather_bucket_size");
  }

  if (doc.contains("zero_optimization") && doc["zero_optimization"].is_object()) {
    json& z = doc["zero_optimization"];
    const std::string zp = "zero_optimization.";
    // Aliases: the schema lists them with x-ds-alias-of.
    SchemaWalk walk(config_schema());
    const json& zero_schema = walk.resolve(config_schema()["$defs"]["zero"]);
    for (const auto& [key, sub] : zero_schema["properties"].items())
      if (sub.contains("x-ds-alias-of")) rename_key(z, zp, key, sub["x-ds-alias-of"].get<std::string>(), false, errors, warnings);
    rename_key(z, zp, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", true, errors,
               warnings);
    auto legacy_offload = [&](const char* old_key, const char* block) {
      if (!z.contains(old_key)) return;
      const json v = z[old_key];
      z.erase(old_key);
      deprecated(warnings, zp + old_key, zp + block + ".device");
      if (!v.is_boolean()) {
        errors.push_back({zp + old_key, "expected true or false, found " + v.dump(), ""});
        return;
      }
      if (!v.get<bool>()) return;
      if (z.contains(block) && z[block].is_object() && z[block].contains("device")) {
        errors.push_back({zp + old_key, std::string("both '") + old_key + "' and '" + block + "' are given",
                          std::string("keep only ") + zp + block});
        return;
      }
      if (!z.contains(block) || !z[block].is_object()) z[block] = json::object();
      z[block]["device"] = "cpu";
    };
    legacy_offload("cpu_offload", "offload_optimizer");
    legacy_offload("cpu_offload_param", "offload_param");
    if (z.contains("cpu_offload_use_pin_memory")) {
      const json v = z["cpu_offload_use_pin_memory"];
      z.erase("cpu_offload_use_pin_memory");
      deprecated(warnings, zp + "cpu_offload_use_pin_memory", zp + "offload_optimizer.pin_memory");
      for (const char* block : {"offload_optimizer", "offload_param"})
        if (z.contains(block) && z[block].is_object() && !z[block].contains("pin_memory")) z[block]["pin_memory"] = v;
    }
  }
  // model.lora in PEFT's own spellings (LoraConfig's lora_alpha, lora_dropout): the schema lists them as aliases.
  if (doc.contains("model") && doc["model"].is_object() && doc["model"].contains("lora") && doc["model"]["lora"].is_object()) {
    SchemaWalk walk(config_schema());
    const json& lora_schema = walk.resolve(config_schema()["properties"]["model"])["properties"]["lora"];
    for (const auto& [key, sub] : lora_schema["properties"].items())
      if (sub.contains("x-ds-alias-of")) rename_key(doc["model"]["lora"], "model.lora.", key, sub["x-ds-alias-of"].get<std::string>(), false, errors, warnings);
  }
  if (doc.contains("aio") && doc["aio"].is_object())
    rename_key(doc["aio"], "aio.", "thread_count", "intra_op_parallelism", true, errors, warnings);

  // optimizer.type is matched case-insensitively, as DeepSpeed lower-cases it.
  if (doc.contains("optimizer") && doc["optimizer"].is_object() && doc["optimizer"].contains("type") &&
      doc["optimizer"]["type"].is_string()) {
    json& t = doc["optimizer"]["type"];
    const std::string l = lower(t.get<std::string>());
    static const std::vector<std::pair<std::string, std::string>> canonical = {
        {"adam", "Adam"}, {"adamw", "AdamW"}, {"sgd", "SGD"}, {"lamb", "Lamb"}};
    for (const auto& [low, name] : canonical)
      if (l == low) t = name;
    static const std::vector<std::string> deepspeed_only = {"onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion",
                                                            "muadam", "muadamw", "musgd", "muon", "rmsprop", "adamax"};
    if (std::find(deepspeed_only.begin(), deepspeed_only.end(), l) != deepspeed_only.end())
      errors.push_back({"optimizer.type", "ds does not implement the " + t.get<std::string>() + " optimizer",
                        "use Adam, AdamW, SGD or Lamb"});
  }
}

}  // namespace ds::loader
