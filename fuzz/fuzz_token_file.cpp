// libFuzzer target: the token-file readers (raw uint16, raw uint32, llm.c's headered .bin). Input:
// one byte choosing the format, then the file's bytes; a few samples are read from what opens.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/data/token_source.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const char* formats[] = {"uint16", "uint32", "llmc"};
  const std::string path = "/tmp/ds_fuzz_tokens_" + std::to_string(::getpid()) + ".bin";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data + 1), static_cast<std::streamsize>(size - 1));
  ds::DataConfig d;
  d.type = ds::DataType::tokens;
  d.path = path;
  d.token_format = formats[data[0] % 3];
  try {
    auto stream = ds::open_token_stream(d, 50257, 1);
    std::vector<int32_t> out(8);
    const int64_t n = stream->size();
    for (int64_t at : {int64_t{0}, n / 2, n - 8})
      if (at >= 0 && at + 8 <= n) stream->read(at, 8, out.data());
  } catch (const ds::UserError&) {
  }
  return 0;
}
