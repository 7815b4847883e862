#include "engine/runtime/data/hf_tokenizer.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "common/files.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "engine/runtime/data/sentencepiece_model.hpp"

namespace ds {
namespace {

using json = nlohmann::json;

// The split patterns ds implements, as tokenizer.json spells them in a Split pre-tokenizer.
const char* const kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const char* pattern_name(SplitPattern p) {
  return p == SplitPattern::gpt2 ? "gpt2" : p == SplitPattern::llama3 ? "llama3" : "qwen2";
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}


json parse_file(const std::string& path) {
  const std::string text = read_file_bytes(path);
  check_json_nesting(text, path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw UserError("'" + path + "' is not JSON: " + e.what(), "a Hugging Face tokenizer file is one JSON object");
  }
}

// A refusal naming the file, the key and what it holds.
[[noreturn]] void refuse(const std::string& path, const std::string& key, const json& value, const std::string& why) {
  std::string shown = value.dump();
  if (shown.size() > 300) shown = shown.substr(0, 300) + "...";
  throw UserError("'" + path + "': " + key + " is " + shown + ": " + why,
                  "ds reads byte-level BPE (GPT-2, Llama 3, Qwen 2/2.5/3) and SentencePiece's BPE (Llama 2, Mistral, Phi-3); "
                  "tokenize this data with its own tokenizer into a token file (data.type tokens) meanwhile");
}

std::string str_or_empty(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The model directory's tokenizer_config.json, parsed; null when there is none.
json read_config_file(const std::string& dir) {
  const std::string path = (dir.empty() ? std::string(".") : dir) + "/tokenizer_config.json";
  return exists(path) ? parse_file(path) : json();
}

// tokenizer_config.json's bos_token / eos_token: a string, an AddedToken object {"content": ...}, or null.
std::string token_text(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) return str_or_empty(*it, "content");
  return "";
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& where) {
  try {
    load(where);
  } catch (const json::exception& e) {  // a key of the wrong type, wherever it is
    throw UserError("'" + path_ + "' (or the tokenizer_config.json beside it) holds a value of the wrong type: " + e.what(),
                    "is it a Hugging Face tokenizer.json as transformers writes it?");
  }
}

void HfTokenizer::load(const std::string& where) {
  const bool dir_given = is_dir(where);
  const size_t slash = where.find_last_of('/');
  const std::string dir = dir_given ? where : slash == std::string::npos ? std::string() : where.substr(0, slash);
  path_ = dir_given ? where + "/tokenizer.json" : where;
  const std::string model = dir_given ? where + "/tokenizer.model" : where;
  const bool model_named = !dir_given && where.size() >= 6 && where.compare(where.size() - 6, 6, ".model") == 0;
  if (model_named || (dir_given && !exists(path_) && exists(model))) {
    if (!exists(model)) throw UserError("no tokenizer model at '" + model + "'", "point data.tokenizer_path at the model's directory");
    load_sentencepiece(model, dir);
    return;
  }
  if (!exists(path_))
    throw UserError("no tokenizer.json at '" + path_ + "'",
                    "point data.tokenizer_path at a model directory holding tokenizer.json (or SentencePiece's tokenizer.model), "
                    "or at the file itself");
  const json t = parse_file(path_);
  if (!t.is_object() || !t.contains("model") || !t["model"].is_object())
    throw UserError("'" + path_ + "' has no \"model\" object", "is it a Hugging Face tokenizer.json?");
  const json& m = t["model"];
  const json pre = t.value("pre_tokenizer", json()), norm = t.value("normalizer", json());
  const bool metaspace = pre.is_object() && pre.value("type", std::string()) == "Metaspace";
  if (m.is_object() && (m.value("byte_fallback", false) || metaspace)) {  // SentencePiece's BPE
    read_piece_setup(norm, pre);
    piece_ = std::make_unique<PieceBpe>(read_piece_model(m));
    vocab_size_ = piece_->vocab_size();
  } else {
    ByteLevelBpe::Parts parts = read_model(m);
    read_pre_tokenizer(pre);
    parts.split = split_;
    if (!norm.is_null()) {
      if (!norm.is_object() || norm.value("type", std::string()) != "NFC")
        refuse(path_, "normalizer", norm, "ds applies no normalizer but NFC to a byte-level BPE");
      nfc_ = true;
    }
    const json dec = t.value("decoder", json());
    if (!dec.is_null() && (!dec.is_object() || dec.value("type", std::string()) != "ByteLevel"))
      refuse(path_, "decoder", dec, "ds decodes byte-level BPE only");
    bpe_ = std::make_unique<ByteLevelBpe>(std::move(parts));
    vocab_size_ = bpe_->vocab_size();
  }
  read_added_tokens(t.value("added_tokens", json::array()));
  read_post_processor(t.value("post_processor", json()));
  read_config(dir);
}

void HfTokenizer::load_sentencepiece(const std::string& file, const std::string& dir) {
  path_ = file;
  SentencePieceModel m = read_sentencepiece_model(file);
  const json config = read_config_file(dir);
  // Hugging Face's Llama tokenizers: legacy (the default) puts '▁' before every text between special tokens, as
  // SentencePiece encodes each of them; "legacy": false before the text's first one only.
  const auto flag = [&](const char* key, bool otherwise) {  // a boolean key; absent or null: Hugging Face's default
    return config.is_object() && config.contains(key) && config[key].is_boolean() ? config[key].get<bool>() : otherwise;
  };
  piece_prepend_ = !m.add_dummy_prefix ? PiecePrepend::none : !flag("legacy", true) ? PiecePrepend::first_unless_there : PiecePrepend::always;
  piece_ = std::make_unique<PieceBpe>(std::move(m.parts));
  vocab_size_ = piece_->vocab_size();
  model_described_ = m.describe;
  for (const auto& [content, id] : m.specials) add_token({content, id, false, false});
  sort_added();
  read_config(dir);
  if (bos_token_.empty() && !m.bos_piece.empty()) bos_token_ = m.bos_piece, bos_ = id_of(bos_token_);
  if (eos_token_.empty() && !m.eos_piece.empty()) eos_token_ = m.eos_piece, eos_ = id_of(eos_token_);
  // tokenizer(text) adds the BOS unless add_bos_token is false, and the EOS where add_eos_token is true.
  if (flag("add_bos_token", true) && bos_ >= 0) prefix_ids_.push_back(bos_);
  if (flag("add_eos_token", false) && eos_ >= 0) suffix_ids_.push_back(eos_);
}

void HfTokenizer::read_vocab_merges(const json& m, std::vector<std::pair<std::string, int32_t>>& vocab,
                                    std::vector<std::pair<std::string, std::string>>& merges) const {
  if (m.value("type", std::string()) != "BPE") refuse(path_, "model.type", m.value("type", json()), "ds reads BPE models only");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "") refuse(path_, std::string("model.") + key, m[key], "not implemented");
  if (!m.contains("vocab") || !m["vocab"].is_object()) throw UserError("'" + path_ + "': model.vocab is not an object", "");
  for (const auto& [tok, id] : m["vocab"].items()) {
    if (!id.is_number_integer()) refuse(path_, "model.vocab[\"" + tok + "\"]", id, "ids are integers");
    if (id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t{1} << 24))
      refuse(path_, "model.vocab[\"" + tok + "\"]", id, "ids are from 0 to 16,777,215");
    vocab.emplace_back(tok, static_cast<int32_t>(id.get<int64_t>()));
  }
  if (!m.contains("merges") || !m["merges"].is_array()) return;
  for (const json& merge : m["merges"]) {
    if (merge.is_string()) {  // "left right"
      const std::string s = merge.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos) refuse(path_, "a merge", merge, "merges are \"left right\" or [left, right]");
      merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      refuse(path_, "a merge", merge, "merges are \"left right\" or [left, right]");
    }
  }
}

