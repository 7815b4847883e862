// Parsing a config file strictly: nlohmann's parser with comments allowed (DeepSpeed reads configs
// with hjson, so commented configs exist), a callback that catches duplicate keys (DeepSpeed rejects
// them too), and syntax errors turned into `file:line:column` with the offending line and a caret.
#include <algorithm>
#include <set>

#include "common/json_depth.hpp"
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

// "file:line:col: what", then the line's text and a caret under the column.
std::string located(const std::string& text, const std::string& source, size_t byte, const std::string& what) {
  byte = std::min(byte, text.size());
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < byte; ++i)
    if (text[i] == '\n') ++line, line_start = i + 1;
  const size_t col = byte - line_start + 1;
  size_t line_end = text.find('\n', line_start);
  if (line_end == std::string::npos) line_end = text.size();
  std::string excerpt = text.substr(line_start, std::min<size_t>(line_end - line_start, 200));
  return source + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + what + "\n    " + excerpt + "\n    " +
         std::string(col > 0 ? std::min<size_t>(col - 1, 200) : 0, ' ') + "^";
}

}  // namespace

void check_nesting(const std::string& text, const std::string& source) {
  const size_t at = json_nesting_exceeded_at(text, kMaxConfigNesting);
  if (at != std::string::npos)
    throw UserError(located(text, source, at, "nesting deeper than " + std::to_string(kMaxConfigNesting) + " levels"),
                    "a ds config is a few levels deep; this text is not one (a generated or corrupted file?)");
}

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
  check_nesting(text, source);  // before parsing: what is built from the text is walked recursively later
  try {
    return json::parse(text, cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    auto colon = what.find(": ", what.find("parse error"));
    if (colon != std::string::npos) what = what.substr(colon + 2);
    throw UserError(located(text, source, e.byte == 0 ? 0 : e.byte - 1, "invalid JSON: " + what),
                    "fix the JSON syntax at that position (a missing comma or quote is the usual cause)");
  } catch (const json::out_of_range& e) {
    // A number no double holds (1e999). nlohmann names the literal, not its position: find it.
    std::string what = e.what();
    const size_t q = what.find('\'');
    const std::string literal = q == std::string::npos ? "" : what.substr(q + 1, what.rfind('\'') - q - 1);
    const size_t at = literal.empty() ? std::string::npos : text.find(literal);
    const std::string msg = "number out of range: " + (literal.empty() ? what : literal);
    throw UserError(at == std::string::npos ? source + ": " + msg : located(text, source, at, msg),
                    "numbers must fit a double (about 1.8e308)");
  }
}

}  // namespace ds::loader
