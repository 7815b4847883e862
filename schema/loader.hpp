// ds — loading a config: parse (comments allowed, duplicate keys rejected, syntax errors with
// file:line:column), apply command-line overrides, rewrite legacy DeepSpeed spellings, fill the
// schema's defaults, validate against the schema, and read the result into a typed Config.
// Every problem found is reported at once in one ConfigError; warnings travel in Config::warnings.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "schema/config.hpp"

namespace ds {

// model.init_from's source fixes the model, and is asked while the config loads (once: after the overrides,
// before the defaults): given init_from and the model block as written, it returns the model keys the source
// gives (a JSON object). The loader sets those the config leaves unset and records them as from "init_from";
// what the config sets stays, for the caller to check against the source. The source's own error (a path
// that is not there) is thrown after the config's: a config's mistakes are reported first.
using ModelSourceKeys = std::function<nlohmann::json(const std::string& init_from, const nlohmann::json& model_block)>;

// `overrides` use the grammar `key.sub=value` (set; the value is JSON, else a string) and `~key.sub`
// (remove). Paths are checked against the schema exactly as keys in the file are.
// Throws UserError when the file cannot be read, ConfigError for everything wrong inside it.
Config load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});
Config load_config_text(const std::string& text, const std::string& source_name,
                        const std::vector<std::string>& overrides = {});

// A config file's text, with the loader's checks (not a directory, at most 16 MiB); UserError otherwise.
std::string read_config_file(const std::string& path);
// The top-level keys of a config text; empty when it does not parse (loading it then says why).
std::vector<std::string> config_top_level_keys(const std::string& text);

// True for a command-line word that is an override rather than a file or flag.
bool looks_like_override(const std::string& arg);

// The fully resolved config as JSON text (defaults filled, legacy spellings rewritten), for
// `ds plan --resolved-config`.
std::string resolved_config_json(const std::string& path, const std::vector<std::string>& overrides, int indent = 2,
                                 const ModelSourceKeys& from_source = {});

// Both from one load: the typed Config and its resolved JSON text (the run directory's config.json).
struct LoadedConfig {
  Config config;
  std::string resolved_json;
};
LoadedConfig load_config_file_with_json(const std::string& path, const std::vector<std::string>& overrides = {},
                                       const ModelSourceKeys& from_source = {});
LoadedConfig load_config_text_with_json(const std::string& text, const std::string& source_name,
                                       const std::vector<std::string>& overrides = {});

}  // namespace ds
