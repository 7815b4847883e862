#include "engine/runtime/data/sentencepiece_model.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "common/error.hpp"
#include "common/files.hpp"
#include "common/format.hpp"
#include "engine/runtime/data/byte_level_bpe.hpp"  // the UTF-8 helpers

namespace ds {
namespace {

// The protocol buffer wire format, as far as ModelProto needs it: varints, 32-bit floats, length-delimited
// strings and messages; fields ds does not read are skipped by their wire type.
class Wire {
 public:
  Wire(const char* begin, const char* end, const std::string& file) : p_(begin), end_(end), file_(file) {}
  bool done() const { return p_ >= end_; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      const uint8_t b = static_cast<uint8_t>(*p_++);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    bad("a varint longer than 10 bytes");
  }
  float fixed32() {
    need(4);
    float f;
    std::memcpy(&f, p_, 4);  // little-endian, as the format writes it
    p_ += 4;
    return f;
  }
  Wire message() {
    const uint64_t n = varint();
    need(n);
    Wire inner(p_, p_ + n, file_);
    p_ += n;
    return inner;
  }
  std::string bytes() {
    Wire inner = message();
    return std::string(inner.p_, inner.end_);
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case 0: varint(); return;
      case 1: need(8), p_ += 8; return;
      case 2: message(); return;
      case 5: need(4), p_ += 4; return;
      default: bad("the wire type " + std::to_string(wire_type));
    }
  }
  [[noreturn]] void bad(const std::string& what) const {
    throw UserError("'" + file_ + "' is not a SentencePiece model: " + what + " in its protocol buffer",
                    "point data.tokenizer_path at the model's directory as published (tokenizer.json, or tokenizer.model)");
  }

 private:
  void need(uint64_t n) const {
    if (static_cast<uint64_t>(end_ - p_) < n) bad("a field that runs past the end");
  }
  const char* p_;
  const char* end_;
  const std::string& file_;
};

// sentencepiece_model.proto's numbers.
enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
enum ModelType { kUnigram = 1, kBpe = 2, kWord = 3, kChar = 4 };

struct Piece {
  std::string text;
  float score = 0;
  int type = kNormal;
};

Piece read_piece(Wire w) {
  Piece p;
  while (!w.done()) {
    const uint64_t tag = w.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 2) p.text = w.bytes();
    else if (field == 2 && wire == 5) p.score = w.fixed32();
    else if (field == 3 && wire == 0) p.type = static_cast<int>(w.varint());
    else w.skip(wire);
  }
  return p;
}

struct Settings {  // the trainer's and the normalizer's, with proto2's defaults where a field is absent
  int model_type = kUnigram;
  bool byte_fallback = false, treat_whitespace_as_suffix = false;
  int64_t bos_id = 1, eos_id = 2;
  std::string normalizer = "", charsmap;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  std::string rule_tsv;
};

void read_trainer(Wire w, Settings& s) {
  while (!w.done()) {
    const uint64_t tag = w.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 3 && wire == 0) s.model_type = static_cast<int>(w.varint());
    else if (field == 35 && wire == 0) s.byte_fallback = w.varint() != 0;
    else if (field == 24 && wire == 0) s.treat_whitespace_as_suffix = w.varint() != 0;
    else if (field == 41 && wire == 0) s.bos_id = static_cast<int32_t>(w.varint());  // -1 (none) is written as 2^64 - 1
    else if (field == 42 && wire == 0) s.eos_id = static_cast<int32_t>(w.varint());
    else w.skip(wire);
  }
}

void read_normalizer(Wire w, Settings& s) {
  while (!w.done()) {
    const uint64_t tag = w.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 2) s.normalizer = w.bytes();
    else if (field == 2 && wire == 2) s.charsmap = w.bytes();
    else if (field == 3 && wire == 0) s.add_dummy_prefix = w.varint() != 0;
    else if (field == 4 && wire == 0) s.remove_extra_whitespaces = w.varint() != 0;
    else if (field == 5 && wire == 0) s.escape_whitespaces = w.varint() != 0;
    else if (field == 6 && wire == 2) s.rule_tsv = w.bytes();
    else w.skip(wire);
  }
}

// Longer pieces than SentencePiece's trainer makes (16 characters by default): every cut of a piece is looked up.
constexpr size_t kMostPieceBytes = 1024;

[[noreturn]] void refuse(const std::string& file, const std::string& what) {
  throw UserError("'" + file + "' is a SentencePiece model ds does not encode exactly: " + what,
                  "ds reads SentencePiece's BPE with the identity normalizer (Llama 2, Mistral); give the model's tokenizer.json, "
                  "or tokenize this data with its own tokenizer into a token file (data.type tokens)");
}

}  // namespace

