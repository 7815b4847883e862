// ds — writing a file so that a crash never leaves half of it under its name.
#pragma once

#include <string>

namespace ds {

// Writes `text` to `path`.partial, then renames it over `path`. Throws std::runtime_error naming the
// file when it cannot be written (the partial file is removed).
void write_text_atomically(const std::string& path, const std::string& text);

}  // namespace ds
