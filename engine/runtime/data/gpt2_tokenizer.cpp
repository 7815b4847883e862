#include "engine/runtime/data/gpt2_tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>

#include "common/error.hpp"

namespace ds {
namespace {

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

// Decodes one code point at s[i]; returns its byte length (invalid bytes count as one code point each,
// U+FFFD, so every byte still reaches BPE).
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

// ---- Unicode classes for the pre-tokenizer --------------------------------------------------

bool is_space(uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool in_ranges(uint32_t c, const uint32_t (*ranges)[2], size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (c >= ranges[i][0] && c <= ranges[i][1]) return true;
  return false;
}

bool is_number(uint32_t c) {
  static const uint32_t ranges[][2] = {
      {0x30, 0x39},     {0xB2, 0xB3},     {0xB9, 0xB9},     {0xBC, 0xBE},     {0x660, 0x669},   {0x6F0, 0x6F9},
      {0x966, 0x96F},   {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2189}, {0x2460, 0x249B},
      {0x24EA, 0x24FF}, {0x2776, 0x2793}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0xFF10, 0xFF19}};
  return in_ranges(c, ranges, sizeof ranges / sizeof ranges[0]);
}

// Non-ASCII code points that are neither letters nor numbers (punctuation, symbols, marks of
// common blocks). Everything else outside ASCII that is not space or number counts as a letter.
bool is_non_letter_symbol(uint32_t c) {
  static const uint32_t ranges[][2] = {
      {0xA1, 0xA9},     {0xAB, 0xB1},     {0xB4, 0xB4},     {0xB6, 0xB8},     {0xBB, 0xBB},     {0xBF, 0xBF},
      {0xD7, 0xD7},     {0xF7, 0xF7},     {0x2C2, 0x2C5},   {0x2D2, 0x2DF},   {0x2E5, 0x2EB},   {0x2ED, 0x2ED},
      {0x2EF, 0x2FF},   {0x300, 0x36F},   {0x375, 0x375},   {0x37E, 0x37E},   {0x384, 0x385},   {0x387, 0x387},
      {0x482, 0x489},   {0x55A, 0x55F},   {0x589, 0x58A},   {0x5BE, 0x5BE},   {0x5C0, 0x5C0},   {0x5C3, 0x5C3},
      {0x5F3, 0x5F4},   {0x60C, 0x60D},   {0x61B, 0x61F},   {0x66A, 0x66D},   {0x6D4, 0x6D4},   {0x964, 0x965},
      {0x2010, 0x2027}, {0x2030, 0x205E}, {0x20A0, 0x20CF}, {0x20D0, 0x20FF}, {0x2100, 0x2101}, {0x2103, 0x2106},
      {0x2108, 0x2109}, {0x2114, 0x2114}, {0x2116, 0x2118}, {0x211E, 0x2123}, {0x2125, 0x2125}, {0x2127, 0x2127},
      {0x2129, 0x2129}, {0x212E, 0x212E}, {0x2190, 0x245F}, {0x249C, 0x24E9}, {0x2500, 0x2775}, {0x2794, 0x2BFF},
      {0x2E00, 0x2E7F}, {0x3001, 0x3004}, {0x3008, 0x3020}, {0x3030, 0x3030}, {0x303D, 0x303F}, {0x309B, 0x309C},
      {0x30A0, 0x30A0}, {0x30FB, 0x30FB}, {0xFE10, 0xFE6F}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF20}, {0xFF3B, 0xFF40},
      {0xFF5B, 0xFF65}, {0xFFE0, 0xFFEE}, {0xFFFC, 0xFFFD}, {0x1F000, 0x1FAFF}, {0xE0000, 0xE007F}};
  return in_ranges(c, ranges, sizeof ranges / sizeof ranges[0]);
}

enum class CharClass { space, letter, number, other };

CharClass classify(uint32_t c) {
  if (is_space(c)) return CharClass::space;
  if (is_number(c)) return CharClass::number;
  if (c < 0x80) return ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') ? CharClass::letter : CharClass::other;
  if (c == 0xAA || c == 0xB5 || c == 0xBA) return CharClass::letter;
  return is_non_letter_symbol(c) ? CharClass::other : CharClass::letter;
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

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& vocab_path, const std::string& merges_path) {
  // GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes map to
  // U+0100 onwards in byte order, so every byte has a visible, whitespace-free stand-in.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    std::string s;
    append_utf8(s, printable ? static_cast<uint32_t>(b) : 256u + next++);
    byte_to_unicode_[b] = s;
    unicode_to_byte_[s] = static_cast<uint8_t>(b);
  }
  for (auto& [tok, id] : parse_vocab(slurp(vocab_path, "vocab"), vocab_path)) {
    if (id < 0) throw UserError("'" + vocab_path + "' has a negative id for '" + tok + "'", "");
    if (static_cast<size_t>(id) >= id_to_token_.size()) id_to_token_.resize(id + 1);
    id_to_token_[id] = tok;
    if (tok == "<|endoftext|>") eot_ = id;
    token_to_id_[tok] = id;
  }
  std::istringstream merges(slurp(merges_path, "merges"));
  std::string line;
  int32_t rank = 0;
  while (std::getline(merges, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    if (line.find(' ') == std::string::npos)
      throw UserError("'" + merges_path + "' line " + std::to_string(rank + 2) + " is not a merge pair: '" + line + "'",
                      "merges.txt holds one 'left right' pair per line");
    const size_t sp = line.find(' ');
    const std::string merged = line.substr(0, sp) + line.substr(sp + 1);
    if (!token_to_id_.count(merged)) {
      warnings_.push_back(merges_path + ": merge '" + line + "' makes '" + merged + "', which " + vocab_path +
                          " lacks; the merge is dropped (these are not GPT-2's exact files)");
      ++rank;
      continue;
    }
    merge_rank_.emplace(line, rank++);
  }
  for (int b = 0; b < 256; ++b)
    if (!token_to_id_.count(byte_to_unicode_[b]))
      throw UserError("'" + vocab_path + "' has no token for byte " + std::to_string(b),
                      "a byte-level BPE vocabulary must contain all 256 single-byte tokens");
  if (id_to_token_.size() != token_to_id_.size())
    warnings_.push_back(vocab_path + ": ids are not contiguous (" + std::to_string(token_to_id_.size()) + " tokens, largest id " +
                        std::to_string(id_to_token_.size() - 1) + ")");
}

std::vector<std::string> Gpt2Tokenizer::pretokenize(const std::string& s) {
  // Code points and their classes once, then the pattern's alternatives in order at each position.
  std::vector<uint32_t> cps;
  std::vector<size_t> offs;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const int len = decode_utf8(s, i, &cp);
    cps.push_back(cp);
    offs.push_back(i);
    i += len;
  }
  offs.push_back(s.size());
  const size_t n = cps.size();
  std::vector<CharClass> cls(n);
  for (size_t k = 0; k < n; ++k) cls[k] = classify(cps[k]);
  std::vector<std::string> out;
  auto emit = [&](size_t a, size_t b) { out.push_back(s.substr(offs[a], offs[b] - offs[a])); };
  size_t i = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd (case-sensitive, as in GPT-2)
    if (cps[i] == '\'' && i + 1 < n) {
      const uint32_t a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional single space, then a run of one class.
    const size_t start = i;
    size_t j = i;
    if (cps[j] == ' ' && j + 1 < n && cls[j + 1] != CharClass::space) ++j;
    if (cls[j] != CharClass::space) {
      const CharClass c = cls[j];
      while (j < n && cls[j] == c) ++j;
      emit(start, j);
      i = j;
      continue;
    }
    // `\s+(?!\S)` then `\s+`: a whitespace run, leaving its last character to the next word when one follows.
    size_t k = i;
    while (k < n && cls[k] == CharClass::space) ++k;
    if (k < n && k - i > 1) k -= 1;
    emit(i, k);
    i = k;
  }
  return out;
}

