// Parsing a config file strictly: nlohmann's parser with comments allowed (DeepSpeed reads configs
// with hjson, so commented configs exist), a callback that catches duplicate keys (DeepSpeed rejects
// them too), and syntax errors turned into `file:line:column` with the offending line and a caret.
#include <algorithm>
#include <set>

#include "schema/loader_internal.hpp"

namespace ds::loader {
namespace {

struct Frame {
  bool is_array = false;
  std::set<std::string> keys;
  std::string last_key;
};

std::string frames_path(const std::vector<Frame>& stack) {
  std::vector<std::string> segs;
  for (size_t i = 0; i + 1 < stack.size(); ++i) segs.push_back(stack[i].is_array ? "[]" : stack[i].last_key);
  std::string out;
  for (const auto& s : segs) out += (s == "[]" ? "[]" : (out.empty() ? "" : ".") + s);
  return out;
}

}  // namespace

json parse_config_json(const std::string& text, const std::string& source, std::vector<ConfigIssue>& errors) {
  std::vector<Frame> stack;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start: stack.push_back(Frame{false, {}, {}}); break;
      case json::parse_event_t::array_start: stack.push_back(Frame{true, {}, {}}); break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& f = stack.back();
        const std::string key = parsed.get<std::string>();
        if (!f.keys.insert(key).second) {
          std::string where = frames_path(stack);
          std::string full = where.empty() ? key : where + "." + key;
          errors.push_back({full, "duplicate key: '" + key + "' appears more than once" +
                                      (where.empty() ? " at the top level" : " in " + where),
                            "keep one; JSON readers disagree on which copy wins"});
        }
        f.last_key = key;
        break;
      }
      case json::parse_event_t::value: break;
    }
    return true;
  };
  try {
    return json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // Byte offset -> line and column (1-based) and the line's text.
    const size_t byte = std::min<size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    size_t line = 1, line_start = 0;
    for (size_t i = 0; i < byte; ++i)
      if (text[i] == '\n') ++line, line_start = i + 1;
    const size_t col = byte - line_start + 1;
    size_t line_end = text.find('\n', line_start);
    if (line_end == std::string::npos) line_end = text.size();
    std::string what = e.what();
    auto colon = what.find(": ", what.find("parse error"));
    if (colon != std::string::npos) what = what.substr(colon + 2);
    std::string excerpt = text.substr(line_start, line_end - line_start);
    std::string caret(col > 0 ? col - 1 : 0, ' ');
    throw UserError(source + ":" + std::to_string(line) + ":" + std::to_string(col) + ": invalid JSON: " + what +
                        "\n    " + excerpt + "\n    " + caret + "^",
                    "fix the JSON syntax at that position (a missing comma or quote is the usual cause)");
  }
}

}  // namespace ds::loader