ByteLevelBpe::Parts HfTokenizer::read_model(const json& m) const {
  ByteLevelBpe::Parts parts;
  parts.source = path_;
  parts.ignore_merges = m.value("ignore_merges", false);
  read_vocab_merges(m, parts.vocab, parts.merges);
  return parts;
}

PieceBpe::Parts HfTokenizer::read_piece_model(const json& m) const {
  PieceBpe::Parts parts;
  parts.source = path_;
  parts.byte_fallback = m.value("byte_fallback", false);
  parts.fuse_unk = m.value("fuse_unk", false);
  parts.unk_token = m.contains("unk_token") && m["unk_token"].is_string() ? m["unk_token"].get<std::string>() : "";
  if (m.value("ignore_merges", false)) refuse(path_, "model.ignore_merges", true, "not implemented for SentencePiece's BPE");
  read_vocab_merges(m, parts.vocab, parts.merges);
  return parts;
}

// SentencePiece's spaces as the file spells them: the legacy normalizer (prepend '▁' to every segment, then
// spaces to '▁'), Gemma's (spaces to '▁' only), or a Metaspace pre-tokenizer without a split (spaces to
// '▁', a '▁' before the text's first segment, every segment or none, unless it starts with one already).
void HfTokenizer::read_piece_setup(const json& norm, const json& pre) {
  const std::string space = "\xE2\x96\x81";  // '▁'
  auto is_replace = [&](const json& n) {
    return n.is_object() && n.value("type", std::string()) == "Replace" && n.contains("pattern") && n["pattern"].is_object() &&
           n["pattern"].value("String", std::string()) == " " && n.value("content", std::string()) == space;
  };
  auto is_prepend = [&](const json& n) {
    return n.is_object() && n.value("type", std::string()) == "Prepend" && n.value("prepend", std::string()) == space;
  };
  piece_prepend_ = PiecePrepend::none;
  if (pre.is_object() && pre.value("type", std::string()) == "Metaspace") {
    if (!norm.is_null()) refuse(path_, "normalizer", norm, "with a Metaspace pre-tokenizer ds reads no normalizer");
    if (pre.value("replacement", space) != space || pre.value("split", true))  // Hugging Face splits when the key is absent
      refuse(path_, "pre_tokenizer", pre, "ds reads a Metaspace with the '▁' replacement and \"split\": false");
    if (pre.contains("prepend_scheme") && pre.contains("add_prefix_space") && !pre.value("add_prefix_space", true) &&
        pre.value("prepend_scheme", std::string()) != "never")
      refuse(path_, "pre_tokenizer", pre, "add_prefix_space false contradicts its prepend_scheme");
    const std::string scheme = pre.contains("prepend_scheme") && pre["prepend_scheme"].is_string()
                                   ? pre["prepend_scheme"].get<std::string>()
                                   : (pre.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "always") piece_prepend_ = PiecePrepend::unless_there;
    else if (scheme == "first") piece_prepend_ = PiecePrepend::first_unless_there;
    else if (scheme != "never") refuse(path_, "pre_tokenizer.prepend_scheme", pre["prepend_scheme"], "always, first or never");
    return;
  }
  if (!pre.is_null()) refuse(path_, "pre_tokenizer", pre, "SentencePiece's BPE is read with a Metaspace pre-tokenizer or none");
  if (is_replace(norm)) return;  // Gemma's
  if (norm.is_object() && norm.value("type", std::string()) == "Sequence" && norm.contains("normalizers") &&
      norm["normalizers"].is_array() && norm["normalizers"].size() == 2 && is_prepend(norm["normalizers"][0]) &&
      is_replace(norm["normalizers"][1])) {
    piece_prepend_ = PiecePrepend::always;
    return;
  }
  refuse(path_, "normalizer", norm, "ds reads SentencePiece's legacy normalizer (Prepend '▁', Replace ' ' by '▁') or Replace alone");
}

