#include "common/files.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "common/error.hpp"

namespace ds {

void write_text_atomically(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out << text << std::flush;
    if (!out) {
      std::error_code ec;
      fs::remove(partial, ec);
      throw std::runtime_error("cannot write '" + partial.string() + "' (is the disk full?)");
    }
  }
  fs::rename(partial, path);
}

std::string read_file_bytes(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw UserError("'" + path + "' is not a readable regular file", "check the path");
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw UserError("cannot read '" + path + "'", "");
  return bytes;
}

}  // namespace ds
