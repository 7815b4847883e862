// ds — loading a config: parse (comments allowed, duplicate keys rejected, syntax errors with
// file:line:column), apply command-line overrides, rewrite legacy DeepSpeed spellings, fill the
// schema's defaults, validate against the schema, and read the result into a typed Config.
// Every problem found is reported at once in one ConfigError; warnings travel in Config::warnings.
#pragma once

#include <string>
#include <vector>

#include "schema/config.hpp"

namespace ds {

// `overrides` use the grammar `key.sub=value` (set; the value is JSON, else a string) and `~key.sub`
// (remove). Paths are checked against the schema exactly as keys in the file are.
// Throws UserError when the file cannot be read, ConfigError for everything wrong inside it.
Config load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});
Config load_config_text(const std::string& text, const std::string& source_name,
                        const std::vector<std::string>& overrides = {});

// True for a command-line word that is an override rather than a file or flag.
bool looks_like_override(const std::string& arg);

// The fully resolved config as JSON text (defaults filled, legacy spellings rewritten), for
// `ds plan` and the run directory.
std::string resolved_config_json(const std::string& path, const std::vector<std::string>& overrides, int indent = 2);

}  // namespace ds