// ByteLevel with its own (GPT-2's) pattern, or a Split by a pattern ds knows, then ByteLevel.
void HfTokenizer::read_pre_tokenizer(const json& pre) {
  auto byte_level = [&](const json& p, bool pattern_expected) {
    if (!p.is_object() || p.value("type", std::string()) != "ByteLevel")
      refuse(path_, "pre_tokenizer", pre, "not a byte-level pre-tokenizer");
    if (p.value("add_prefix_space", false))  // Hugging Face adds it to every piece between added tokens: not done here
      refuse(path_, "pre_tokenizer's add_prefix_space", true, "not implemented (GPT-2's, Llama 3's and Qwen's tokenizers leave it off)");
    if (p.value("use_regex", true) != pattern_expected)
      refuse(path_, "pre_tokenizer", pre, pattern_expected ? "a ByteLevel pre-tokenizer without a split pattern" : "two split patterns");
  };
  if (pre.is_object() && pre.value("type", std::string()) == "Sequence" && pre.contains("pretokenizers") &&
      pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2) {
    const json& split = pre["pretokenizers"][0];
    if (!split.is_object() || split.value("type", std::string()) != "Split" || split.value("behavior", std::string()) != "Isolated" ||
        split.value("invert", false))
      refuse(path_, "pre_tokenizer.pretokenizers[0]", split, "ds reads a Split with behavior Isolated");
    const std::string regex = split.contains("pattern") && split["pattern"].is_object() ? str_or_empty(split["pattern"], "Regex") : "";
    if (regex == kGpt2Regex) split_ = SplitPattern::gpt2;
    else if (regex == kLlama3Regex) split_ = SplitPattern::llama3;
    else if (regex == kQwen2Regex) split_ = SplitPattern::qwen2;
    else refuse(path_, "the pre-tokenizer's split pattern", regex, "ds knows GPT-2's, Llama 3's and Qwen 2's patterns only");
    byte_level(pre["pretokenizers"][1], false);
  } else if (pre.is_object()) {
    byte_level(pre, true);
    split_ = SplitPattern::gpt2;
  } else {
    refuse(path_, "pre_tokenizer", pre, "a byte-level BPE needs a ByteLevel pre-tokenizer");
  }
}

