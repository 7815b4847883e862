// libFuzzer target: a PEFT adapter directory's adapter_config.json on arbitrary bytes (beside a small valid
// adapter_model.safetensors), read as model.init_from reads it. Every input is accepted with sane values or
// refused with a UserError: never a crash, a hang, or an exception of another kind.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "engine/runtime/io/weights.hpp"

namespace {

// One scratch adapter directory per process, its safetensors written once: one 2 x 2 fp32 lora_A tensor.
const std::string& adapter_dir() {
  static const std::string dir = [] {
    const std::string d = (std::filesystem::temp_directory_path() / ("ds_fuzz_peft_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(d);
    const std::string header =
        R"({"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
    std::ofstream st(d + "/adapter_model.safetensors", std::ios::binary);
    const uint64_t n = header.size();
    st.write(reinterpret_cast<const char*>(&n), 8);
    st << header;
    const float values[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    st.write(reinterpret_cast<const char*>(values), sizeof values);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = adapter_dir();
  {
    std::ofstream cfg(dir + "/adapter_config.json", std::ios::binary | std::ios::trunc);
    cfg.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const std::unique_ptr<ds::WeightSource> a = ds::open_weights(dir);
    if (!a->lora) __builtin_trap();  // an adapter directory read as anything else
    const ds::PeftAdapter& l = *a->lora;
    if (l.r < 1 || !(l.alpha > 0) || !(l.dropout >= 0 && l.dropout < 1)) __builtin_trap();  // accepted, so sane
    float out[4];
    a->read_f32("transformer.h.0.attn.c_attn.lora_A.weight", out);
  } catch (const ds::UserError&) {
  }
  return 0;
}
