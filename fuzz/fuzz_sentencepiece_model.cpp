// libFuzzer target: SentencePiece's tokenizer.model (any bytes, a protocol buffer parsed by ds) read, then text
// encoded and decoded with it. Anything but a tokenizer or a UserError naming the file is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "/tmp/ds_fuzz_spm_" + std::to_string(::getpid()) + ".model";
  std::ofstream(path, std::ios::binary) << std::string(reinterpret_cast<const char*>(data), size);
  try {
    const ds::HfTokenizer tok(path);
    const auto ids = tok.encode("Hello world, it's 2026!\n  caf\xc3\xa9 [INST]x[/INST] <U> 12345 \xe2\x96\x81", true);
    tok.decode(ids);
  } catch (const ds::UserError&) {
  }
  return 0;
}