void HfTokenizer::read_added_tokens(const json& added) {
  if (!added.is_array()) refuse(path_, "added_tokens", added, "a list of tokens");
  for (const json& a : added) {
    const std::string content = a.is_object() ? str_or_empty(a, "content") : "";
    if (content.empty() || !a.contains("id") || !a["id"].is_number_integer() || a["id"].get<int64_t>() < 0 ||
        a["id"].get<int64_t>() >= (int64_t{1} << 24))
      refuse(path_, "added_tokens", a, "each added token has a non-empty content and an id below 16,777,216");
    if (a.value("single_word", false)) refuse(path_, "added token " + content + "'s single_word", true, "not implemented");
    // Hugging Face matches a normalized added token in the normalized text: with SentencePiece's normalizer
    // that changes where '▁' goes around it. Not implemented, so refused (byte-level normalizers are identity
    // or NFC, where it changes nothing ds does).
    if (piece_ && piece_prepend_ == PiecePrepend::always && a.value("normalized", false))
      refuse(path_, "added token " + content + "'s normalized", true, "not implemented with SentencePiece's legacy normalizer");
    add_token({content, a["id"].get<int32_t>(), a.value("lstrip", false), a.value("rstrip", false)});
  }
  sort_added();
}

void HfTokenizer::add_token(Added a) {
  vocab_size_ = std::max(vocab_size_, a.id + 1);
  added_by_id_[a.id] = a.content;
  added_by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(std::move(a));
}

