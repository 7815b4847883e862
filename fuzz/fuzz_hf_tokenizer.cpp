// libFuzzer target: a Hugging Face tokenizer.json (any bytes) read, then text encoded and decoded with it.
// Anything but a tokenizer or a UserError naming the file is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "/tmp/ds_fuzz_tokenizer_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path, std::ios::binary) << std::string(reinterpret_cast<const char*>(data), size);
  try {
    const ds::HfTokenizer tok(path);
    const auto ids = tok.encode("Hello world, it's 2026!\n  caf\xc3\xa9 <|im_start|>x<|im_end|> 12345", true);
    tok.decode(ids);
  } catch (const ds::UserError&) {
  }
  return 0;
}
