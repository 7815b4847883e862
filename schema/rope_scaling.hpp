// ds — rope_scaling as Hugging Face's config.json writes it ({"rope_type": "llama3", "factor": 8.0, ...}),
// read and written in one place: a Hugging Face config, ds's model.rope_scaling, plan.json and exports.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "schema/config.hpp"

namespace ds {

// The scaling `j` describes (null or {"rope_type": "default"}: none). Every key acts or is refused: a type ds
// does not compute (longrope, Phi-3's; ntk) or a key it would not act on (yarn's truncate, mscale) is an
// issue on `key`, naming it, never trained as something else. `where` prefixes messages (a file's name).
RopeScaling read_rope_scaling(const nlohmann::json& j, const std::string& key, const std::string& where, std::vector<ConfigIssue>& errors);

// Hugging Face's form (null for none), the keys of its type only.
nlohmann::json rope_scaling_json(const RopeScaling& r);

}  // namespace ds
