// ds — GPT-2's byte-level BPE tokenizer (Radford et al. 2019; the original encoder.py), reading the
// real vocab.json and merges.txt. Tokens match GPT-2's exactly: the tests compare against an
// independent port of OpenAI's encoder. Steps: split text with GPT-2's pre-tokenizer pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (a hand-written scanner, not a regex engine), map each byte to GPT-2's printable stand-in
// characters, merge adjacent pairs by merge rank, look the pieces up in the vocabulary.
// Unicode letter/number classes come from range tables: exact for ASCII, Latin-1, Latin Extended,
// Greek, Cyrillic, CJK and emoji; other scripts follow the general rule (non-space, non-symbol =
// letter) and may differ from GPT-2 on rare characters.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace ds {

class Gpt2Tokenizer {
 public:
  // Throws UserError naming the file when either cannot be read or parsed.
  Gpt2Tokenizer(const std::string& vocab_json_path, const std::string& merges_txt_path);

  std::vector<int32_t> encode(const std::string& utf8) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t eot_id() const { return eot_; }  // <|endoftext|>, 50256 in GPT-2

  // Inconsistencies found between vocab.json and merges.txt (e.g. a merge whose result the vocabulary
  // lacks: that merge is dropped so encoding never produces an unknown piece). Empty for GPT-2's files.
  const std::vector<std::string>& warnings() const { return warnings_; }

  // GPT-2's pre-tokenizer alone (exposed for tests): the pieces BPE then works on.
  static std::vector<std::string> pretokenize(const std::string& utf8);

 private:
  void bpe(const std::string& piece, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // "a b" -> rank
  std::string byte_to_unicode_[256];                     // byte -> its stand-in (UTF-8)
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
  int32_t eot_ = -1;
  std::vector<std::string> warnings_;
};

}  // namespace ds
