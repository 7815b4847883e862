// ds — a Hugging Face tokenizer as its model directory holds it: tokenizer.json (the model, the
// pre-tokenizer, the added tokens, the post-processor) and tokenizer_config.json (BOS/EOS/pad tokens,
// the chat template; or chat_template.jinja beside it). ds reads the byte-level BPE tokenizers (GPT-2,
// Llama 3, Qwen 2/2.5/3 and their descendants) with the split patterns byte_level_bpe.hpp names, and
// SentencePiece's BPE with byte fallback (Llama 2, Mistral, Phi-3; piece_bpe.hpp) in its legacy-normalizer
// and Metaspace forms. A directory with no tokenizer.json is read from SentencePiece's own tokenizer.model
// (sentencepiece_model.hpp): each text between its special pieces encoded as SentencePiece encodes a text, as
// Hugging Face's Llama tokenizers do (legacy; "legacy": false in tokenizer_config.json puts the '▁' before the
// text's start only), its BOS before a text unless add_bos_token is false. Anything else (another model type, a pattern or normalizer ds does not know) is
// refused naming what the file says, never approximated.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/runtime/data/byte_level_bpe.hpp"
#include "engine/runtime/data/piece_bpe.hpp"

namespace ds {

class HfTokenizer {
 public:
  // `path`: a tokenizer.json, a directory holding one (or, without one, a tokenizer.model), or a tokenizer.model. UserError naming the file and the key when it
  // cannot be read or describes a tokenizer ds does not implement.
  explicit HfTokenizer(const std::string& path);

  // Text to ids. Added tokens written in the text (special ones included, as Hugging Face's tokenizers do
  // by default) become their ids; the rest is byte-level BPE. `add_special_tokens`: the post-processor's
  // tokens around the text (Llama 3's <|begin_of_text|>), as tokenizer(text) gives them.
  // `lengths` (optional): for each id, how many bytes of `text` it stands for (an added token its content; a
  // BOS the post-processor adds none), so spans of the text map to tokens exactly.
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens = false, std::vector<int32_t>* lengths = nullptr) const;
  std::string decode(const std::vector<int32_t>& ids) const;

  // The post-processor's tokens before a text (Llama 3's <|begin_of_text|>).
  const std::vector<int32_t>& prefix_ids() const { return prefix_ids_; }
  int32_t vocab_size() const { return vocab_size_; }  // the largest id + 1, added tokens included
  int32_t id_of(const std::string& token) const;      // a vocabulary entry or an added token; -1 if neither
  int32_t bos_id() const { return bos_; }              // -1 when tokenizer_config.json names none
  int32_t eos_id() const { return eos_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  const std::string& chat_template() const { return chat_template_; }  // "" when none
  const std::string& path() const { return path_; }
  std::string describe() const;  // "tokenizer.json: byte-level BPE (llama3 pattern), 128,256 ids, 256 added tokens"

  // Texts that tokenizer.json's NFC normalizer would change, which ds tokenizes as written (it does not
  // compose characters): counted so the data reader can say how many samples it touched.
  int64_t texts_not_normalized() const { return not_normalized_; }
  const std::vector<std::string>& warnings() const;

 private:
  void load(const std::string& where);
  void load_sentencepiece(const std::string& file, const std::string& dir);
  ByteLevelBpe::Parts read_model(const nlohmann::json& model) const;
  void read_pre_tokenizer(const nlohmann::json& pre);
  void read_added_tokens(const nlohmann::json& added);
  void read_post_processor(const nlohmann::json& post);
  void read_config(const std::string& dir);
  void read_vocab_merges(const nlohmann::json& m, std::vector<std::pair<std::string, int32_t>>& vocab,
                         std::vector<std::pair<std::string, std::string>>& merges) const;
  PieceBpe::Parts read_piece_model(const nlohmann::json& model) const;
  void read_piece_setup(const nlohmann::json& normalizer, const nlohmann::json& pre_tokenizer);
  void split_added(const std::string& text, std::vector<int32_t>& out, std::vector<int32_t>* lengths) const;
  void encode_plain(const std::string& segment, bool starts_text, std::vector<int32_t>& out, std::vector<int32_t>* lengths) const;

  std::string path_;
  std::unique_ptr<ByteLevelBpe> bpe_;  // one of the two models
  std::unique_ptr<PieceBpe> piece_;
  enum class PiecePrepend { none, always, unless_there, first_unless_there };
  PiecePrepend piece_prepend_ = PiecePrepend::none;
  SplitPattern split_ = SplitPattern::gpt2;
  bool nfc_ = false;
  struct Added {
    std::string content;
    int32_t id;
    bool lstrip, rstrip;  // the token takes the whitespace before / after it in the text
  };
  void add_token(Added a);  // matched in the text before the model sees it
  void sort_added();       // longest first, once all are in
  std::vector<std::vector<Added>> added_by_first_byte_ = std::vector<std::vector<Added>>(256);  // longest first
  std::unordered_map<int32_t, std::string> added_by_id_;
  std::vector<int32_t> prefix_ids_, suffix_ids_;  // the post-processor's, for add_special_tokens
  int32_t vocab_size_ = 0, bos_ = -1, eos_ = -1;
  std::string bos_token_, eos_token_, chat_template_;
  std::string model_described_;  // tokenizer.model's own description ("" for tokenizer.json)
  mutable std::atomic<int64_t> not_normalized_{0};  // counted by const encode calls (not thread-safe as a whole: the BPE's cache)
};

}  // namespace ds
