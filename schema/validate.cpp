// Schema validation with valijson, rendered for people. valijson decides what is valid; this file
// turns its findings into one sentence per JSON path: what was expected (described from the schema),
// what was found, and for unknown keys the nearest known key -- at the same level, or elsewhere in
// the schema ("stage" at the top level -> zero_optimization.stage).
#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <valijson/adapters/nlohmann_json_adapter.hpp>
#include <valijson/schema.hpp>
#include <valijson/schema_parser.hpp>
#include <valijson/validation_results.hpp>
#include <valijson/validator.hpp>

#include "common/did_you_mean.hpp"
#include "common/strings.hpp"
#include "schema/loader_internal.hpp"

namespace ds::loader {
namespace {

const valijson::Schema& compiled_schema() {
  static const valijson::Schema* schema = [] {
    auto* s = new valijson::Schema;
    valijson::SchemaParser parser;
    valijson::adapters::NlohmannJsonAdapter adapter(config_schema());
    parser.populateSchema(adapter, *s);
    return s;
  }();
  return *schema;
}

// valijson context ["<root>", "[zero_optimization]", "[stage]"] -> {"zero_optimization", "stage"};
// array indices stay as "[0]".
std::vector<std::string> context_to_path(const std::vector<std::string>& ctx, const json& doc) {
  std::vector<std::string> out;
  const json* cur = &doc;
  for (const auto& c : ctx) {
    if (c == "<root>") continue;
    std::string inner = c.size() >= 2 && c.front() == '[' && c.back() == ']' ? c.substr(1, c.size() - 2) : c;
    if (cur && cur->is_array()) {
      out.push_back("[" + inner + "]");
      size_t i = std::stoul(inner);
      cur = i < cur->size() ? &(*cur)[i] : nullptr;
    } else {
      out.push_back(inner);
      cur = cur && cur->is_object() && cur->contains(inner) ? &(*cur)[inner] : nullptr;
    }
  }
  return out;
}

const json* value_at(const json& doc, const std::vector<std::string>& path) {
  const json* cur = &doc;
  for (const auto& seg : path) {
    if (!cur) return nullptr;
    if (!seg.empty() && seg.front() == '[') {
      size_t i = std::stoul(seg.substr(1, seg.size() - 2));
      cur = cur->is_array() && i < cur->size() ? &(*cur)[i] : nullptr;
    } else {
      cur = cur->is_object() && cur->contains(seg) ? &(*cur)[seg] : nullptr;
    }
  }
  return cur;
}

std::string shown(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

bool is_summary(const std::string& d) {
  static const char* summaries[] = {"Failed to validate against schema associated with property name",
                                    "Failed to validate item #",
                                    "Failed to validate against child schema",
                                    "Failed to validate against any schemas allowed by anyOf",
                                    "Failed to validate against additional properties schema",
                                    "Failed to validate against 'then' subschema",
                                    "Failed to validate against 'else' subschema",
                                    "Failed to validate against any child schemas allowed by oneOf",
                                    "Failed to validate against all child schemas allowed by allOf"};
  for (const char* s : summaries)
    if (d.rfind(s, 0) == 0) return true;
  return false;
}

}  // namespace

std::string suggest_key(const std::vector<std::string>& parent, const std::string& key, const json& doc) {
  SchemaWalk walk(config_schema());
  std::vector<std::string> here;
  if (const json* node = walk.at(parent, doc)) {
    const json* v = value_at(doc, parent);
    for (const auto& [k, sub] : walk.properties(*node, v))
      if (!walk.annotation(*sub, "x-ds-alias-of")) here.push_back(k);
  }
  std::string m = closest_match(key, here);
  if (!m.empty()) return "; did you mean '" + m + "'?";
  // The same (or a close) key elsewhere: "stage" at the top level is zero_optimization.stage. The
  // schema never changes, so its key paths are listed once.
  static const auto [full, leaf] = [&] {
    std::vector<std::string> f, l;
    for (const auto& p : walk.all_key_paths()) {
      f.push_back(path_to_string(p));
      l.push_back(p.back());
    }
    return std::pair{f, l};
  }();
  std::vector<std::string> self_path = parent;
  self_path.push_back(key);
  const std::string self = path_to_string(self_path);
  for (size_t i = 0; i < leaf.size(); ++i)
    if (leaf[i] == key && full[i] == self)  // known here, but for another "type" of this block
      return "; it is a parameter of another type (the block's \"type\" decides which parameters it takes)";
  for (size_t i = 0; i < leaf.size(); ++i)
    if (leaf[i] == key) return "; did you mean '" + full[i] + "'?";
  std::string near = closest_match(key, leaf);
  if (!near.empty())
    for (size_t i = 0; i < leaf.size(); ++i)
      if (leaf[i] == near) return "; did you mean '" + full[i] + "'?";
  // Nothing near: inside a block, what the block does take (the top level's list is the man page's job).
  if (!parent.empty() && !here.empty() && here.size() <= 24) return "; " + path_to_string(parent) + " takes " + join(here, ", ");
  return "";
}

// Every key the schema does not know, with a did-you-mean. (valijson reports only the first unknown
// key of each object, so this walk finds them all.)
static void find_unknown_keys(const SchemaWalk& walk, const json& node, const json& value, std::vector<std::string>& path,
                              const json& doc, std::vector<ConfigIssue>& errors) {
  if (value.is_object()) {
    for (const auto& [key, v] : value.items()) {
      const json* sub = walk.child(node, key, &value);
      if (!sub) {
        std::string hint;
        if (const json* rejected = walk.annotation(node, "x-ds-rejected"))
          if (rejected->contains(key)) hint = (*rejected)[key].get<std::string>();
        std::vector<std::string> full = path;
        full.push_back(key);
        // Suggestions cost a search of every key; past a hundred problems nobody reads them.
        const bool suggest = hint.empty() && errors.size() < 100;
        errors.push_back({path_to_string(full), "unknown key '" + key + "'" + (suggest ? suggest_key(path, key, doc) : ""), hint});
        continue;
      }
      const json* ignored = walk.annotation(*sub, "x-ds-ignored");
      if (ignored && *ignored == true) continue;  // DeepSpeed owns what goes inside an ignored block
      path.push_back(key);
      find_unknown_keys(walk, *sub, v, path, doc, errors);
      path.pop_back();
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      const std::string seg = "[" + std::to_string(i) + "]";
      const json* sub = walk.child(node, seg, &value);
      if (!sub) continue;
      path.push_back(seg);
      find_unknown_keys(walk, *sub, value[i], path, doc, errors);
      path.pop_back();
    }
  }
}

static bool is_strict_prefix(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  return a.size() < b.size() && std::equal(a.begin(), a.end(), b.begin());
}

void validate_against_schema(const json& doc, std::vector<ConfigIssue>& errors) {
  SchemaWalk walk(config_schema());
  std::vector<std::string> root;
  const size_t before = errors.size();
  find_unknown_keys(walk, config_schema(), doc, root, doc, errors);

  valijson::Validator validator;
  valijson::ValidationResults results;
  valijson::adapters::NlohmannJsonAdapter adapter(doc);
  if (validator.validate(compiled_schema(), adapter, &results)) return;

  std::vector<std::pair<std::vector<std::string>, std::string>> leaves;
  valijson::ValidationResults::Error e;
  while (results.popError(e)) {
    if (is_summary(e.description) || e.description.rfind("Object contains a property", 0) == 0) continue;
    leaves.emplace_back(context_to_path(e.context, doc), e.description);
  }
  // Unknown keys make their parents fail too, and a parent's failure adds nothing to a deeper message.
  std::set<std::string> reported;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const auto& [path, desc] = leaves[i];
    bool deeper_exists = false;
    for (size_t j = 0; j < leaves.size() && !deeper_exists; ++j) deeper_exists = is_strict_prefix(path, leaves[j].first);
    if (deeper_exists) continue;
    const std::string p = path_to_string(path);
    if (!reported.insert(p).second) continue;  // one message per path
    const json* node = walk.at(path, doc);
    const json* value = value_at(doc, path);
    // An object failing only because of unknown keys inside it (already reported) needs no message.
    if (value && value->is_object() && errors.size() > before) {
      bool has_unknown_inside = false;
      for (size_t k = before; k < errors.size(); ++k)
        if (p == "(top level)" || errors[k].path.rfind(p + ".", 0) == 0) has_unknown_inside = true;
      if (has_unknown_inside) continue;
    }
    std::string expected = node ? walk.describe(*node) : "";
    std::string msg = expected.empty() ? desc : "expected " + expected + ", found " + (value ? shown(*value) : "nothing");
    if (desc.rfind("Missing required property", 0) == 0) msg = desc;
    std::string hint;
    if (node && value && value->is_string()) {
      std::vector<std::string> options;
      std::function<void(const json&)> gather = [&](const json& n) {
        const json& rn = walk.resolve(n);
        if (rn.contains("enum"))
          for (const auto& o : rn["enum"])
            if (o.is_string()) options.push_back(o.get<std::string>());
        for (const char* comb : {"anyOf", "oneOf"})
          if (rn.contains(comb))
            for (const auto& b : rn[comb]) gather(b);
      };
      gather(*node);
      std::string m = closest_match(value->get<std::string>(), options);
      if (!m.empty()) hint = "did you mean \"" + m + "\"?";
    }
    errors.push_back({p, msg, hint});
  }
  if (errors.size() == before)  // nothing rendered: show valijson's own words rather than nothing
    for (const auto& [path, desc] : leaves) errors.push_back({path_to_string(path), desc, ""});
}

void check_inert_keys(const json& doc, std::vector<ConfigIssue>& errors, std::vector<ConfigIssue>& warnings) {
  SchemaWalk walk(config_schema());
  std::function<void(const json&, const json&, std::vector<std::string>&)> visit =
      [&](const json& node, const json& value, std::vector<std::string>& path) {
        if (!value.is_object()) return;
        for (const auto& [key, v] : value.items()) {
          const json* sub = walk.child(node, key, &value);
          if (!sub) continue;
          path.push_back(key);
          const json& r = walk.resolve(*sub);
          const json* dflt = sub->contains("default") ? &(*sub)["default"] : (r.contains("default") ? &r["default"] : nullptr);
          // The default, "auto" (which means the default for these keys), or a block switched off.
          const bool harmless = (dflt && *dflt == v) || v == "auto" || (v.is_object() && v.contains("enabled") && v["enabled"] == false);
          std::string what = sub->value("description", r.value("description", std::string()));
          if (const json* refused = walk.annotation(*sub, "x-ds-refused"); refused && refused->is_string() && !v.is_null()) {
            errors.push_back({path_to_string(path), "ds does not support this key yet" + (what.empty() ? "" : " (" + what + ")"),
                              refused->get<std::string>()});
          } else if (const json* ign = walk.annotation(*sub, "x-ds-ignored"); ign && *ign == true) {
            if (!harmless) {
              const json* why = walk.annotation(*sub, "x-ds-why");
              warnings.push_back({path_to_string(path),
                                  "ignored: ds does not act on this key" + (what.empty() ? "" : " (" + what + ")"),
                                  why && why->is_string() ? why->get<std::string>() : ""});
            }
          } else {
            visit(*sub, v, path);
          }
          path.pop_back();
        }
      };
  std::vector<std::string> path;
  visit(config_schema(), doc, path);
}

}  // namespace ds::loader
