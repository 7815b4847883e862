// ds — writing a file so that a crash never leaves half of it under its name.
#pragma once

#include <string>

namespace ds {

// Writes `text` to `path`.partial, then renames it over `path`. Throws std::runtime_error naming the
// file when it cannot be written (the partial file is removed).
void write_text_atomically(const std::string& path, const std::string& text);

// The bytes of a regular file. Throws UserError naming it when it is missing, not a regular file (a FIFO
// would block), or cannot be read.
std::string read_file_bytes(const std::string& path);

}  // namespace ds
