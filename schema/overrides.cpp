// Command-line overrides: `key.sub=value` sets any key the schema knows (creating parent objects),
// `~key.sub` removes one. The split is at the first '=' so values may contain '='. The value is read
// as JSON (numbers, true/false, null, arrays, objects, quoted strings) and otherwise taken as a
// string, so `optimizer.type=AdamW` needs no quotes. Array elements are addressed by index:
// `optimizer.params.betas.0=0.95`.
#include <algorithm>
#include <cctype>
#include <optional>

#include "schema/loader_internal.hpp"

namespace ds::loader {
namespace {

bool is_index(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> segs;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    segs.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return segs;
}

// JSON strings must be UTF-8; a value that is not cannot be stored or printed.
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (n < 0 || i + n >= s.size()) return false;
    for (int k = 1; k <= n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    i += n + 1;
  }
  return true;
}

// One override, split: `~key` removes, `key=value` sets (the value read as JSON, else taken as a string).
struct Override {
  bool remove = false;
  std::string key;
  json value;
};

// The override's key and value, or nothing (an error recorded) when it is malformed.
std::optional<Override> parse_override(const std::string& arg, std::vector<ConfigIssue>& errors) {
  Override o;
  o.remove = !arg.empty() && arg[0] == '~';
  const size_t eq = arg.find('=');
  o.key = o.remove ? arg.substr(1, eq == std::string::npos ? std::string::npos : eq - 1) : arg.substr(0, eq);
  if (!o.remove && eq == std::string::npos) {
    errors.push_back({"", "override '" + arg + "' has no '='", "write key.sub=value to set, or ~key.sub to remove"});
    return std::nullopt;
  }
  const std::string& key = o.key;
  if (key.empty() || key.front() == '.' || key.back() == '.' || key.find("..") != std::string::npos) {
    errors.push_back({"", "override '" + arg + "' has an empty key segment", "write e.g. zero_optimization.stage=3"});
    return std::nullopt;
  }
  if (!valid_utf8(arg)) {
    errors.push_back({"", "override '" + key + "...' is not valid UTF-8 text", "check the shell's quoting and encoding"});
    return std::nullopt;
  }
  if (!o.remove) {
    const std::string text = arg.substr(eq + 1);
    check_nesting(text, "override '" + key + "'");
    try {
      o.value = json::parse(text);
    } catch (const json::exception&) {
      o.value = text;  // not JSON (or a number beyond a double, 1e999): a bare string, which validation names
    }
  }
  return o;
}

// Walks the schema and the document together along the key, creating objects on the way when setting.
void apply_override(json& doc, const SchemaWalk& walk, const Override& o, const std::string& arg, std::vector<ConfigIssue>& errors,
                    std::vector<std::string>& overridden) {
  const bool remove = o.remove;
  const std::string& key = o.key;
  const json& value = o.value;
  const std::vector<std::string> segs = split_path(key);
  const json* node = &config_schema();
  json* cur = &doc;
  std::vector<std::string> done;
  for (size_t i = 0; i < segs.size(); ++i) {
    const std::string& seg = segs[i];
    const bool last = i + 1 == segs.size();
    if (cur->is_array() && is_index(seg)) {
      const size_t idx = seg.size() > 9 ? cur->size() : std::stoul(seg);  // a longer index is past any config array
      node = walk.child(*node, "[" + seg + "]", cur);
      if (idx >= cur->size()) {
        errors.push_back({path_to_string(done), "index " + seg + " is past the end of the array (" +
                                                    std::to_string(cur->size()) + " elements)",
                          "set the whole array instead, e.g. " + key.substr(0, key.rfind('.')) + "=[...]"});
        return;
      }
      done.push_back("[" + seg + "]");
      if (last) {
        if (remove) cur->erase(idx); else (*cur)[idx] = value;
      } else {
        cur = &(*cur)[idx];
      }
      continue;
    }
    const json* sub = node ? walk.child(*node, seg, cur->is_object() ? cur : nullptr) : nullptr;
    static const json any = json::object();
    if (!sub && remove && cur->is_object() && cur->contains(seg)) sub = &any;  // removing needs no schema
    if (!sub) {
      std::string hint = suggest_key(done, seg, doc);
      errors.push_back({path_to_string(done) == "(top level)" ? seg : path_to_string(done) + "." + seg,
                        "unknown key in override '" + arg + "'" + hint, "overrides may only name keys the schema knows"});
      return;
    }
    done.push_back(seg);
    if (!cur->is_object()) {
      if (cur->is_null() && !remove) {
        *cur = json::object();
      } else {
        errors.push_back({path_to_string(done), "cannot descend into '" + path_to_string({done.begin(), done.end() - 1}) +
                                                    "': it is " + std::string(cur->type_name()) + ", not an object",
                          "set the parent as an object first"});
        return;
      }
    }
    if (last) {
      if (remove) {
        if (!cur->contains(seg))
          errors.push_back({path_to_string(done), "override '" + arg + "' removes a key the config does not have",
                            "check the spelling; `ds plan` shows the resolved config"});
        else
          cur->erase(seg);
      } else {
        (*cur)[seg] = value;
        overridden.push_back(path_to_string(done));
      }
    } else {
      if (!cur->contains(seg)) {
        if (remove) {
          errors.push_back({path_to_string(done), "override '" + arg + "' removes a key the config does not have", ""});
          return;
        }
        (*cur)[seg] = json::object();
      }
      cur = &(*cur)[seg];
      node = sub;
    }
  }
}

}  // namespace

void apply_overrides(json& doc, const std::vector<std::string>& overrides, std::vector<ConfigIssue>& errors,
                     std::vector<std::string>& overridden) {
  SchemaWalk walk(config_schema());
  for (const std::string& arg : overrides)
    if (const std::optional<Override> o = parse_override(arg, errors)) apply_override(doc, walk, *o, arg, errors, overridden);
}

}  // namespace ds::loader
