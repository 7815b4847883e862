#include "engine/runtime/data/byte_level_bpe.hpp"

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>

#include "common/error.hpp"

namespace ds {

// ---- UTF-8 ----------------------------------------------------------------------------------

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

int decode_utf8(const std::string& s, size_t i, uint32_t* cp) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) {
    *cp = 0xFFFD;
    return 1;
  }
  uint32_t v = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < len; ++k) {
    const unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc >> 6) != 2) {
      *cp = 0xFFFD;
      return 1;
    }
    v = (v << 6) | (cc & 0x3F);
  }
  *cp = v;
  return len;
}

size_t code_point_before(const std::string& s, size_t end, size_t floor) {
  size_t start = end - 1;  // continuation bytes are 10xxxxxx
  while (start > floor && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return start;
}

namespace {

// ---- Unicode classes for the pre-tokenizer --------------------------------------------------

#include "engine/runtime/data/unicode_classes.inc"

// `\s`: Unicode's White_Space property (what the regex engines of OpenAI's and Hugging Face's tokenizers
// match; not Python's str.isspace, which adds U+001C..U+001F).
bool is_space(uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

template <size_t N>
bool in_ranges(uint32_t c, const uint32_t (&ranges)[N][2]) {
  size_t lo = 0, hi = N;  // the first range whose end is >= c
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (ranges[mid][1] < c) lo = mid + 1;
    else hi = mid;
  }
  return lo < N && ranges[lo][0] <= c;
}

enum class CharClass { space, letter, number, other };

CharClass classify(uint32_t c) {
  if (is_space(c)) return CharClass::space;
  if (c < 0x80) {
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return CharClass::letter;
    return c >= '0' && c <= '9' ? CharClass::number : CharClass::other;
  }
  if (in_ranges(c, kLetterRanges)) return CharClass::letter;
  return in_ranges(c, kNumberRanges) ? CharClass::number : CharClass::other;
}

std::string slurp(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(std::string("cannot read the GPT-2 ") + what + " '" + path + "'",
                          "point data.vocab_file / data.merges_file at GPT-2's vocab.json and merges.txt");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// vocab.json is one flat object of string -> integer; a dedicated reader keeps JSON libraries out of
// the runtime (only schema/ parses configs).
std::vector<std::pair<std::string, int32_t>> parse_vocab(const std::string& text, const std::string& path) {
  std::vector<std::pair<std::string, int32_t>> out;
  size_t i = 0;
  auto fail = [&](const char* why) {
    throw UserError("'" + path + "' is not a GPT-2 vocab.json (" + why + " at byte " + std::to_string(i) + ")",
                    "it must be one JSON object mapping token strings to ids");
  };
  auto skip_ws = [&] {
    while (i < text.size() && (text[i] == ' ' || text[i] == '\n' || text[i] == '\r' || text[i] == '\t')) ++i;
  };
  skip_ws();
  if (i >= text.size() || text[i] != '{') fail("no opening brace");
  ++i;
  while (true) {
    skip_ws();
    if (i < text.size() && text[i] == '}') break;
    if (i >= text.size() || text[i] != '"') fail("expected a string key");
    ++i;
    std::string key;
    while (i < text.size() && text[i] != '"') {
      if (text[i] == '\\') {
        if (++i >= text.size()) fail("truncated escape");
        const char e = text[i++];
        switch (e) {
          case '"': key += '"'; break;
          case '\\': key += '\\'; break;
          case '/': key += '/'; break;
          case 'b': key += '\b'; break;
          case 'f': key += '\f'; break;
          case 'n': key += '\n'; break;
          case 'r': key += '\r'; break;
          case 't': key += '\t'; break;
          case 'u': {
            auto hex4 = [&]() -> uint32_t {
              if (i + 4 > text.size()) fail("truncated \\u escape");
              uint32_t v = 0;
              for (int k = 0; k < 4; ++k) {  // exactly four hex digits
                const char h = text[i++];
                const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                if (d < 0) fail("bad \\u escape (four hex digits expected)");
                v = v * 16 + static_cast<uint32_t>(d);
              }
              return v;
            };
            uint32_t cp = hex4();
            if (cp >= 0xD800 && cp <= 0xDBFF && i + 1 < text.size() && text[i] == '\\' && text[i + 1] == 'u') {
              i += 2;
              const uint32_t lo = hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) fail("a high surrogate without its low half");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            append_utf8(key, cp);
            break;
          }
          default: fail("unknown escape");
        }
      } else {
        key += text[i++];
      }
    }
    if (i >= text.size()) fail("unterminated string");
    ++i;
    skip_ws();
    if (i >= text.size() || text[i] != ':') fail("expected ':'");
    ++i;
    skip_ws();
    // An id: digits only, below the largest vocabulary ds accepts (2^24; ids index a table).
    int64_t id = 0;
    const size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      id = id * 10 + (text[i++] - '0');
      if (id >= (int64_t{1} << 24)) fail("token id too large (ids are below 16,777,216)");
    }
    if (start == i) fail("expected a non-negative integer id");
    out.emplace_back(std::move(key), static_cast<int32_t>(id));
    skip_ws();
    if (i < text.size() && text[i] == ',') {
      ++i;
      continue;
    }
    if (i < text.size() && text[i] == '}') break;
    fail("expected ',' or '}'");
  }
  return out;
}

}  // namespace

bool nfc_may_change(uint32_t cp) { return cp >= 0x300 && in_ranges(cp, kNfcUnstableRanges); }

bool is_white_space(uint32_t cp) { return is_space(cp); }

namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes map to
// U+0100 onwards in byte order, so every byte has a visible, whitespace-free stand-in.
void byte_stand_ins(std::string (&to)[256], std::unordered_map<std::string, uint8_t>& from) {
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    std::string s;
    append_utf8(s, printable ? static_cast<uint32_t>(b) : 256u + next++);
    to[b] = s;
    from[s] = static_cast<uint8_t>(b);
  }
}

}  // namespace

