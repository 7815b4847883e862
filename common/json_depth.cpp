#include "common/json_depth.hpp"

#include "common/error.hpp"

namespace ds {

size_t json_nesting_exceeded_at(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const size_t end = text.find("*/", i + 2);
      i = end == std::string_view::npos ? text.size() : end + 1;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return i;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return std::string_view::npos;
}

void check_json_nesting(std::string_view text, const std::string& source, int max_depth) {
  const size_t at = json_nesting_exceeded_at(text, max_depth);
  if (at != std::string_view::npos)
    throw UserError("'" + source + "' nests JSON deeper than " + std::to_string(max_depth) + " levels (at byte " + std::to_string(at) +
                        "): not a file ds can read",
                    "the file is damaged or was not written as what it claims to be");
}

}  // namespace ds
