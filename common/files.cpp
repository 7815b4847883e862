#include "common/files.hpp"

#include <filesystem>
#include <fstream>
#include <stdexcept>

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

}  // namespace ds
