// libFuzzer target: the GPT-2 tokenizer's vocab.json and merges.txt readers, then encode/decode.
// Input: vocab.json bytes, a NUL byte, merges.txt bytes.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "engine/runtime/data/byte_level_bpe.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string dir = "/tmp/ds_fuzz_tokenizer_" + std::to_string(::getpid());
  std::ofstream(dir + "_vocab.json", std::ios::binary) << input.substr(0, nul);
  std::ofstream(dir + "_merges.txt", std::ios::binary) << (nul == std::string::npos ? std::string() : input.substr(nul + 1));
  try {
    ds::ByteLevelBpe tok(dir + "_vocab.json", dir + "_merges.txt");
    const auto ids = tok.encode("Hello world, it's 2026!\n  caf\xc3\xa9");
    tok.decode(ids);
  } catch (const ds::UserError&) {
  }
  return 0;
}
