#include "schema/schema_doc.hpp"

#include <sstream>

#include "common/error.hpp"
#include "schema/schema_walk.hpp"

namespace ds {
namespace {

std::string roff_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\e";
    else if (c == '-') out += "\\-";
    else out += c;
  }
  if (!out.empty() && (out[0] == '.' || out[0] == '\'')) out = "\\&" + out;
  return out;
}

class Writer {
 public:
  explicit Writer(const SchemaWalk& walk) : walk_(walk) {}

  void entry(const std::string& path, const json& node) {
    const json& r = walk_.resolve(node);
    if (walk_.annotation(node, "x-ds-alias-of")) {
      os_ << ".TP\n.B " << roff_escape(path) << "\nanother DeepSpeed spelling of "
          << roff_escape((*walk_.annotation(node, "x-ds-alias-of")).get<std::string>()) << ".\n";
      return;
    }
    os_ << ".TP\n.B " << roff_escape(path) << "\n";
    std::string line = walk_.describe(node);
    const json* dflt = node.contains("default") ? &node["default"] : (r.contains("default") ? &r["default"] : nullptr);
    if (dflt && !(dflt->is_object() && !dflt->empty())) line += "; default " + dflt->dump();
    os_ << roff_escape(line) << ".\n";
    std::string desc = node.value("description", r.value("description", std::string()));
    if (!desc.empty()) os_ << ".br\n" << roff_escape(desc) << ".\n";
    if (const json* a = walk_.annotation(node, "x-ds-auto"))
      os_ << ".br\n\"auto\": " << roff_escape(a->get<std::string>()) << ".\n";
    if (const json* d = walk_.annotation(node, "x-ds-deprecated"))
      os_ << ".br\nDeprecated: read as " << roff_escape(d->get<std::string>()) << " (a warning says so).\n";
    if (const json* i = walk_.annotation(node, "x-ds-ignored"); i && *i == true) {
      os_ << ".br\nAccepted for DeepSpeed compatibility but not acted on: a value other than the default is "
             "named in a warning";
      if (const json* why = walk_.annotation(node, "x-ds-why"); why && why->is_string()) os_ << " (" << roff_escape(why->get<std::string>()) << ")";
      os_ << ".\n";
    }
    if (const json* refused = walk_.annotation(node, "x-ds-refused"); refused && refused->is_string())
      os_ << ".br\nRefused (exit 2) when set: " << roff_escape(refused->get<std::string>()) << ".\n";
  }

  void object(const std::string& prefix, const json& node, const json* value) {
    const json& r = walk_.resolve(node);
    if (const json* i = walk_.annotation(node, "x-ds-ignored"); i && *i == true) return;
    for (const auto& [key, sub] : walk_.properties(r, value)) {
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (key == "params" && r.contains("allOf")) continue;  // per-type sections below
      entry(path, *sub);
      const json& rs = walk_.resolve(*sub);
      if (walk_.properties(rs, nullptr).size() > 0 && !walk_.annotation(*sub, "x-ds-alias-of")) object(path, *sub, nullptr);
    }
    if (r.contains("allOf"))
      for (const auto& branch : r["allOf"]) {
        if (!branch.contains("if") || !branch.contains("then")) continue;
        const std::string type = branch["if"]["properties"]["type"]["const"].get<std::string>();
        const json& params = branch["then"]["properties"]["params"];
        os_ << ".SS " << roff_escape(prefix + ".params") << " for type " << roff_escape(type) << "\n";
        for (const auto& [key, sub] : walk_.properties(params, nullptr)) entry(prefix + ".params." + key, *sub);
      }
  }

  std::string str() const { return os_.str(); }
  std::ostringstream& out() { return os_; }

 private:
  const SchemaWalk& walk_;
  std::ostringstream os_;
};

}  // namespace

std::string config_key_reference_roff() {
  SchemaWalk walk(config_schema());
  Writer w(walk);
  const json& root = config_schema();
  // Top-level scalars first, then one subsection per block, in the schema's own order of blocks.
  w.out() << ".SS Top-level keys\n";
  for (const auto& [key, sub] : walk.properties(root, nullptr)) {
    const json& r = walk.resolve(*sub);
    const bool block = !walk.properties(r, nullptr).empty() || (walk.annotation(*sub, "x-ds-ignored") && r.value("type", json()) == "object");
    if (!block) w.entry(key, *sub);
  }
  for (const auto& [key, sub] : walk.properties(root, nullptr)) {
    const json& r = walk.resolve(*sub);
    if (walk.properties(r, nullptr).empty()) continue;
    w.out() << ".SS " << roff_escape(key) << "\n";
    w.entry(key, *sub);
    w.object(key, *sub, nullptr);
  }
  w.out() << ".SS Blocks accepted for DeepSpeed compatibility and ignored\n";
  for (const auto& [key, sub] : walk.properties(root, nullptr)) {
    const json& r = walk.resolve(*sub);
    if (walk.properties(r, nullptr).empty() && walk.annotation(*sub, "x-ds-ignored") && r.value("type", json()) == "object")
      w.entry(key, *sub);
  }
  return w.str();
}

std::string render_config_man_page(const std::string& template_text) {
  const std::string marker = ".\\\" @KEY_REFERENCE@";
  const size_t at = template_text.find(marker);
  DS_CHECK(at != std::string::npos, "the template has no ", marker, " line");
  return template_text.substr(0, at) + config_key_reference_roff() + template_text.substr(at + marker.size() + 1);
}

}  // namespace ds
