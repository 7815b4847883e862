#include "schema/json_diff.hpp"

#include <set>

#include <nlohmann/json.hpp>

#include "common/json_depth.hpp"

namespace ds {
namespace {

using json = nlohmann::json;

void diff(const json& a, const json& b, const std::string& path, std::vector<std::string>& out) {
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : a.items()) keys.insert(k);
    for (const auto& [k, v] : b.items()) keys.insert(k);
    for (const auto& k : keys) {
      const std::string p = path.empty() ? k : path + "." + k;
      if (!a.contains(k) || !b.contains(k)) out.push_back(p);
      else diff(a[k], b[k], p, out);
    }
  } else if (a != b) {
    out.push_back(path.empty() ? "(top level)" : path);
  }
}

}  // namespace

std::vector<std::string> json_differences(const std::string& a, const std::string& b) {
  std::vector<std::string> out;
  try {
    if (json_nesting_exceeded_at(a, kMaxJsonNesting) != std::string_view::npos ||
        json_nesting_exceeded_at(b, kMaxJsonNesting) != std::string_view::npos) {
      out.push_back("(unreadable: nested too deep)");
      return out;
    }
    diff(json::parse(a), json::parse(b), "", out);
  } catch (const json::parse_error&) {
    out.push_back("(unreadable)");
  }
  return out;
}

}  // namespace ds
