#include "schema/schema_walk.hpp"

#include <algorithm>
#include <set>

#include "common/error.hpp"
#include "common/format.hpp"

namespace ds {

extern const char* const kConfigSchemaJson;  // generated from ds_config.schema.json at build time

const std::string& config_schema_text() {
  static const std::string text(kConfigSchemaJson);
  return text;
}

const json& config_schema() {
  static const json schema = json::parse(config_schema_text());
  return schema;
}

std::string path_to_string(const std::vector<std::string>& path) {
  std::string out;
  for (const auto& seg : path) {
    if (!seg.empty() && seg.front() == '[') {
      out += seg;
    } else {
      if (!out.empty()) out += '.';
      out += seg;
    }
  }
  return out.empty() ? "(top level)" : out;
}

const json& SchemaWalk::resolve(const json& node) const {
  const json* n = &node;
  for (int hops = 0; n->is_object() && n->contains("$ref") && hops < 16; ++hops) {
    const std::string ref = (*n)["$ref"].get<std::string>();
    DS_CHECK(ref.rfind("#", 0) == 0, "only local $ref are supported: ", ref);
    n = &root_.at(json::json_pointer(ref.substr(1)));
  }
  return *n;
}

bool SchemaWalk::condition_holds(const json& cond, const json* value) const {
  if (!value || !value->is_object()) return false;
  if (cond.contains("required"))
    for (const auto& k : cond["required"])
      if (!value->contains(k.get<std::string>())) return false;
  if (cond.contains("properties"))
    for (const auto& [k, sub] : cond["properties"].items()) {
      if (!value->contains(k)) continue;
      const json& v = (*value)[k];
      if (sub.contains("const") && v != sub["const"]) return false;
      if (sub.contains("enum") && std::find(sub["enum"].begin(), sub["enum"].end(), v) == sub["enum"].end()) return false;
    }
  return true;
}

std::map<std::string, const json*> SchemaWalk::properties(const json& node_in, const json* value) const {
  std::map<std::string, const json*> out;
  const json& node = resolve(node_in);
  if (!node.is_object()) return out;
  if (node.contains("properties"))
    for (const auto& [k, sub] : node["properties"].items()) out[k] = &sub;
  for (const char* comb : {"anyOf", "oneOf"})
    if (node.contains(comb))
      for (const auto& branch : node[comb]) {
        const json& b = resolve(branch);
        if (b.contains("properties"))
          for (auto& [k, p] : properties(b, value)) out.emplace(k, p);
      }
  if (node.contains("allOf"))
    for (const auto& entry : node["allOf"]) {
      if (entry.contains("if")) {
        if (condition_holds(entry["if"], value) && entry.contains("then"))
          for (auto& [k, p] : properties(entry["then"], value)) out[k] = p;  // then-branch refines
      } else {
        for (auto& [k, p] : properties(entry, value)) out.emplace(k, p);
      }
    }
  return out;
}

const json* SchemaWalk::child(const json& node_in, const std::string& key, const json* value) const {
  const json& node = resolve(node_in);
  if (!key.empty() && key.front() == '[') {
    if (node.contains("items")) return &node["items"];
    for (const char* comb : {"anyOf", "oneOf"})
      if (node.contains(comb))
        for (const auto& b : node[comb])
          if (resolve(b).contains("items")) return &resolve(b)["items"];
    return nullptr;
  }
  static const json any = json::object();
  if (node.is_object() && node.empty()) return &any;  // {} accepts anything
  auto props = properties(node, value);
  auto it = props.find(key);
  if (it != props.end()) return it->second;
  // An object that accepts any key (e.g. an ignored DeepSpeed block) has no additionalProperties: false.
  auto accepts_any = [&](const json& n) {
    return n.value("type", json()) == "object" && !(n.contains("additionalProperties") && n["additionalProperties"] == false);
  };
  if (accepts_any(node)) {
    return node.contains("additionalProperties") && node["additionalProperties"].is_object() ? &node["additionalProperties"]
                                                                                              : &any;
  }
  return nullptr;
}

const json* SchemaWalk::at(const std::vector<std::string>& path, const json& doc) const {
  const json* node = &root_;
  const json* value = &doc;
  for (const auto& seg : path) {
    node = child(*node, seg, value);
    if (!node) return nullptr;
    if (value && value->is_object() && value->contains(seg))
      value = &(*value)[seg];
    else if (value && value->is_array() && seg.size() > 2 && seg.front() == '[') {
      size_t i = std::stoul(seg.substr(1, seg.size() - 2));
      value = i < value->size() ? &(*value)[i] : nullptr;
    } else
      value = nullptr;
  }
  return node;
}

const json* SchemaWalk::annotation(const json& node, const char* name) const {
  if (node.is_object() && node.contains(name)) return &node[name];
  const json& r = resolve(node);
  if (r.is_object() && r.contains(name)) return &r[name];
  return nullptr;
}

std::string SchemaWalk::describe(const json& node_in) const {
  const json& node = resolve(node_in);
  if (!node.is_object()) return "anything";
  for (const char* comb : {"anyOf", "oneOf"})
    if (node.contains(comb)) {
      std::vector<std::string> parts;
      for (const auto& b : node[comb]) parts.push_back(describe(b));
      std::string out;
      for (size_t i = 0; i < parts.size(); ++i) out += (i ? (i + 1 == parts.size() ? " or " : ", ") : "") + parts[i];
      return out;
    }
  if (node.contains("const")) return node["const"].dump();
  if (node.contains("enum")) {
    std::string out = "one of ";
    bool first = true;
    for (const auto& v : node["enum"]) {
      out += (first ? "" : ", ") + v.dump();
      first = false;
    }
    return out;
  }
  std::vector<std::string> types;
  if (node.contains("type")) {
    if (node["type"].is_array())
      for (const auto& t : node["type"]) types.push_back(t.get<std::string>());
    else
      types.push_back(node["type"].get<std::string>());
  }
  std::string out;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    std::string d;
    if (t == "integer" || t == "number") {
      d = t == "integer" ? "an integer" : "a number";
      if (node.contains("minimum")) d += " >= " + format_double(node["minimum"].get<double>());
      if (node.contains("exclusiveMinimum")) d += " > " + format_double(node["exclusiveMinimum"].get<double>());
      if (node.contains("maximum")) d += (d.find(">") != std::string::npos ? " and <= " : " <= ") + format_double(node["maximum"].get<double>());
      if (node.contains("exclusiveMaximum")) d += (d.find(">") != std::string::npos ? " and < " : " < ") + format_double(node["exclusiveMaximum"].get<double>());
    } else if (t == "boolean") {
      d = "true or false";
    } else if (t == "string") {
      d = node.contains("minLength") ? "a non-empty string" : "a string";
    } else if (t == "object") {
      d = "an object";
    } else if (t == "array") {
      d = "an array";
      if (node.contains("minItems") && node.contains("maxItems") && node["minItems"] == node["maxItems"])
        d += " of " + node["minItems"].dump() + " items";
      if (node.contains("items")) d += (d == "an array" ? " whose items are " : ", each ") + describe(node["items"]);
    } else if (t == "null") {
      d = "null";
    } else {
      d = t;
    }
    out += (i ? (i + 1 == types.size() ? " or " : ", ") : "") + d;
  }
  return out.empty() ? "anything" : out;
}