void ByteLevelBpe::add_vocab(std::vector<std::pair<std::string, int32_t>> vocab, const std::string& source) {
  for (auto& [tok, id] : vocab) {
    if (id < 0 || id >= (int32_t{1} << 24))
      throw UserError("'" + source + "' gives '" + tok + "' the id " + std::to_string(id),
                      "token ids are from 0 to 16,777,215");
    if (static_cast<size_t>(id) >= id_to_token_.size()) id_to_token_.resize(id + 1);
    id_to_token_[id] = tok;
    if (tok == "<|endoftext|>") eot_ = id;
    token_to_id_[tok] = id;
  }
}

void ByteLevelBpe::add_merge(const std::string& left, const std::string& right, int32_t rank, const std::string& source) {
  const std::string merged = left + right;
  if (!token_to_id_.count(merged)) {
    warnings_.push_back(source + ": merge '" + left + " " + right + "' makes '" + merged +
                        "', which the vocabulary lacks; the merge is dropped (these are not the model's exact files)");
    return;
  }
  auto l = token_to_id_.find(left), r = token_to_id_.find(right);
  if (l == token_to_id_.end() || r == token_to_id_.end()) return;  // never met: BPE's pieces are vocabulary entries
  merges_[pair_key(l->second, r->second)] = Merge{rank, token_to_id_.at(merged)};  // a repeated pair: the last wins, as in HF
}

void ByteLevelBpe::check_bytes(const std::string& source) {
  for (int b = 0; b < 256; ++b)
    if (!token_to_id_.count(byte_to_unicode_[b]))
      throw UserError("'" + source + "' has no token for byte " + std::to_string(b),
                      "a byte-level BPE vocabulary must contain all 256 single-byte tokens");
  for (int b = 0; b < 256; ++b) byte_ids_[b] = token_to_id_.at(byte_to_unicode_[b]);
}

ByteLevelBpe::ByteLevelBpe(const std::string& vocab_path, const std::string& merges_path) {
  byte_stand_ins(byte_to_unicode_, unicode_to_byte_);
  add_vocab(parse_vocab(slurp(vocab_path, "vocab"), vocab_path), vocab_path);
  std::istringstream merges(slurp(merges_path, "merges"));
  std::string line;
  int32_t rank = 0;
  while (std::getline(merges, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos)
      throw UserError("'" + merges_path + "' line " + std::to_string(rank + 2) + " is not a merge pair: '" + line + "'",
                      "merges.txt holds one 'left right' pair per line");
    add_merge(line.substr(0, sp), line.substr(sp + 1), rank++, merges_path);
  }
  check_bytes(vocab_path);
  if (id_to_token_.size() != token_to_id_.size())
    warnings_.push_back(vocab_path + ": ids are not contiguous (" + std::to_string(token_to_id_.size()) + " tokens, largest id " +
                        std::to_string(id_to_token_.size() - 1) + ")");
}

