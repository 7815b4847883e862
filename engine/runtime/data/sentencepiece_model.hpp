// ds — SentencePiece's own model file (tokenizer.model), for a model directory that has no tokenizer.json
// (Llama 2 and Mistral derivatives as first published). The file is a protocol buffer (ModelProto): its pieces
// with their scores and types, the trainer's settings (the model type, byte fallback, the special pieces) and
// the normalizer's. ds reads it without the library: SentencePiece's BPE merges, at each step, the adjacent pair
// whose joined piece scores highest (the leftmost among equals), which is PieceBpe's merge by rank once every
// way of splitting a piece into two pieces is a merge ranked by that piece's score. Unigram models and
// normalizers that rewrite text (nmt_nfkc and the like) are refused, naming what the file holds.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/runtime/data/piece_bpe.hpp"

namespace ds {

struct SentencePieceModel {
  PieceBpe::Parts parts;  // every piece at its id; merges ranked by the joined piece's score (equal scores: equal ranks)
  // Control, unknown and user-defined pieces: matched whole in a text before the rest is encoded, as Hugging Face's
  // tokenizers made from this file do (SentencePiece itself matches user-defined pieces inside one text, so the '▁'
  // it puts first differs next to them; it never yields control pieces from text).
  std::vector<std::pair<std::string, int32_t>> specials;
  bool add_dummy_prefix = true;  // a '▁' before the text, as SentencePiece adds it
  std::string bos_piece, eos_piece;  // "" when the model has none
  std::string describe;  // "SentencePiece BPE, 32,000 pieces (3 special, 256 bytes)"
};

// UserError naming the file and what it holds when it is not a SentencePiece BPE model ds encodes exactly.
SentencePieceModel read_sentencepiece_model(const std::string& path);

}  // namespace ds
