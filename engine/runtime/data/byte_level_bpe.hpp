// ds — byte-level BPE (Radford et al. 2019), the tokenizer model of GPT-2, Llama 3, Qwen 2/2.5/3 and
// most models since: split the text with the model's pre-tokenizer pattern, map each byte of a piece
// to GPT-2's printable stand-in characters, merge adjacent pairs by merge rank, look the pieces up
// in the vocabulary. Read from GPT-2's vocab.json + merges.txt, or from the parts of a Hugging Face
// tokenizer.json (hf_tokenizer.hpp). The patterns are hand-written scanners, not a regex engine:
//   gpt2    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   llama3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   qwen2   llama3's with \p{N} (one digit a piece) for \p{N}{1,3}
// \p{L} and \p{N} are Unicode's general categories (unicode_classes.inc, generated); tokens match GPT-2's
// exactly (the tests compare against an independent port of OpenAI's encoder and a Python reference).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ds {

enum class SplitPattern { gpt2, llama3, qwen2 };

class ByteLevelBpe {
 public:
  // GPT-2's files. Throws UserError naming the file when either cannot be read or parsed.
  ByteLevelBpe(const std::string& vocab_json_path, const std::string& merges_txt_path);

  // A vocabulary and merges already read (from a tokenizer.json). `ignore_merges`: a piece that is a
  // vocabulary entry as a whole is that entry, whatever the merges would make of it (Llama 3's setting).
  struct Parts {
    std::vector<std::pair<std::string, int32_t>> vocab;
    std::vector<std::pair<std::string, std::string>> merges;  // in rank order
    SplitPattern split = SplitPattern::gpt2;
    bool ignore_merges = false;
    std::string source;  // the file, for messages
  };
  explicit ByteLevelBpe(Parts parts);

  std::vector<int32_t> encode(const std::string& utf8) const;
  void encode_into(const std::string& utf8, std::vector<int32_t>& out) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t eot_id() const { return eot_; }  // <|endoftext|>, 50256 in GPT-2
  // The id of a vocabulary entry, or -1.
  int32_t id_of(const std::string& token) const;
  const std::string& token_of(int32_t id) const { return id_to_token_.at(static_cast<size_t>(id)); }
  int64_t token_bytes(int32_t id) const;  // how many bytes of text the token stands for

  // Inconsistencies found between the vocabulary and the merges (e.g. a merge whose result the vocabulary
  // lacks: that merge is dropped so encoding never produces an unknown piece). Empty for GPT-2's files.
  const std::vector<std::string>& warnings() const { return warnings_; }

  // A pre-tokenizer alone (exposed for tests): the pieces BPE then works on.
  static std::vector<std::string> pretokenize(const std::string& utf8, SplitPattern split = SplitPattern::gpt2);

 private:
  void add_vocab(std::vector<std::pair<std::string, int32_t>> vocab, const std::string& source);
  void add_merge(const std::string& left, const std::string& right, int32_t rank, const std::string& source);
  void check_bytes(const std::string& source);  // and notes each byte's token
  void bpe(const std::string& piece, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  struct Merge {
    int32_t rank, id;  // the merge's rank and the token it makes
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> the merge
  std::string byte_to_unicode_[256];            // byte -> its stand-in (UTF-8)
  int32_t byte_ids_[256] = {};                  // byte -> its token
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
  SplitPattern split_ = SplitPattern::gpt2;
  bool ignore_merges_ = false;
  int32_t eot_ = -1;
  std::vector<std::string> warnings_;
};

// UTF-8 helpers shared by the tokenizers: one code point appended; one decoded at s[i] (its byte length
// returned; an invalid byte is one code point, U+FFFD).
void append_utf8(std::string& out, uint32_t cp);
int decode_utf8(const std::string& s, size_t i, uint32_t* cp);
// The start of the code point that ends at s[end - 1], no further back than `floor` (end > floor).
size_t code_point_before(const std::string& s, size_t end, size_t floor);
// True when NFC could change a text holding this code point (or combine it with the one before).
bool nfc_may_change(uint32_t cp);
// Unicode's White_Space property (the regex engines' \s, Rust's char::is_whitespace).
bool is_white_space(uint32_t cp);

}  // namespace ds
