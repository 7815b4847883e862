// load_config: the steps in order. Each step collects problems instead of stopping at the first, so
// one run of `ds plan` lists everything wrong with a config.
//   parse -> rewrite legacy spellings -> apply overrides -> rewrite again (overrides may use old
//   names) -> model.init_from's keys -> fill defaults -> validate -> replace "auto" that means "the default" -> typed read.
#include "schema/loader.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "schema/loader_internal.hpp"

namespace ds {
namespace {

using namespace loader;

void record_leaves(const json& v, std::vector<std::string>& path, std::set<std::string>& out) {
  if (v.is_object() && !v.empty()) {
    for (const auto& [k, sub] : v.items()) {
      path.push_back(k);
      record_leaves(sub, path, out);
      path.pop_back();
    }
  } else {
    out.insert(path_to_string(path));
  }
}

// "auto" on keys whose rule is simply "the default" becomes that default here; the rest stay "auto"
// for the plan compiler, which knows the model and the topology.
void substitute_default_autos(const json& node, json& value, std::vector<std::string>& path, std::map<std::string, std::string>& sources,
                              std::map<std::string, std::string>& autos) {
  if (!value.is_object()) return;
  SchemaWalk walk(config_schema());
  for (auto& [key, v] : value.items()) {
    const json* sub = walk.child(node, key, &value);
    if (!sub) continue;
    path.push_back(key);
    if (v.is_string() && v.get<std::string>() == "auto") {
      const json* flag = walk.annotation(*sub, "x-ds-auto-default");
      if (flag && *flag == true) {
        const json& r = walk.resolve(*sub);
        v = sub->contains("default") ? (*sub)["default"] : r["default"];
        sources[path_to_string(path)] = "auto (the default, " + v.dump() + ")";
        autos[path_to_string(path)] = v.dump();
      }
    } else if (v.is_object()) {
      substitute_default_autos(*sub, v, path, sources, autos);
    }
    path.pop_back();
  }
}

// One problem per key: a step that knows more (normalize: "ds does not implement Lion") and the
// schema's generic complaint about the same key would otherwise count twice.
// At most kMaxReported of them: a generated file with thousands of wrong keys gets a readable answer.
constexpr size_t kMaxReported = 50;
std::vector<ConfigIssue> one_per_path(const std::vector<ConfigIssue>& issues) {
  std::vector<ConfigIssue> out;
  std::set<std::string> seen;
  for (const auto& i : issues)
    if (i.path.empty() || seen.insert(i.path).second) out.push_back(i);
  if (out.size() > kMaxReported) {
    const size_t more = out.size() - kMaxReported;
    out.resize(kMaxReported);
    out.push_back({"", "... and " + std::to_string(more) + " more problems", "fix these first; the rest may be the same mistake"});
  }
  return out;
}

struct Loaded {
  json doc;
  Config config;
};

// The keys model.init_from's source gives, set where the model block leaves them unset (their paths in
// `taken`). The source's error is returned, to be thrown only if the config itself has none.
std::exception_ptr take_source_keys(json& doc, const ModelSourceKeys& from_source, std::vector<std::string>& taken) {
  if (!from_source || !doc.contains("model") || !doc["model"].is_object()) return nullptr;
  json& model = doc["model"];
  const auto init_from = model.find("init_from");
  if (init_from == model.end() || !init_from->is_string() || init_from->get<std::string>().empty()) return nullptr;
  json keys;
  try {
    keys = from_source(init_from->get<std::string>(), model);
  } catch (const ConfigError&) {
    return std::current_exception();
  }
  DS_CHECK(keys.is_object() || keys.is_null(), "model.init_from's keys are not an object: ", keys.dump());
  if (keys.is_object())
    for (const auto& [key, value] : keys.items())
      if (!model.contains(key)) {
        model[key] = value;
        taken.push_back("model." + key);
      }
  return nullptr;
}

Loaded load(const std::string& text, const std::string& source, const std::vector<std::string>& overrides,
            const ModelSourceKeys& from_source = {}) {
  std::vector<ConfigIssue> errors, warnings;
  json doc = parse_config_json(text, source, errors);
  if (!doc.is_object())
    throw ConfigError(source, {{"", "the config must be a JSON object, found " + std::string(doc.type_name()),
                                "start the file with { and put the keys inside"}});
  std::set<std::string> from_file;
  std::vector<std::string> path;
  record_leaves(doc, path, from_file);

  normalize_legacy(doc, errors, warnings);
  std::vector<std::string> overridden;
  apply_overrides(doc, overrides, errors, overridden);
  normalize_legacy(doc, errors, warnings);
  std::vector<std::string> taken;
  const std::exception_ptr source_error = errors.empty() ? take_source_keys(doc, from_source, taken) : nullptr;

  SchemaWalk walk(config_schema());
  std::vector<std::string> filled;
  walk.fill_defaults(config_schema(), doc, path, &filled);
  // After the defaults: blocks chosen by a default (optimizer.params of the default type) are known
  // then, and a filled key equals its default, so it never warns.
  check_inert_keys(doc, errors, warnings);
  validate_against_schema(doc, errors);
  if (!errors.empty()) throw ConfigError(source, one_per_path(errors));

  std::map<std::string, std::string> sources;
  for (const auto& p : from_file) sources[p] = "file";
  for (const auto& p : filled) sources[p] = "default";
  for (const auto& p : overridden) sources[p] = "override";
  for (const auto& p : taken) sources[p] = "init_from";
  std::map<std::string, std::string> autos;
  substitute_default_autos(config_schema(), doc, path, sources, autos);

  Config c = read_config(doc, errors);
  if (!c.data.val_path.empty()) {  // the validation samples come from their own file: all of data.path trains
    const auto given = sources.find("data.val_fraction");
    if (given != sources.end() && given->second != "default" && c.data.val_fraction > 0)
      errors.push_back({"data.val_fraction", "data.val_path already holds the validation samples",
                        "give one: data.val_path (a file of its own) or data.val_fraction (a share of data.path); on the "
                        "command line ~data.val_fraction removes the config's"});
    c.data.val_fraction = 0;
    doc["data"]["val_fraction"] = 0;  // the resolved config says so too: a run's config.json plans again as it ran
  }
  c.optimizer.given = std::any_of(sources.begin(), sources.end(), [](const auto& kv) {
    return (kv.first == "optimizer" || kv.first.rfind("optimizer.", 0) == 0) && kv.second != "default";
  });
  if (!c.model.hf_config.empty()) c.model.from_hf = read_hf_config(c.model.hf_config, errors);
  if (!errors.empty()) throw ConfigError(source, errors);
  if (source_error) std::rethrow_exception(source_error);
  c.source = source;
  c.warnings = std::move(warnings);
  c.value_source = std::move(sources);
  c.auto_defaults = std::move(autos);
  return {std::move(doc), std::move(c)};
}

}  // namespace

namespace loader {
// A config is a few KiB; anything past this limit (a device such as /dev/zero, a data file given by
// mistake) is refused before it is read into memory.
constexpr size_t kMaxConfigBytes = 16u << 20;

std::string read_config_text_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError("'" + path + "' is a directory, not a config file",
                    "name the JSON file itself; templates/ holds ready configs (e.g. templates/zero2.json)");
  // A pipe is fine (ds plan <(jq ... my.json)), but a named FIFO nobody writes would block forever: one
  // is given 10 s to produce its first bytes.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    pollfd p{fd, POLLIN, 0};
    const bool ready = fd >= 0 && ::poll(&p, 1, 10000) > 0;
    if (fd >= 0) ::close(fd);
    if (!ready)
      throw UserError("'" + path + "' is a FIFO that nothing wrote to within 10 s", "give a config file (or a pipe with a writer)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    // key=value where the config goes: the config file was left out (a resume needs one too: ds train CONFIG --resume).
    if (const size_t eq = path.find('='); eq != std::string::npos && eq > 0 && path.find('/') > eq)
      throw UserError("'" + path + "' is an override (key=value), but the first argument is the config file",
                      "give the config file first, then the overrides: e.g. ds train my.json " + path);
    throw UserError("cannot read config file '" + path + "'",
                    "check the path; templates/ holds ready configs (e.g. templates/zero2.json)");
  }
  std::string text;
  char chunk[1 << 16];
  while (text.size() <= kMaxConfigBytes && in.read(chunk, sizeof chunk).gcount() > 0)  // devices have no size: read to the limit
    text.append(chunk, static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxConfigBytes)
    throw UserError("'" + path + "' is larger than " + std::to_string(kMaxConfigBytes >> 20) + " MiB: not a config file",
                    "a ds config is a JSON file of a few KiB");
  return text;
}

}  // namespace loader

