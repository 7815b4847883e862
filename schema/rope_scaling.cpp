#include "schema/rope_scaling.hpp"

#include <algorithm>
#include <cmath>
#include <set>

namespace ds {

RopeScaling read_rope_scaling(const nlohmann::json& j, const std::string& key, const std::string& where, std::vector<ConfigIssue>& errors) {
  RopeScaling r;
  if (j.is_null()) return r;
  const auto fail = [&](const std::string& what) {
    errors.push_back({key, where + "rope_scaling " + what, "ds computes rope_type default, linear, dynamic, llama3, yarn and longrope as Hugging Face does"});
    return RopeScaling{};
  };
  if (!j.is_object()) return fail("is " + j.dump() + ", not an object");
  // "type" is the older spelling of "rope_type".
  const nlohmann::json* type = j.contains("rope_type") ? &j["rope_type"] : j.contains("type") ? &j["type"] : nullptr;
  if (!type || !type->is_string()) return fail("has no rope_type");
  const std::string t = type->get<std::string>();
  std::set<std::string> allowed = {"rope_type", "type"};
  if (t == "default") {
  } else if (t == "linear" || t == "dynamic") {
    r.type = t == "linear" ? RopeType::linear : RopeType::dynamic;
    allowed.insert("factor");
  } else if (t == "llama3") {
    r.type = RopeType::llama3;
    allowed.insert({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  } else if (t == "yarn") {
    r.type = RopeType::yarn;
    allowed.insert({"factor", "attention_factor", "beta_fast", "beta_slow"});
  } else if (t == "longrope" || t == "su") {  // "su": longrope's first name
    r.type = RopeType::longrope;
    allowed.insert({"short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"});
  } else {
    return fail("of type \"" + t + "\" is not computed by ds");
  }
  for (const auto& [k, v] : j.items())
    if (!allowed.count(k)) return fail("key '" + k + "' (with rope_type " + t + ") is not one ds acts on");
  const auto number = [&](const char* k, double least, bool required) -> std::optional<double> {
    if (!j.contains(k) || j[k].is_null()) {
      if (required) fail("of type " + t + " needs " + k);
      return std::nullopt;
    }
    if (!j[k].is_number() || !std::isfinite(j[k].get<double>()) || j[k].get<double>() < least) {
      fail(std::string(k) + " is " + j[k].dump() + ", not a number of at least " + std::to_string(least).substr(0, 3));
      return std::nullopt;
    }
    return j[k].get<double>();
  };
  if (r.type == RopeType::none) return r;
  if (r.type == RopeType::longrope) {
    // The lists' length (head_dim / 2) is checked against the model once it is resolved; the original
    // context may be config.json's top-level key instead (Phi-3).
    for (const auto& [k, out] : {std::pair<const char*, std::vector<double>*>{"short_factor", &r.short_factor}, {"long_factor", &r.long_factor}}) {
      const bool ok = j.contains(k) && j[k].is_array() && !j[k].empty() && j[k].size() <= 65536 &&
                      std::all_of(j[k].begin(), j[k].end(), [](const nlohmann::json& v) { return v.is_number() && v.get<double>() > 0 && std::isfinite(v.get<double>()); });
      if (!ok) return fail(std::string("of type longrope needs ") + k + ": a list of positive numbers, one per pair of a head's dimensions");
      *out = j[k].get<std::vector<double>>();
    }
    r.attention_factor = number("attention_factor", 0.0, false);
    if (const auto v = number("original_max_position_embeddings", 1.0, false)) r.original_max_position_embeddings = static_cast<int64_t>(*v);
    return r;
  }
  if (const auto f = number("factor", 1.0, true)) r.factor = *f;
  if (r.type == RopeType::llama3) {
    if (const auto v = number("low_freq_factor", 0.0, true)) r.low_freq_factor = *v;
    if (const auto v = number("high_freq_factor", 0.0, true)) r.high_freq_factor = *v;
    if (const auto v = number("original_max_position_embeddings", 1.0, true)) r.original_max_position_embeddings = static_cast<int64_t>(*v);
    if (!(r.high_freq_factor > r.low_freq_factor)) fail("high_freq_factor must be greater than low_freq_factor");
  }
  if (r.type == RopeType::yarn) {
    r.attention_factor = number("attention_factor", 0.0, false);
    r.beta_fast = number("beta_fast", 0.0, false);
    r.beta_slow = number("beta_slow", 0.0, false);
  }
  return r;
}

nlohmann::json rope_scaling_json(const RopeScaling& r) {
  if (r.type == RopeType::none) return nullptr;
  if (r.type == RopeType::longrope) {
    nlohmann::json j{{"rope_type", "longrope"}, {"short_factor", r.short_factor}, {"long_factor", r.long_factor}};
    if (r.attention_factor) j["attention_factor"] = *r.attention_factor;
    if (r.original_max_position_embeddings > 0) j["original_max_position_embeddings"] = r.original_max_position_embeddings;
    return j;
  }
  nlohmann::json j{{"rope_type", rope_type_name(r.type)}, {"factor", r.factor}};
  if (r.type == RopeType::llama3) {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
    j["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  if (r.type == RopeType::yarn) {
    if (r.attention_factor) j["attention_factor"] = *r.attention_factor;
    if (r.beta_fast) j["beta_fast"] = *r.beta_fast;
    if (r.beta_slow) j["beta_slow"] = *r.beta_slow;
  }
  return j;
}

}  // namespace ds