void Gpt2Tokenizer::bpe(const std::string& piece, std::vector<int32_t>& out) const {
  auto hit = cache_.find(piece);
  if (hit != cache_.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<std::string> parts;
  for (unsigned char b : piece) parts.push_back(byte_to_unicode_[b]);
  while (parts.size() > 1) {
    int32_t best = INT_MAX;
    size_t at = 0;
    for (size_t k = 0; k + 1 < parts.size(); ++k) {
      auto it = merge_rank_.find(parts[k] + " " + parts[k + 1]);
      if (it != merge_rank_.end() && it->second < best) best = it->second, at = k;
    }
    if (best == INT_MAX) break;
    // Merge every occurrence of the best pair, left to right, as GPT-2 does.
    const std::string left = parts[at], right = parts[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < parts.size();) {
      if (k + 1 < parts.size() && parts[k] == left && parts[k + 1] == right) {
        merged.push_back(left + right);
        k += 2;
      } else {
        merged.push_back(parts[k++]);
      }
    }
    parts.swap(merged);
  }
  std::vector<int32_t> ids;
  for (const auto& p : parts) {
    auto it = token_to_id_.find(p);
    DS_CHECK(it != token_to_id_.end(), "BPE produced '", p, "', which the vocabulary lacks");
    ids.push_back(it->second);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache_.size() < (1u << 20)) cache_.emplace(piece, std::move(ids));
}

std::vector<int32_t> Gpt2Tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> ids;
  for (const auto& piece : pretokenize(text)) bpe(piece, ids);
  return ids;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
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