std::string read_config_file(const std::string& path) { return loader::read_config_text_file(path); }

std::vector<std::string> config_top_level_keys(const std::string& text) {
  std::vector<std::string> keys;
  try {
    loader::check_nesting(text, "");
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
    if (j.is_object())
      for (const auto& [k, v] : j.items()) keys.push_back(k);
  } catch (const std::exception&) {
  }
  return keys;
}

bool looks_like_override(const std::string& arg) {
  if (arg.empty() || arg[0] == '-') return false;
  if (arg[0] == '~') return true;
  const size_t eq = arg.find('=');
  return eq != std::string::npos && eq > 0 && arg.find('/') > eq;  // "a/b=c.json" is a path, not an override
}

Config load_config_text(const std::string& text, const std::string& source_name, const std::vector<std::string>& overrides) {
  return load(text, source_name, overrides).config;
}

Config load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  return load(loader::read_config_text_file(path), path, overrides).config;
}

LoadedConfig load_config_text_with_json(const std::string& text, const std::string& source_name,
                                       const std::vector<std::string>& overrides) {
  Loaded l = load(text, source_name, overrides);
  return {std::move(l.config), l.doc.dump(2)};
}

LoadedConfig load_config_file_with_json(const std::string& path, const std::vector<std::string>& overrides,
                                       const ModelSourceKeys& from_source) {
  Loaded l = load(loader::read_config_text_file(path), path, overrides, from_source);
  return {std::move(l.config), l.doc.dump(2)};
}

std::string resolved_config_json(const std::string& path, const std::vector<std::string>& overrides, int indent,
                                 const ModelSourceKeys& from_source) {
  return load(loader::read_config_text_file(path), path, overrides, from_source).doc.dump(indent);
}

}  // namespace ds