void HfTokenizer::sort_added() {
  for (auto& list : added_by_first_byte_)
    std::stable_sort(list.begin(), list.end(), [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
}

// ByteLevel adds nothing; TemplateProcessing's single form adds its special tokens around the text.
void HfTokenizer::read_post_processor(const json& post) {
  const std::vector<json> posts = post.is_object() && post.value("type", std::string()) == "Sequence" &&
                                          post.contains("processors") && post["processors"].is_array()
                                      ? post["processors"].get<std::vector<json>>()
                                      : std::vector<json>{post};
  for (const json& p : posts) {
    const std::string type = p.is_object() ? p.value("type", std::string()) : "";
    if (type == "ByteLevel" || p.is_null()) continue;
    if (type != "TemplateProcessing") refuse(path_, "post_processor", p, "ds reads ByteLevel and TemplateProcessing");
    bool before = true;
    const json single = p.value("single", json::array());
    for (const json& piece : single.is_array() ? single : json::array()) {
      if (!piece.is_object()) continue;
      if (piece.contains("Sequence")) {
        before = false;
        continue;
      }
      if (!piece.contains("SpecialToken") || !piece["SpecialToken"].is_object()) continue;
      const std::string name = str_or_empty(piece["SpecialToken"], "id");
      const json specials = p.value("special_tokens", json::object());
      const json entry = specials.is_object() && specials.contains(name) ? specials[name] : json::object();
      const json ids = entry.is_object() ? entry.value("ids", json::array()) : json::array();
      for (const json& id : ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size_)
          refuse(path_, "post_processor's special token " + name, entry, "its ids must be the tokenizer's");
        (before ? prefix_ids_ : suffix_ids_).push_back(id.get<int32_t>());
      }
    }
  }
}

void HfTokenizer::read_config(const std::string& dir) {
  const std::string path = (dir.empty() ? std::string(".") : dir) + "/tokenizer_config.json";
  if (const json c = read_config_file(dir); c.is_object()) {
    bos_token_ = token_text(c, "bos_token");
    eos_token_ = token_text(c, "eos_token");
    auto tmpl = c.find("chat_template");
    if (tmpl != c.end() && tmpl->is_string()) {
      chat_template_ = tmpl->get<std::string>();
    } else if (tmpl != c.end() && tmpl->is_array()) {  // named templates: the "default" one
      for (const json& named : *tmpl)
        if (named.is_object() && named.value("name", std::string()) == "default") chat_template_ = str_or_empty(named, "template");
    }
  }
  const std::string jinja = (dir.empty() ? std::string(".") : dir) + "/chat_template.jinja";
  if (chat_template_.empty() && exists(jinja)) chat_template_ = read_file_bytes(jinja);
  bos_ = bos_token_.empty() ? -1 : id_of(bos_token_);
  eos_ = eos_token_.empty() ? -1 : id_of(eos_token_);
  if (!eos_token_.empty() && eos_ < 0)
    throw UserError("'" + path + "' names eos_token '" + eos_token_ + "', which '" + path_ + "' does not hold",
                    "the two files are from different models?");
}

int32_t HfTokenizer::id_of(const std::string& token) const {
  if (!token.empty())
    for (const Added& a : added_by_first_byte_[static_cast<unsigned char>(token[0])])
      if (a.content == token) return a.id;
  return bpe_ ? bpe_->id_of(token) : piece_->id_of(token);
}

void HfTokenizer::encode_plain(const std::string& segment, bool starts_text, std::vector<int32_t>& out,
                               std::vector<int32_t>* lengths) const {
  const size_t first = out.size();
  if (bpe_) {
    bpe_->encode_into(segment, out);
    if (lengths)  // a byte-level token stands for its bytes of the text
      for (size_t k = first; k < out.size(); ++k) lengths->push_back(static_cast<int32_t>(bpe_->token_bytes(out[k])));
    return;
  }
  // SentencePiece: spaces become '▁' (3 bytes standing for 1), a prepended '▁' stands for none of the text.
  const std::string space = "\xE2\x96\x81";
  std::string text;
  std::vector<uint8_t> weight;  // per byte of `text`: how many bytes of the segment it stands for
  const bool there = segment.empty() || segment[0] == ' ' || segment.compare(0, 3, space) == 0;  // '▁' already first
  if (piece_prepend_ == PiecePrepend::always || (piece_prepend_ == PiecePrepend::unless_there && !there) ||
      (piece_prepend_ == PiecePrepend::first_unless_there && starts_text && !there)) {
    text += space;
    weight.insert(weight.end(), {0, 0, 0});
  }
  for (char c : segment) {
    if (c == ' ') {
      text += space;
      weight.insert(weight.end(), {1, 0, 0});
    } else {
      text += c;
      weight.push_back(1);
    }
  }
  std::vector<int32_t> covered;
  piece_->encode_into(text, out, &covered);
  if (!lengths) return;
  size_t at = 0;
  for (int32_t n : covered) {
    int32_t original = 0;
    for (size_t b = at; b < at + static_cast<size_t>(n) && b < weight.size(); ++b) original += weight[b];
    lengths->push_back(original);
    at += static_cast<size_t>(n);
  }
}

void HfTokenizer::split_added(const std::string& text, std::vector<int32_t>& out, std::vector<int32_t>* lengths) const {
  // Added tokens first, leftmost and longest; the text between them goes to BPE.
  size_t plain = 0;
  auto flush = [&](size_t end) {
    if (end > plain) encode_plain(text.substr(plain, end - plain), plain == 0, out, lengths);
  };
  for (size_t i = 0; i < text.size();) {
    const Added* hit = nullptr;
    for (const Added& a : added_by_first_byte_[static_cast<unsigned char>(text[i])])
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    while (hit->lstrip && begin > plain) {  // the whitespace before it, a code point at a time
      const size_t start = code_point_before(text, begin, plain);
      uint32_t cp;
      decode_utf8(text, start, &cp);
      if (!is_white_space(cp)) break;
      begin = start;
    }
    while (hit->rstrip && end < text.size()) {
      uint32_t cp;
      const int len = decode_utf8(text, end, &cp);
      if (!is_white_space(cp)) break;
      end += static_cast<size_t>(len);
    }
    flush(begin);
    out.push_back(hit->id);
    if (lengths) lengths->push_back(static_cast<int32_t>(end - begin));
    i = end;
    plain = i;
  }
  flush(text.size());
}

std::vector<int32_t> HfTokenizer::encode(const std::string& text, bool add_special_tokens, std::vector<int32_t>* lengths) const {
  if (nfc_) {
    for (size_t i = 0; i < text.size();) {
      uint32_t cp;
      i += decode_utf8(text, i, &cp);
      if (nfc_may_change(cp)) {
        ++not_normalized_;
        break;
      }
    }
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = prefix_ids_;
  if (lengths) lengths->assign(ids.size(), 0);
  split_added(text, ids, lengths);
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  if (add_special_tokens && lengths) lengths->resize(ids.size(), 0);
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  std::vector<int32_t> run;
  auto flush = [&] {
    out += bpe_ ? bpe_->decode(run) : piece_->decode(run);
    run.clear();
  };
  for (int32_t id : ids) {
    auto added = added_by_id_.find(id);
    if (added == added_by_id_.end()) {
      run.push_back(id);
    } else {
      flush();
      out += added->second;
    }
  }
  flush();
  if (piece_ && piece_prepend_ != PiecePrepend::none && !out.empty() && out[0] == ' ') out.erase(0, 1);  // as its decoder strips it
  return out;
}

const std::vector<std::string>& HfTokenizer::warnings() const {
  static const std::vector<std::string> none;
  return bpe_ ? bpe_->warnings() : none;
}

std::string HfTokenizer::describe() const {
  const char* prepend[] = {"", ", '▁' before every segment", ", '▁' before each segment without one",
                           ", '▁' before the text's first segment"};
  const std::string kind = bpe_ ? "byte-level BPE (" + std::string(pattern_name(split_)) + " pattern" + (nfc_ ? ", NFC" : "") + ")"
                           : !model_described_.empty() ? model_described_ + std::string(prepend[static_cast<int>(piece_prepend_)])
                                                       : "SentencePiece BPE (byte fallback" + std::string(prepend[static_cast<int>(piece_prepend_)]) + ")";
  return path_ + ": " + kind + ", " +
         format_count(vocab_size_) + " ids, " + std::to_string(added_by_id_.size()) + " added tokens";
}

}  // namespace ds
