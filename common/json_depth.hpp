// ds — how deep JSON nests, found before a parser or a recursive walk meets it. nlohmann's parser is
// iterative, but copying, comparing and walking a parsed document recurse once per level: a file of
// 200,000 brackets (a corrupted index, a crafted checkpoint) would overflow the stack. Every JSON text
// ds reads from a file passes through here first; configs have a tighter limit of their own (32).
#pragma once

#include <string>
#include <string_view>

namespace ds {

// Files ds reads (Hugging Face configs and indexes, safetensors headers, a checkpoint's stored plan and
// config) are a few levels deep; 64 leaves room and bounds every recursion.
constexpr int kMaxJsonNesting = 64;

// The byte offset of the first '{' or '[' that opens level max_depth + 1, or std::string_view::npos.
// Brackets inside strings and inside // or /* */ comments do not count.
size_t json_nesting_exceeded_at(std::string_view text, int max_depth);

// Throws UserError naming `source` and the offset when `text` nests deeper than max_depth.
void check_json_nesting(std::string_view text, const std::string& source, int max_depth = kMaxJsonNesting);

}  // namespace ds
