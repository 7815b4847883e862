// libFuzzer target: the safetensors reader on arbitrary bytes. A file it accepts must be readable in
// full: every float tensor converted to fp32 without reading outside the input (AddressSanitizer).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so a read past the end is a heap overflow ASan reports.
  std::vector<uint8_t> bytes(data, data + size);
  try {
    ds::SafetensorsView v(bytes.data(), bytes.size(), "fuzz.safetensors");
    std::vector<float> out;
    for (const ds::StTensor& t : v.tensors()) {
      if (t.numel() > (int64_t{1} << 24)) continue;  // a valid but large tensor: its bytes were checked already
      out.assign(static_cast<size_t>(t.numel()), 0.0f);
      try {
        v.read_f32(t, out.data());
      } catch (const ds::UserError&) {
      }
    }
  } catch (const ds::UserError&) {
  }
  return 0;
}