void SchemaWalk::fill_defaults(const json& node_in, json& value, std::vector<std::string>& path,
                               std::vector<std::string>* filled) const {
  if (!value.is_object()) return;
  const json& node = resolve(node_in);
  // Two passes: defaults of this level first (a filled "type" can select an if/then branch).
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [key, sub_raw] : properties(node, &value)) {
      const json& sub = *sub_raw;
      if (annotation(sub, "x-ds-alias-of") || annotation(sub, "x-ds-deprecated")) continue;
      path.push_back(key);
      if (!value.contains(key)) {
        const json* dflt = sub.contains("default") ? &sub["default"] : (resolve(sub).contains("default") ? &resolve(sub)["default"] : nullptr);
        if (dflt) {
          value[key] = *dflt;
          if (filled) filled->push_back(path_to_string(path));
        }
      }
      if (pass == 1 && value.contains(key) && value[key].is_object()) fill_defaults(sub, value[key], path, filled);
      path.pop_back();
    }
  }
}

void SchemaWalk::collect_paths(const json& node_in, std::vector<std::string>& prefix,
                               std::vector<std::vector<std::string>>& out, int depth) const {
  if (depth > 6) return;
  const json& node = resolve(node_in);
  std::set<std::string> seen;
  auto visit = [&](const std::string& key, const json& sub) {
    if (!seen.insert(key).second) return;
    prefix.push_back(key);
    out.push_back(prefix);
    collect_paths(sub, prefix, out, depth + 1);
    prefix.pop_back();
  };
  for (auto& [k, p] : properties(node, nullptr)) visit(k, *p);
  if (node.contains("allOf"))  // every then-branch, whatever the document says
    for (const auto& entry : node["allOf"])
      if (entry.contains("then"))
        for (auto& [k, p] : properties(entry["then"], nullptr)) {
          if (k == "params") {  // merge the per-type parameter names under one "params"
            prefix.push_back(k);
            for (auto& [pk, pp] : properties(*p, nullptr)) {
              prefix.push_back(pk);
              out.push_back(prefix);
              prefix.pop_back();
            }
            prefix.pop_back();
          }
        }
}

std::vector<std::vector<std::string>> SchemaWalk::all_key_paths() const {
  std::vector<std::vector<std::string>> out;
  std::vector<std::string> prefix;
  collect_paths(root_, prefix, out, 0);
  return out;
}

}  // namespace ds
