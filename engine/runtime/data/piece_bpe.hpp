// ds — SentencePiece's BPE as a Hugging Face tokenizer.json holds it (Llama 2, Mistral, Gemma, Phi-3):
// the text's spaces become '▁' (U+2581), each character is a symbol (a character the vocabulary lacks
// becomes its UTF-8 bytes' <0xXX> tokens: byte fallback, or <unk>), then merges apply by rank over the
// whole segment — there is no pre-tokenizer split, so the merging keeps a heap of candidate pairs rather
// than rescanning (a segment is a whole sample). Which normalizer or Metaspace form adds the leading '▁'
// is read by hf_tokenizer.cpp; this class encodes one already-normalized segment.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ds {

class PieceBpe {
 public:
  struct Parts {
    std::vector<std::pair<std::string, int32_t>> vocab;
    std::vector<std::pair<std::string, std::string>> merges;  // in rank order
    std::vector<int32_t> merge_ranks;  // each merge's rank where several share one (SentencePiece's scores); empty: its place
    bool byte_fallback = true;
    std::string unk_token;  // "" when none
    bool fuse_unk = true;
    std::string source;
  };
  explicit PieceBpe(Parts parts);  // UserError when byte fallback lacks a <0xXX> token

  // `lengths` (optional): for each id appended, how many bytes of `normalized` it covers (an <unk> the
  // bytes of the characters it stands for, a <0xXX> one).
  void encode_into(const std::string& normalized, std::vector<int32_t>& out, std::vector<int32_t>* lengths = nullptr) const;
  // Text of the ids: '▁' back to spaces, <0xXX> runs back to their bytes.
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t id_of(const std::string& token) const;

 private:
  struct Merge {
    int32_t rank, id;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t byte_ids_[256];
  bool byte_fallback_ = true, fuse_unk_ = true;
  int32_t unk_ = -1;
  std::vector<int16_t> byte_of_id_;  // -1, or the byte a <0xXX> token stands for
};

}  // namespace ds
