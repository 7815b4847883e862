// Helpers shared by the fine-tuning data tests (test_chat_data.cpp, test_chat_templates.cpp): scratch
// directories, the example's tokenizer with every family's special tokens and a chat template of the test's
// choosing, a plain conversation, and the trained tokens of a rendering.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"
#include "test_helpers.hpp"

namespace chat_test {

using ds::ChatMessage;
using ds::HfTokenizer;
using json = nlohmann::json;
namespace fs = std::filesystem;

inline std::string scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("ds_chat_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

inline void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

inline json example_tokenizer() { return json::parse(ds::test::read_text(std::string(DS_SOURCE_DIR) + "/examples/data/sft/tokenizer.json")); }

// The example's tokenizer with more added tokens (Llama 3's) and a chat template of our choosing.
inline std::string tokenizer_dir(const std::string& name, const std::string& chat_template, json tok = example_tokenizer(),
                          const std::string& eos = "<|im_end|>", const std::string& bos = "") {
  const std::string d = scratch(name);
  int32_t next = 0;
  for (const auto& a : tok["added_tokens"]) next = std::max(next, a["id"].get<int32_t>() + 1);
  for (const char* s : {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|user|>", "<|assistant|>",
                        "<|end|>", "<|system|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<s>", "</s>"})
    tok["added_tokens"].push_back({{"id", next++}, {"content", s}, {"special", true}, {"lstrip", false}, {"rstrip", false}});
  write(d + "/tokenizer.json", tok.dump());
  json config = {{"eos_token", eos}};
  if (!bos.empty()) config["bos_token"] = bos;
  if (!chat_template.empty()) config["chat_template"] = chat_template;
  write(d + "/tokenizer_config.json", config.dump());
  return d;
}

inline std::vector<ChatMessage> three_turns(bool system) {
  std::vector<ChatMessage> m = {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Capital of France?"}, {"assistant", " Paris. "}};
  if (system) m.insert(m.begin(), {"system", "Be brief."});
  return m;
}

// The trained tokens of a rendered conversation, decoded run by run.
inline std::vector<std::string> trained_runs(const HfTokenizer& tok, const std::string& text, const std::vector<std::pair<size_t, size_t>>& spans) {
  std::vector<std::string> runs;
  // Tokenize as the reader does (the whole text), then group the trained tokens.
  std::vector<int32_t> lengths;
  const std::vector<int32_t> ids = tok.encode(text, false, &lengths);
  size_t at = 0, k = 0;
  std::string run;
  bool in_run = false;
  for (int32_t id : ids) {
    bool trained = false;
    for (const auto& [a, b] : spans) trained = trained || (a <= at && at < b);
    if (trained) run += tok.decode({id});
    if (!trained && in_run) runs.push_back(run), run.clear();
    in_run = trained;
    at += static_cast<size_t>(lengths[k++]);
  }
  if (in_run) runs.push_back(run);
  return runs;
}

// Qwen2.5's template as tokenizer_config.json holds it (its tools branch shortened, its plain branch whole).
inline const char* const kQwen25Template =
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) "
    "or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

}  // namespace chat_test
