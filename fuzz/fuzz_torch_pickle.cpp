// libFuzzer target: torch.save files read without running them. The first byte chooses the layer: even,
// the rest is a pickle for ds's bounded reader; odd, the rest is a whole .pt file (zip container, then its
// pickle, then every tensor's elements read from their storages). Anything accepted must be walkable:
// its values turned into JSON (bounded), its small tensors read in full, without reading outside the input.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "engine/runtime/io/torch_file.hpp"

namespace {
void read_tensors(const ds::TorchFile& f, const ds::PyValue& v, int depth, int& budget) {
  if (depth > 16 || --budget < 0) return;
  if (v.is(ds::PyKind::tensor)) {
    if (v.numel() > (1 << 16)) return;
    std::vector<float> out(static_cast<size_t>(v.numel()));
    try {
      f.read_f32(v, 0, v.numel(), out.data());
    } catch (const ds::UserError&) {
    }
    return;
  }
  for (const ds::PyValue* i : v.items) read_tensors(f, *i, depth + 1, budget);
  for (const auto& [k, x] : v.entries) read_tensors(f, *x, depth + 1, budget);
  if (v.state) read_tensors(f, *v.state, depth + 1, budget);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // A copy of exactly the bytes, so a read past the end is a heap overflow ASan reports.
  std::vector<uint8_t> bytes(data + 1, data + size);
  try {
    if (data[0] % 2 == 0) {
      ds::Pickle p(std::string(bytes.begin(), bytes.end()), "fuzz.pkl");
      (void)ds::pickle_to_json(p.root(), "fuzz.pkl").dump();
    } else {
      ds::TorchFile f(ds::memory_reader(bytes.data(), bytes.size(), "fuzz.pt"));
      int budget = 10000;
      read_tensors(f, f.root(), 0, budget);
      (void)ds::pickle_to_json(f.root(), "fuzz.pt").dump();
    }
  } catch (const ds::UserError&) {
  }
  return 0;
}