SentencePieceModel read_sentencepiece_model(const std::string& path) {
  const std::string data = read_file_bytes(path);
  Wire w(data.data(), data.data() + data.size(), path);
  std::vector<Piece> pieces;
  Settings s;
  bool has_normalizer = false;
  while (!w.done()) {
    const uint64_t tag = w.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 2) pieces.push_back(read_piece(w.message()));
    else if (field == 2 && wire == 2) read_trainer(w.message(), s);
    else if (field == 3 && wire == 2) read_normalizer(w.message(), s), has_normalizer = true;
    else w.skip(wire);
  }
  if (pieces.empty()) w.bad("no pieces");
  if (pieces.size() >= (size_t{1} << 24)) refuse(path, format_count(static_cast<int64_t>(pieces.size())) + " pieces (ids stop at 16,777,215)");
  if (s.model_type != kBpe) {
    const char* names[] = {"", "Unigram (T5, ALBERT, XLNet)", "BPE", "Word", "Char"};
    refuse(path, std::string("its model type is ") + (s.model_type >= 1 && s.model_type <= 4 ? names[s.model_type] : "unknown"));
  }
  // The identity normalizer leaves the text as written, but for spaces as '▁' and the '▁' SentencePiece puts first.
  if (has_normalizer && ((s.normalizer != "identity" && !s.normalizer.empty()) || !s.charsmap.empty() || !s.rule_tsv.empty()))
    refuse(path, "its normalizer is '" + s.normalizer + "', which rewrites the text (ds reads 'identity')");
  if (s.remove_extra_whitespaces) refuse(path, "its normalizer removes extra whitespace (remove_extra_whitespaces)");
  if (!s.escape_whitespaces) refuse(path, "its normalizer keeps spaces as spaces (escape_whitespaces false)");
  if (s.treat_whitespace_as_suffix) refuse(path, "it puts '▁' after words (treat_whitespace_as_suffix)");

  SentencePieceModel m;
  m.add_dummy_prefix = s.add_dummy_prefix;
  m.parts.source = path;
  m.parts.byte_fallback = s.byte_fallback;
  m.parts.fuse_unk = true;  // SentencePiece's BPE gives a run of unknown characters one <unk>
  std::unordered_map<std::string, int32_t> normal;  // the pieces merges may build, and their halves
  int64_t specials = 0, byte_pieces = 0;
  for (size_t id = 0; id < pieces.size(); ++id) {
    const Piece& p = pieces[id];
    const int32_t i = static_cast<int32_t>(id);
    m.parts.vocab.emplace_back(p.text, i);
    switch (p.type) {
      case kNormal: normal.emplace(p.text, i); break;
      case kUnknown: m.parts.unk_token = p.text; [[fallthrough]];
      case kControl:
      case kUserDefined:
        if (p.text.empty()) break;
        m.specials.emplace_back(p.text, i);
        ++specials;
        break;
      case kByte: ++byte_pieces; break;
      case kUnused: refuse(path, "it has unused pieces ('" + p.text + "'), which SentencePiece merges into and splits again");
      default: w.bad("the piece type " + std::to_string(p.type));
    }
    if (s.bos_id == i) m.bos_piece = p.text;
    if (s.eos_id == i) m.eos_piece = p.text;
  }
  // SentencePiece starts from characters and merges any two symbols that join into a piece; ds starts from the
  // characters the vocabulary holds (byte fallback for the others), which is the same where every character of a
  // piece is a piece of its own, as BPE training makes it. A vocabulary edited otherwise is refused.
  for (const auto& [text, id] : normal) {
    if (text.size() > kMostPieceBytes)
      refuse(path, "its piece " + std::to_string(id) + " is " + format_count(static_cast<int64_t>(text.size())) + " bytes long (ds reads up to " +
                       format_count(static_cast<int64_t>(kMostPieceBytes)) + ")");
    for (size_t at = 0; at < text.size();) {
      uint32_t cp;
      const size_t len = static_cast<size_t>(decode_utf8(text, at, &cp));
      if (!normal.count(text.substr(at, len)))
        refuse(path, "its piece '" + text + "' holds the character '" + text.substr(at, len) + "', which is not a piece of its own");
      at += len;
    }
  }
  // Rank by score, highest first; equal scores share a rank, so the leftmost pair goes first among them.
  std::vector<float> scores;
  for (const auto& [text, id] : normal) scores.push_back(pieces[static_cast<size_t>(id)].score);
  std::sort(scores.begin(), scores.end(), std::greater<float>());
  scores.erase(std::unique(scores.begin(), scores.end()), scores.end());
  for (const auto& [text, id] : normal) {
    const float score = pieces[static_cast<size_t>(id)].score;
    const int32_t rank = static_cast<int32_t>(std::lower_bound(scores.begin(), scores.end(), score, std::greater<float>()) - scores.begin());
    for (size_t cut = 0; cut < text.size();) {
      uint32_t cp;
      cut += static_cast<size_t>(decode_utf8(text, cut, &cp));
      if (cut >= text.size()) break;
      const std::string left = text.substr(0, cut), right = text.substr(cut);
      if (normal.count(left) && normal.count(right)) {
        m.parts.merges.emplace_back(left, right);
        m.parts.merge_ranks.push_back(rank);
      }
    }
  }
  m.describe = "SentencePiece BPE, " + format_count(static_cast<int64_t>(pieces.size())) + " pieces (" + format_count(specials) +
               " special, " + format_count(byte_pieces) + " bytes)";
  return m;
}

}  // namespace ds
