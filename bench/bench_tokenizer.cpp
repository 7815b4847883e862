// How fast ds tokenizes: MB of UTF-8 text per second on one core, for GPT-2's files (ByteLevelBpe) and for
// a tokenizer.json with Llama 3's split pattern and ignore_merges (HfTokenizer), each cold (a new tokenizer:
// nothing cached) and warm (the same text again: pieces seen before come from the cache).
// Usage: bench_tokenizer VOCAB_JSON MERGES_TXT TOKENIZER_JSON TEXT_FILE [ROUNDS]
// (tests/test_chat_data.cpp shows how a tokenizer.json is made from GPT-2's files; bench/RESULTS.md has the command.)
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "engine/runtime/data/byte_level_bpe.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"

namespace {

std::string slurp(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s VOCAB_JSON MERGES_TXT TOKENIZER_JSON TEXT_FILE [ROUNDS]\n", argv[0]);
    return 2;
  }
  const std::string text = slurp(argv[4]);
  const int rounds = argc > 5 ? std::atoi(argv[5]) : 3;
  const double mb = static_cast<double>(text.size()) / 1e6;
  std::printf("text: %s, %.2f MB; %d rounds, interleaved; MB/s on one core (cold: a new tokenizer; warm: the text again)\n",
              argv[4], mb, rounds);
  for (int r = 0; r < rounds; ++r) {
    size_t n1 = 0, n2 = 0;
    double gpt2_cold = 0, gpt2_warm = 0, hf_cold = 0, hf_warm = 0;
    {
      const ds::ByteLevelBpe gpt2(argv[1], argv[2]);
      gpt2_cold = seconds([&] { n1 = gpt2.encode(text).size(); });
      gpt2_warm = seconds([&] { n1 = gpt2.encode(text).size(); });
    }
    {
      const ds::HfTokenizer hf(argv[3]);
      hf_cold = seconds([&] { n2 = hf.encode(text).size(); });
      hf_warm = seconds([&] { n2 = hf.encode(text).size(); });
    }
    std::printf("round %d: gpt2 files %.2f cold / %.2f warm (%zu tokens); tokenizer.json %.2f cold / %.2f warm (%zu tokens)\n", r + 1,
                mb / gpt2_cold, mb / gpt2_warm, n1, mb / hf_cold, mb / hf_warm, n2);
  }
  return 0;
}
