// libFuzzer target: the config loader with command-line overrides, then the plan compiler when the
// config loads. Input: config text, optionally followed by "\n%%\n" and one override per line.
// Any exception ds throws on purpose (ConfigError, UserError) is an answer; a crash, a sanitizer
// report or another exception type is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "schema/loader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find("\n%%\n");
  const std::string text = input.substr(0, split);
  std::vector<std::string> overrides;
  if (split != std::string::npos)
    for (size_t at = split + 4; at <= input.size();) {
      const size_t end = std::min(input.find('\n', at), input.size());
      if (end > at) overrides.push_back(input.substr(at, end - at));
      at = end + 1;
    }
  try {
    const ds::Config c = ds::load_config_text(text, "fuzz.json", overrides);
    ds::Topology t;
    t.cores_per_node = 2;
    t.host_memory_bytes = 1e10;
    if (c.model.given)
      ds::compile_plan(c, ds::build_model_spec(ds::resolve_model_hyper(c.model)), t);
    else
      ds::compile_plan_without_model(c, t);
  } catch (const ds::UserError&) {  // ConfigError is one
  }
  return 0;
}