ByteLevelBpe::ByteLevelBpe(Parts parts) : split_(parts.split), ignore_merges_(parts.ignore_merges) {
  byte_stand_ins(byte_to_unicode_, unicode_to_byte_);
  add_vocab(std::move(parts.vocab), parts.source);
  int32_t rank = 0;
  for (const auto& [left, right] : parts.merges) add_merge(left, right, rank++, parts.source);
  check_bytes(parts.source);
}

int64_t ByteLevelBpe::token_bytes(int32_t id) const {
  const std::string& token = token_of(id);  // one stand-in character per byte
  int64_t n = 0;
  for (size_t i = 0; i < token.size(); ++n) {
    uint32_t cp;
    i += static_cast<size_t>(decode_utf8(token, i, &cp));
  }
  return n;
}

int32_t ByteLevelBpe::id_of(const std::string& token) const {
  auto it = token_to_id_.find(token);
  return it == token_to_id_.end() ? -1 : it->second;
}

namespace {

struct Scan {
  std::vector<uint32_t> cps;
  std::vector<size_t> offs;  // byte offset of each code point, and the text's end
  std::vector<CharClass> cls;
  explicit Scan(const std::string& s) {
    for (size_t i = 0; i < s.size();) {
      uint32_t cp;
      const int len = decode_utf8(s, i, &cp);
      cps.push_back(cp);
      offs.push_back(i);
      cls.push_back(classify(cp));
      i += len;
    }
    offs.push_back(s.size());
  }
  size_t size() const { return cps.size(); }
  bool newline(size_t k) const { return cps[k] == '\r' || cps[k] == '\n'; }
  size_t run(size_t k, CharClass c, size_t most = SIZE_MAX) const {  // the end of a run of class c from k
    const size_t start = k;
    while (k < size() && cls[k] == c && k - start < most) ++k;
    return k;
  }
};

// 's 't 're 've 'm 'll 'd at i: their length, else 0. Case-insensitive in the llama3/qwen2 patterns, with
// Unicode's simple case folding as the regex engines apply it (the long s, U+017F, folds to s).
size_t contraction(const Scan& t, size_t i, bool any_case) {
  if (t.cps[i] != '\'' || i + 1 >= t.size()) return 0;
  auto low = [&](size_t k) -> uint32_t {
    if (k >= t.size()) return 0;
    if (!any_case) return t.cps[k];
    if (t.cps[k] == 0x17F) return 's';
    return t.cps[k] >= 'A' && t.cps[k] <= 'Z' ? (t.cps[k] | 0x20) : t.cps[k];
  };
  const uint32_t a = low(i + 1), b = low(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// `\s+(?!\S)` then `\s+`: a whitespace run, leaving its last character to the next word when one follows.
size_t trailing_space(const Scan& t, size_t i) {
  size_t k = t.run(i, CharClass::space);
  if (k < t.size() && k - i > 1) k -= 1;
  return k;
}

// GPT-2's pattern: the end of the piece that starts at i.
size_t gpt2_piece(const Scan& t, size_t i) {
  if (size_t len = contraction(t, i, false)) return i + len;
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional single space, then a run of one class.
  size_t j = i;
  if (t.cps[j] == ' ' && j + 1 < t.size() && t.cls[j + 1] != CharClass::space) ++j;
  if (t.cls[j] != CharClass::space) return t.run(j, t.cls[j]);
  return trailing_space(t, i);
}

// Llama 3's (and Qwen 2's, digits one at a time) pattern: the end of the piece that starts at i.
size_t llama3_piece(const Scan& t, size_t i, size_t digits) {
  const size_t n = t.size();
  if (size_t len = contraction(t, i, true)) return i + len;
  // `[^\r\n\p{L}\p{N}]?\p{L}+`: one optional character that is no newline, letter or number, then letters.
  if (t.cls[i] == CharClass::letter) return t.run(i, CharClass::letter);
  if (t.cls[i] != CharClass::number && !t.newline(i) && i + 1 < n && t.cls[i + 1] == CharClass::letter)
    return t.run(i + 1, CharClass::letter);
  if (t.cls[i] == CharClass::number) return t.run(i, CharClass::number, digits);  // `\p{N}{1,3}`
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t j = i + (t.cps[i] == ' ' && i + 1 < n && t.cls[i + 1] == CharClass::other ? 1 : 0);
  if (t.cls[j] == CharClass::other) {
    j = t.run(j, CharClass::other);
    while (j < n && t.newline(j)) ++j;
    return j;
  }
  // `\s*[\r\n]+`: the whitespace run up to and including its last newline, when it has one.
  const size_t end = t.run(i, CharClass::space);
  for (size_t k = end; k > i; --k)
    if (t.newline(k - 1)) return k;
  return trailing_space(t, i);
}

}  // namespace

namespace {

// Calls f(begin, end) with the byte range of each piece of `s`, in order.
template <typename F>
void for_each_piece(const std::string& s, SplitPattern split, F&& f) {
  const Scan t(s);
  for (size_t i = 0; i < t.size();) {
    const size_t end = split == SplitPattern::gpt2     ? gpt2_piece(t, i)
                       : split == SplitPattern::llama3 ? llama3_piece(t, i, 3)
                                                       : llama3_piece(t, i, 1);
    f(t.offs[i], t.offs[end]);
    i = end;
  }
}

}  // namespace

std::vector<std::string> ByteLevelBpe::pretokenize(const std::string& s, SplitPattern split) {
  std::vector<std::string> out;
  for_each_piece(s, split, [&](size_t a, size_t b) { out.push_back(s.substr(a, b - a)); });
  return out;
}

void ByteLevelBpe::bpe(const std::string& piece, std::vector<int32_t>& out) const {
  auto hit = cache_.find(piece);
  if (hit != cache_.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<int32_t> ids;
  ids.reserve(piece.size());
  for (unsigned char b : piece) ids.push_back(byte_ids_[b]);
  if (ignore_merges_ && ids.size() > 1) {
    std::string whole;
    for (unsigned char b : piece) whole += byte_to_unicode_[b];
    auto it = token_to_id_.find(whole);
    if (it != token_to_id_.end()) ids = {it->second};
  }
  std::vector<int32_t> merged;
  while (ids.size() > 1) {
    Merge best{INT_MAX, -1};
    for (size_t k = 0; k + 1 < ids.size(); ++k) {
      auto it = merges_.find(pair_key(ids[k], ids[k + 1]));
      if (it != merges_.end() && it->second.rank < best.rank) best = it->second;
    }
    if (best.rank == INT_MAX) break;
    // Merge every occurrence of the best pair, left to right, as GPT-2 does.
    merged.clear();
    for (size_t k = 0; k < ids.size();) {
      if (k + 1 < ids.size() && merges_.count(pair_key(ids[k], ids[k + 1])) &&
          merges_.at(pair_key(ids[k], ids[k + 1])).rank == best.rank) {
        merged.push_back(best.id);
        k += 2;
      } else {
        merged.push_back(ids[k++]);
      }
    }
    ids.swap(merged);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache_.size() < (1u << 20)) cache_.emplace(piece, std::move(ids));
}

void ByteLevelBpe::encode_into(const std::string& text, std::vector<int32_t>& out) const {
  std::string piece;  // reused: most pieces fit its buffer
  for_each_piece(text, split_, [&](size_t a, size_t b) {
    piece.assign(text, a, b - a);
    bpe(piece, out);
  });
}

std::vector<int32_t> ByteLevelBpe::encode(const std::string& text) const {
  std::vector<int32_t> ids;
  encode_into(text, ids);
  return ids;
}

std::string ByteLevelBpe::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) continue;
    const std::string& tok = id_to_token_[id];
    for (size_t i = 0; i < tok.size();) {
      uint32_t cp;
      const int len = decode_utf8(tok, i, &cp);
      auto it = unicode_to_byte_.find(tok.substr(i, len));
      if (it != unicode_to_byte_.end()) out += static_cast<char>(it->second);
      else out += tok.substr(i, len);  // special tokens such as <|endoftext|> are plain text
      i += len;
    }
  }
  return out;
}

}  // namespace ds
