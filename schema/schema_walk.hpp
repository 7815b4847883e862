// ds — reading ds_config.schema.json: the embedded schema text, the subschema at a JSON path
// (following $ref, anyOf object branches and if/then branches whose condition the document meets),
// the keys known at a path, a description of what a subschema expects, and default filling.
// Only the JSON Schema features the ds schema uses are understood.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ds {

using json = nlohmann::json;

// The parsed ds_config.schema.json compiled into the binary.
const json& config_schema();
const std::string& config_schema_text();

// A JSON path as segments: keys, or "[i]" for array indices. Printed as "a.b[0].c".
std::string path_to_string(const std::vector<std::string>& path);

class SchemaWalk {
 public:
  explicit SchemaWalk(const json& root) : root_(root) {}

  // Follows "$ref" (local JSON pointers only).
  const json& resolve(const json& node) const;
  // Properties of an object subschema as they apply to `value` (the document at that point; may be
  // null): own properties, object branches of anyOf, allOf entries, and then-branches whose if holds.
  std::map<std::string, const json*> properties(const json& node, const json* value) const;
  // The subschema for `key` under `node`, or nullptr when the key is unknown there.
  const json* child(const json& node, const std::string& key, const json* value) const;
  // The subschema at `path` in `doc` (nullptr if some segment is unknown).
  const json* at(const std::vector<std::string>& path, const json& doc) const;
  // "an integer >= 1 or \"auto\"", "one of 0, 1, 2, 3", ...
  std::string describe(const json& node) const;
  // A string annotation of the subschema (e.g. "x-ds-ignored"), looking through $ref.
  const json* annotation(const json& node, const char* name) const;
  // Fills missing keys that have a "default", recursing into objects; records each filled path.
  void fill_defaults(const json& node, json& value, std::vector<std::string>& path,
                     std::vector<std::string>* filled) const;
  // Every key path the schema defines (for "did you mean" across blocks).
  std::vector<std::vector<std::string>> all_key_paths() const;

 private:
  bool condition_holds(const json& cond, const json* value) const;
  void collect_paths(const json& node, std::vector<std::string>& prefix, std::vector<std::vector<std::string>>& out,
                     int depth) const;
  const json& root_;
};

}  // namespace ds
