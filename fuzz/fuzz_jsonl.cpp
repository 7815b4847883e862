// libFuzzer target: fine-tuning jsonl lines (any bytes: not JSON, wrong shapes, deep nesting, NULs, odd
// roles) read into samples with the example's tokenizer and ChatML. Anything but a sample or a UserError
// naming the line is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/error.hpp"
#include "engine/runtime/data/chat_data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ds::HfTokenizer tok(std::string(DS_SOURCE_DIR) + "/examples/data/sft");
  const std::string input(reinterpret_cast<const char*>(data), size);
  ds::JsonlSamples reader(tok, ds::SampleOptions{});
  size_t at = 0;
  int line = 0;
  try {
    while (at <= input.size()) {
      size_t end = input.find('\n', at);
      if (end == std::string::npos) end = input.size();
      reader.add_line(input.substr(at, end - at), "fuzz:" + std::to_string(++line));
      at = end + 1;
    }
    reader.take();
  } catch (const ds::UserError&) {
  }
  return 0;
}
