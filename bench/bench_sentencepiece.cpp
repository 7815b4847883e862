// How fast ds encodes with a SentencePiece tokenizer.model (read by ds itself: sentencepiece_model.hpp into
// PieceBpe) against the SentencePiece library on the same model and text, line by line as jsonl samples come,
// on one core, in one run, interleaved; every line's ids compared. The model is trained here by the library
// (BPE, byte fallback, the identity normalizer: Llama 2's settings) on the text itself.
// Usage: bench_sentencepiece TEXT_FILE [ROUNDS] [VOCAB_SIZE]
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/runtime/data/hf_tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TEXT_FILE [ROUNDS] [VOCAB_SIZE]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string vocab = argc > 3 ? argv[3] : "8000";
  std::ifstream in(argv[1], std::ios::binary);
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (std::string line; std::getline(in, line);) bytes += line.size(), lines.push_back(line);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ds_bench_spm_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      std::string("--input=") + argv[1] + " --model_prefix=" + (dir / "tokenizer").string() + " --vocab_size=" + vocab +
      " --model_type=bpe --byte_fallback=true --normalization_rule_name=identity --remove_extra_whitespaces=false "
      "--add_dummy_prefix=true --split_digits=true --allow_whitespace_only_pieces=true --max_sentence_length=100000 --minloglevel=2 "
      "--num_threads=2");
  if (!status.ok()) {
    std::fprintf(stderr, "training failed: %s\n", status.ToString().c_str());
    return 1;
  }
  sentencepiece::SentencePieceProcessor lib;
  if (!lib.Load((dir / "tokenizer.model").string()).ok()) return 1;
  const ds::HfTokenizer tok(dir.string());
  std::printf("%s: %zu lines, %.2f MB; %s\n", argv[1], lines.size(), static_cast<double>(bytes) / 1e6, tok.describe().c_str());
  size_t differ = 0;
  for (int r = 0; r < rounds; ++r) {
    std::vector<std::vector<int32_t>> ours(lines.size());
    std::vector<std::vector<int>> theirs(lines.size());
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < lines.size(); ++i) ours[i] = tok.encode(lines[i]);
    auto t1 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < lines.size(); ++i) lib.Encode(lines[i], &theirs[i]).IgnoreError();
    auto t2 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < lines.size(); ++i) differ += std::vector<int32_t>(theirs[i].begin(), theirs[i].end()) != ours[i];
    const double a = std::chrono::duration<double>(t1 - t0).count(), b = std::chrono::duration<double>(t2 - t1).count();
    std::printf("round %d: ds %.2f MB/s, libsentencepiece %.2f MB/s (ds %.2fx)\n", r + 1, static_cast<double>(bytes) / 1e6 / a,
                static_cast<double>(bytes) / 1e6 / b, b / a);
  }
  std::printf("lines whose ids differ: %zu of %zu\n", differ, lines.size() * static_cast<size_t>(rounds));
  std::filesystem::remove_all(dir);
  return differ == 0 ? 0 : 1;
}
