// ds — the steps of load_config, each in its own file (schema/*.cpp). Not for use outside schema/.
#pragma once

#include <string>
#include <vector>

#include "common/error.hpp"
#include "schema/config.hpp"
#include "schema/schema_walk.hpp"

namespace ds::loader {

// json_parse.cpp: comments allowed; duplicate keys and syntax errors become issues (syntax errors
// throw at once, with file:line:column and the offending line).
json parse_config_json(const std::string& text, const std::string& source, std::vector<ConfigIssue>& errors);
// A config file's text, refused (UserError) when it is a directory, unreadable, or larger than 16 MiB
// (a device such as /dev/zero, a data file given by mistake) before it is read into memory.
std::string read_config_text_file(const std::string& path);
// A ds config is never more than a few levels deep; deeper text is refused before anything walks it
// recursively (UserError with file:line:col).
constexpr int kMaxConfigNesting = 32;
void check_nesting(const std::string& text, const std::string& source);

// overrides.cpp: apply `key=value` / `~key` in order; records each path set in `overridden`.
void apply_overrides(json& doc, const std::vector<std::string>& overrides, std::vector<ConfigIssue>& errors,
                     std::vector<std::string>& overridden);

// normalize.cpp: legacy and alias spellings -> canonical keys (warnings, or errors when both given).
void normalize_legacy(json& doc, std::vector<ConfigIssue>& errors, std::vector<ConfigIssue>& warnings);

// validate.cpp: schema validation rendered as sentences; unknown keys get a did-you-mean.
void validate_against_schema(const json& doc, std::vector<ConfigIssue>& errors);
// Keys ds accepts but does not act on (x-ds-ignored), set to something other than their default, are
// warnings; keys it refuses (x-ds-refused), set at all, are errors.
void check_inert_keys(const json& doc, std::vector<ConfigIssue>& errors, std::vector<ConfigIssue>& warnings);
// The "did you mean" text for an unknown key at `parent` (may be "").
std::string suggest_key(const std::vector<std::string>& parent, const std::string& key, const json& doc);

// config_read.cpp: the validated, defaults-filled JSON -> typed Config (plus cross-field checks).
Config read_config(const json& doc, std::vector<ConfigIssue>& errors);

// hf_config.cpp: a Hugging Face config.json -> model fields.
ModelFields read_hf_config(const std::string& path, std::vector<ConfigIssue>& errors);

}  // namespace ds::loader
