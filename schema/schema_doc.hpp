// ds — the key reference of ds-config(5), generated from ds_config.schema.json so the manual cannot
// drift from the code: every key with its type, default, description, and whether "auto" is allowed,
// DeepSpeed-only (ignored) or a legacy spelling.
#pragma once

#include <string>

namespace ds {

// roff (man(7) macros) for the KEYS section.
std::string config_key_reference_roff();

// Replaces the line `.\" @KEY_REFERENCE@` in a man page template with the reference.
std::string render_config_man_page(const std::string& template_text);

}  // namespace ds
