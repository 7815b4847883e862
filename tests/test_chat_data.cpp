// Fine-tuning data: Hugging Face tokenizer.json read and encoded exactly as an independent encoder does
// (tests/tools/bpe_reference.py: Python's regex engine running the file's own pattern), the chat formats
// rendered as the models' official templates render them, the loss masks, hostile jsonl refused with
// file:line, and rows of one sample each (padding and prompts masked, every sample once per epoch).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/error.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"
#include "engine/runtime/data/sampler.hpp"
#include "chat_test_helpers.hpp"
#include "test_helpers.hpp"

using namespace ds;
using namespace chat_test;

namespace {

const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's vocabulary and merges as a tokenizer.json with the given pre-tokenizer.
std::string gpt2_tokenizer_json(const std::string& dir, const json& pre_tokenizer, bool ignore_merges) {
  const json vocab = json::parse(test::read_text(std::string(DS_SHARED_DIR) + "/data/gpt2/vocab.json"));
  json merges = json::array();
  std::istringstream in(test::read_text(std::string(DS_SHARED_DIR) + "/data/gpt2/merges.txt"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line.rfind("#version", 0) != 0) merges.push_back(line);
  json added = json::array();
  int32_t id = 50300;
  for (const char* s : {"<|im_start|>", "<|im_end|>", "<|begin_of_text|>"})
    added.push_back({{"id", id++}, {"content", s}, {"special", true}, {"lstrip", false}, {"rstrip", false}, {"single_word", false}});
  const json t = {{"added_tokens", added},
                  {"normalizer", nullptr},
                  {"pre_tokenizer", pre_tokenizer},
                  {"post_processor", {{"type", "ByteLevel"}}},
                  {"decoder", {{"type", "ByteLevel"}}},
                  {"model", {{"type", "BPE"}, {"ignore_merges", ignore_merges}, {"vocab", vocab}, {"merges", merges}}}};
  write(dir + "/tokenizer.json", t.dump());
  return dir + "/tokenizer.json";
}

json split_then_bytes(const char* regex) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}

std::vector<int32_t> reference_ids(const std::string& tokenizer_json, const std::string& text, const std::string& dir) {
  write(dir + "/text.txt", text);
  const std::string out = dir + "/ids.json";
  const std::string cmd = "python3 " DS_SOURCE_DIR "/tests/tools/bpe_reference.py " + tokenizer_json + " " + dir + "/text.txt > " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return json::parse(test::read_text(out)).get<std::vector<int32_t>>();
}

// Text that trips tokenizers: every ASCII character, whitespace runs and newlines in every arrangement the
// patterns treat apart, contractions in both cases, digits in runs, letters with combining marks, CJK,
// emoji, Devanagari, Arabic-Indic digits, added tokens inside words and back to back.
std::string hostile_text() {
  std::string s;
  for (int c = 1; c < 128; ++c) s += static_cast<char>(c);
  s += " don't DON'T it'S it'ſ we'LL I'd 've\n\n\n  \t x  \r\n y \n\t\n z   \n";
  s += "1234567 12 3 ٣٤٥٦ Ⅻ ½ 3.14159 x1y22z333 ";
  s += "naïve café é (e + U+0301) Ωmega ὈΔΥΣΣΕΎΣ 日本語のテキスト 中文 한국어 ";
  s += "🙂👍🏽 👨‍👩‍👧 हिन्दी العربية ";
  s += "he<|im_start|>llo<|im_end|><|im_start|>x <|im_end|>\n<|begin_of_text|>";
  s += std::string(300, ' ') + "end" + std::string(40, '\n') + "!!!???...";
  return s;
}

}  // namespace

TEST(HfTokenizer, MatchesAnIndependentEncoderForEachSplitPattern) {
  DS_REQUIRE_SHARED_DATA();
  if (std::system("python3 -c 'import unicodedata, re, json' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string corpus = test::read_text(std::string(DS_SHARED_DIR) + "/data/tinyshakespeare.txt").substr(0, 40000);
  struct Case {
    const char* name;
    json pre;
    bool ignore_merges;
  };
  const std::vector<Case> cases = {
      {"gpt2", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}, false},
      {"llama3", split_then_bytes(kLlama3Regex), true},
      {"qwen2", split_then_bytes(kQwen2Regex), false},
  };
  for (const Case& c : cases) {
    const std::string dir = scratch(std::string("ref_") + c.name);
    const std::string path = gpt2_tokenizer_json(dir, c.pre, c.ignore_merges);
    const HfTokenizer tok(path);
    EXPECT_NE(tok.describe().find(std::string("(") + c.name + " pattern"), std::string::npos) << tok.describe();
    for (const std::string& text : {hostile_text(), corpus}) {
      const std::vector<int32_t> got = tok.encode(text), want = reference_ids(path, text, dir);
      ASSERT_EQ(got.size(), want.size()) << c.name;
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i], want[i]) << c.name << ": first difference at token " << i << " ('" << tok.decode({got[i]}) << "' vs '"
                                   << tok.decode({want[i]}) << "')";
      EXPECT_EQ(tok.decode(got), text) << c.name;
    }
    EXPECT_EQ(tok.id_of("<|im_end|>"), 50301);
    EXPECT_EQ(tok.vocab_size(), 50303);
  }
}

namespace {

// GPT-2's vocabulary and merges as SentencePiece's: 'Ġ' (GPT-2's space) spelled '▁', <unk>, <s>, </s> and
// the 256 <0xXX> byte tokens added, byte fallback on. Characters GPT-2 spells with stand-ins (newlines,
// accents, CJK) are not in it as themselves: they take the byte fallback.
std::string piece_tokenizer_json(const std::string& dir, const json& normalizer, const json& pre_tokenizer, bool strips = false) {
  const json gpt2 = json::parse(test::read_text(std::string(DS_SHARED_DIR) + "/data/gpt2/vocab.json"));
  auto spelled = [](std::string t) {
    for (size_t at; (at = t.find("\xC4\xA0")) != std::string::npos;) t.replace(at, 2, "\xE2\x96\x81");  // Ġ -> ▁
    return t;
  };
  json vocab = json::object();
  int32_t next = 0;
  for (const char* special : {"<unk>", "<s>", "</s>"}) vocab[special] = next++;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = next++;
  }
  for (const auto& [tok, id] : gpt2.items())
    if (!vocab.contains(spelled(tok))) vocab[spelled(tok)] = next++;
  json merges = json::array();
  std::istringstream in(test::read_text(std::string(DS_SHARED_DIR) + "/data/gpt2/merges.txt"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line.rfind("#version", 0) != 0) merges.push_back(spelled(line));
  json added = json::array();
  for (const char* special : {"<unk>", "<s>", "</s>"})  // with `strips`, Phi-3's way: </s> takes the whitespace after it, <s> before
    added.push_back({{"id", vocab[special]}, {"content", special}, {"special", true},
                     {"lstrip", strips && std::string(special) == "<s>"}, {"rstrip", strips && std::string(special) == "</s>"}});
  const json t = {{"added_tokens", added},     {"normalizer", normalizer}, {"pre_tokenizer", pre_tokenizer},
                  {"post_processor", nullptr}, {"decoder", nullptr},
                  {"model", {{"type", "BPE"}, {"byte_fallback", true}, {"fuse_unk", true}, {"unk_token", "<unk>"}, {"vocab", vocab}, {"merges", merges}}}};
  write(dir + "/tokenizer.json", t.dump());
  return dir + "/tokenizer.json";
}

}  // namespace

// Llama 2 / Mistral / Phi-3's tokenizers: the legacy normalizer (a '▁' before every segment), and the
// Metaspace forms (before the text's first segment, or before each one without a '▁'), on hostile text and on
// the corpus line by line, against the independent encoder (which merges one pair at a time by scanning).
TEST(HfTokenizer, SentencePieceBpeMatchesAnIndependentEncoder) {
  DS_REQUIRE_SHARED_DATA();
  if (std::system("python3 -c 'import unicodedata, re, json' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const json legacy = json::parse(R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})");
  const std::vector<std::pair<json, json>> setups = {
      {legacy, nullptr},
      {nullptr, json::parse(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false})")},
      {nullptr, json::parse(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": false})")},
  };
  std::string lines;
  std::istringstream corpus(test::read_text(std::string(DS_SHARED_DIR) + "/data/tinyshakespeare.txt"));
  int count = 0;
  for (std::string line; count < 400 && std::getline(corpus, line); ++count) lines += line + "\n";
  lines += "<s>[INST] What's 2+2? [/INST] It's 4.</s>\n  two  spaces</s><s> lead\nx </s>   y \t <s>z  \n\xE2\x96\x81x starts with the mark\n";
  std::string hostile = hostile_text();
  for (char& c : hostile)
    if (c == '\n') c = ' ';  // one line
  lines += hostile;
  for (size_t k = 0; k < setups.size(); ++k) {
    const std::string dir = scratch("piece" + std::to_string(k));
    const std::string path = piece_tokenizer_json(dir, setups[k].first, setups[k].second, /*strips=*/k == 1);
    const HfTokenizer tok(path);
    EXPECT_NE(tok.describe().find("SentencePiece BPE (byte fallback"), std::string::npos) << tok.describe();
    write(dir + "/text.txt", lines);
    const std::string cmd = "python3 " DS_SOURCE_DIR "/tests/tools/bpe_reference.py " + path + " " + dir + "/text.txt --lines > " + dir + "/ids.json";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const json want = json::parse(test::read_text(dir + "/ids.json"));
    std::istringstream each(lines);
    size_t i = 0;
    for (std::string line; std::getline(each, line); ++i) {
      std::vector<int32_t> lengths;
      const std::vector<int32_t> got = tok.encode(line, false, &lengths);
      ASSERT_EQ(got, want[i].get<std::vector<int32_t>>()) << "setup " << k << ", line " << i << ": '" << line << "'";
      int64_t covered = 0;  // the lengths map the tokens back onto the line exactly
      for (int32_t n : lengths) covered += n;
      ASSERT_EQ(covered, static_cast<int64_t>(line.size())) << line;
      const bool plain_text = line.find("<s>") == std::string::npos && line.find("</s>") == std::string::npos &&
                              line.find("\xE2\x96\x81") == std::string::npos;  // a literal '▁' decodes as a space
      if (plain_text && !line.empty() && line[0] != ' ') {
        EXPECT_EQ(tok.decode(got), line) << "setup " << k;
      }
    }
  }
}

// An <unk> stands for the bytes of the characters it replaced (consecutive ones fused into one), so the spans
// of a text still map to tokens; a Metaspace that would split is refused (Hugging Face's default is to split).
TEST(HfTokenizer, SentencePieceWithoutByteFallbackCountsWhatUnkStandsFor) {
  const std::string d = scratch("unk");
  json t = {{"added_tokens", json::array()},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}}},
            {"model", {{"type", "BPE"}, {"byte_fallback", false}, {"fuse_unk", true}, {"unk_token", "<unk>"},
                       {"vocab", {{"<unk>", 0}, {"\u2581", 1}, {"a", 2}, {"b", 3}, {"\u2581a", 4}}}, {"merges", {"\u2581 a"}}}}};
  write(d + "/tokenizer.json", t.dump());
  const HfTokenizer tok(d);
  std::vector<int32_t> lengths;
  EXPECT_EQ(tok.encode("\xC3\xA9\xC3\xA9" "ab a\xC3\xA9", false, &lengths), (std::vector<int32_t>{1, 0, 2, 3, 4, 0}));
  EXPECT_EQ(lengths, (std::vector<int32_t>{0, 4, 1, 1, 2, 2}));  // ▁ prepended: none; the fused <unk>: both é
  t["pre_tokenizer"].erase("split");
  write(d + "/tokenizer.json", t.dump());
  try {
    HfTokenizer refused(d);
    ADD_FAILURE() << "a Metaspace without \"split\" splits in Hugging Face";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("\"split\": false"), std::string::npos) << e.what();
  }
}

// An added token with rstrip (lstrip) takes the whitespace after (before) it, as Phi-3's <|end|> and
// <|user|> do: the text between is tokenized without it, and the token's length covers it.
TEST(HfTokenizer, AddedTokensTakeTheWhitespaceTheyStrip) {
  json t = example_tokenizer();
  for (auto& a : t["added_tokens"])
    if (a["content"] == "<|im_end|>") a["rstrip"] = true, a["lstrip"] = true;
  const std::string d = scratch("strip");
  write(d + "/tokenizer.json", t.dump());
  const HfTokenizer tok(d);
  std::vector<int32_t> lengths;
  const std::string text = "a \t<|im_end|>\n  b";
  EXPECT_EQ(tok.encode(text, false, &lengths), tok.encode("a<|im_end|>b"));
  int64_t covered = 0;
  for (int32_t n : lengths) covered += n;
  EXPECT_EQ(covered, static_cast<int64_t>(text.size()));
}

TEST(HfTokenizer, InvalidUtf8AndEveryByteRoundTrip) {
  const HfTokenizer tok(tokenizer_dir("bytes", ""));
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  all += "\xff\xfe\xc3(\xe2\x82 tail";
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
}

TEST(HfTokenizer, RefusesWhatItDoesNotImplementNamingIt) {
  const auto refused = [](json tok, const std::string& expect) {
    const std::string d = scratch("refuse");
    write(d + "/tokenizer.json", tok.dump());
    try {
      HfTokenizer t(d);
      ADD_FAILURE() << "accepted; expected a refusal naming " << expect;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  json t = example_tokenizer();
  t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{L}+|\\s+";
  refused(t, "\\\\p{L}+|\\\\s+");  // the pattern itself, as JSON shows it
  t = example_tokenizer();
  t["model"]["byte_fallback"] = true;  // SentencePiece's BPE, with a byte-level pre-tokenizer: not a pair ds knows
  refused(t, "SentencePiece's BPE is read with a Metaspace pre-tokenizer or none");
  t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", true}};
  refused(t, "\"split\": false");
  t = example_tokenizer();
  t["model"]["type"] = "WordPiece";
  refused(t, "model.type");
  t = example_tokenizer();
  t["normalizer"] = {{"type", "NFKC"}};
  refused(t, "normalizer");
  t = example_tokenizer();
  t["added_tokens"][0]["single_word"] = true;
  refused(t, "single_word");
  try {
    HfTokenizer none(scratch("none"));
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
}

TEST(HfTokenizer, ThePostProcessorsBosAndTheConfigsEos) {
  json t = example_tokenizer();
  const std::string d = tokenizer_dir("post", "", t);
  json full = json::parse(test::read_text(d + "/tokenizer.json"));
  const int32_t bos = full["added_tokens"][3]["id"];  // <|begin_of_text|>
  full["post_processor"] = json::parse(R"({"type": "Sequence", "processors": [{"type": "ByteLevel"},
      {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                               {"Sequence": {"id": "A", "type_id": 0}}],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [)" + std::to_string(bos) + R"(]}}}]})");
  write(d + "/tokenizer.json", full.dump());
  const HfTokenizer tok(d);
  const std::vector<int32_t> with = tok.encode("Hi there", true), without = tok.encode("Hi there");
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(with[0], bos);
  EXPECT_EQ(tok.eos_id(), tok.id_of("<|im_end|>"));
  EXPECT_EQ(tok.decode(without), "Hi there");
}

namespace {

SampleSet read_lines(const HfTokenizer& tok, const std::vector<std::string>& lines, SampleOptions o = {}) {
  JsonlSamples reader(tok, o);
  for (size_t i = 0; i < lines.size(); ++i) reader.add_line(lines[i], "data.jsonl:" + std::to_string(i + 1));
  return reader.take();
}

std::string trained_text(const HfTokenizer& tok, const SampleSet& s, int64_t i) {
  std::vector<int32_t> ids;
  for (int64_t k = s.starts[i]; k < s.starts[i + 1]; ++k)
    if (s.trained[k]) ids.push_back(s.tokens[k]);
  return tok.decode(ids);
}

}  // namespace

TEST(JsonlSamples, EachShapeTrainsWhatItShould) {
  const HfTokenizer tok(tokenizer_dir("shapes", kQwen25Template));
  const std::vector<std::string> lines = {
      R"({"text": "Once upon a time."})",
      R"({"prompt": "2 + 2 =", "completion": " 4"})",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
      R"({"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Old"}, {"role": "user", "content": "Again"}],
          "completion": [{"role": "assistant", "content": "Yo"}]})"};
  const SampleSet s = read_lines(tok, lines);
  ASSERT_EQ(s.size(), 4);
  EXPECT_EQ(trained_text(tok, s, 0), "Once upon a time.<|im_end|>");  // the text and EOS
  EXPECT_EQ(trained_text(tok, s, 1), " 4<|im_end|>");                 // the completion and EOS
  EXPECT_EQ(trained_text(tok, s, 2), "Hello!<|im_end|>");             // the assistant's turn
  EXPECT_EQ(trained_text(tok, s, 3), "Yo<|im_end|>");  // the completion's turn; the prompt's is context
  EXPECT_EQ(tok.decode(std::vector<int32_t>(s.tokens.begin() + s.starts[1], s.tokens.begin() + s.starts[2])), "2 + 2 = 4<|im_end|>");
  EXPECT_NE(s.description.find("4 samples (1 text, 2 prompt/completion, 1 conversations)"), std::string::npos) << s.description;
  EXPECT_EQ(s.description.find("nothing"), std::string::npos) << s.description;
  // Lines that train nothing (a conversation without an answer; a completion that is empty but for its EOS,
  // which still trains) are counted and the first one named.
  std::vector<std::string> more = lines;
  more.push_back(R"({"messages": [{"role": "user", "content": "Anyone?"}]})");
  more.push_back(R"({"prompt": "Just this", "completion": ""})");
  more.push_back(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]})");
  const SampleSet u = read_lines(tok, more);
  EXPECT_NE(u.description.find("; 2 samples train nothing (no answer within it, the first at data.jsonl:5)"), std::string::npos)
      << u.description;
  EXPECT_EQ(s.pad_id, tok.eos_id());
  SampleOptions all;
  all.train_on_prompt = true;
  const SampleSet t = read_lines(tok, lines, all);
  EXPECT_EQ(trained_text(tok, t, 1), "2 + 2 = 4<|im_end|>");
  // A file of texts needs no chat template: the format is resolved at the first conversation only.
  const HfTokenizer bare(tokenizer_dir("bare", ""));
  EXPECT_EQ(read_lines(bare, {lines[0], lines[1]}).size(), 2);
  EXPECT_THROW(read_lines(bare, {lines[2]}), UserError);
}

TEST(JsonlSamples, HostileLinesAreRefusedWithFileAndLine) {
  const HfTokenizer tok(tokenizer_dir("hostile", kQwen25Template));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"text\": \"unterminated", "not JSON"},
      {std::string("{\"text\": \"a\0b\"}", 15), "not JSON"},  // a raw NUL inside a string
      {"{\"text\": \"\xff\xfe\"}", "not JSON"},                  // invalid UTF-8
      {"[1, 2, 3]", "not an object"},
      {R"({"text": 42})", "not a string"},
      {R"({"prompt": "only"})", "not both"},
      {R"({"prompt": "a", "completion": 3})", "both strings"},
      {R"({"messages": "hello"})", "not a list"},
      {R"({"messages": []})", "empty"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "\"tool\""},
      {R"({"messages": [{"role": "user"}]})", "messages[0]"},
      {R"({"messages": [{"role": "assistant", "content": "a", "reasoning_content": ["b"]}]})", "messages[0]'s reasoning_content is array"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": []}]})",
       "messages[1] has tool_calls"},
      {R"({"input": "x", "output": "y"})", "it has: input, output"},
      {std::string(100, '[') + std::string(100, ']'), "nests deeper"},
  };
  for (const auto& [line, expect] : cases) {
    try {
      read_lines(tok, {R"({"text": "fine"})", line});
      ADD_FAILURE() << "accepted: " << line;
    } catch (const UserError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("data.jsonl:2: ", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  }
  // data.skip_bad_lines: every one of those lines skipped and counted, the first named with its reason; the good
  // lines read as without them.
  SampleOptions skip;
  skip.skip_bad_lines = true;
  std::vector<std::string> mixed = {R"({"text": "fine"})"};
  for (const auto& c : cases) mixed.push_back(c.first);
  mixed.push_back(R"({"text": "also fine"})");
  const SampleSet kept = read_lines(tok, mixed, skip);
  ASSERT_EQ(kept.size(), 2);
  EXPECT_EQ(kept.tokens, read_lines(tok, {mixed.front(), mixed.back()}).tokens);
  EXPECT_NE(kept.description.find("; " + std::to_string(cases.size()) + " lines are no sample and skipped (data.skip_bad_lines; the first: "
                                  "data.jsonl:2: "),
            std::string::npos)
      << kept.description;
  // A whole file: blank lines skipped, the line number counted from 1, a line past 16 MiB refused unread.
  const std::string d = scratch("hostile_file");
  write(d + "/a.jsonl", "{\"text\": \"x\"}\n\n\r\n{\"text\": \"y\"}\n{\"text\": oops}\n");
  JsonlSamples reader(tok, SampleOptions{});
  try {
    reader.add_file(d + "/a.jsonl");
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(d + "/a.jsonl:5: ", 0), 0u) << e.what();
  }
  write(d + "/b.jsonl", "{\"text\": \"" + std::string(17u << 20, 'x') + "\"}\n");
  try {
    JsonlSamples(tok, SampleOptions{}).add_file(d + "/b.jsonl");
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: longer than"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

namespace {

SampleSet counted_samples(int n) {  // sample i: tokens i*100 + [0, 3 + i), the first two untrained
  SampleSet s;
  s.pad_id = 7;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    for (int k = 0; k < 3 + i; ++k) ids.push_back(i * 100 + k), mask.push_back(k >= 2);
    s.add(ids, mask);
  }
  s.description = "counted";
  return s;
}

}  // namespace

TEST(BatchSampler, SampleRowsArePaddedMaskedAndEachEpochSeesEverySampleOnce) {
  const SampleSet s = counted_samples(10);
  const int64_t T = 6;
  BatchSampler sampler(s, SamplerOptions{T, 1, 1, 1, 0, 0.2, 5, false});  // in file order; the last 2 validate
  std::vector<int32_t> in, tgt;
  sampler.train_batch(0, 0, in, tgt);  // sample 0: tokens 0 1 2
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 7, 7, 7}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{-1, 2, -1, -1, -1, -1}));  // token 1 untrained; 2 is; then padding
  sampler.train_batch(6, 0, in, tgt);  // sample 6: 9 tokens, cut at T + 1 = 7
  EXPECT_EQ(in, (std::vector<int32_t>{600, 601, 602, 603, 604, 605}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{-1, 602, 603, 604, 605, 606}));
  sampler.train_batch(8, 0, in, tgt);  // the training split's 8 samples wrap
  EXPECT_EQ(in[0], 0);
  sampler.val_batch(1, in, tgt);  // validation: samples 8, 9
  EXPECT_EQ(in[0], 900);
  EXPECT_NE(sampler.notes().find("3 of 8 training samples are longer"), std::string::npos) << sampler.notes();
  EXPECT_EQ(sampler.train_tokens(), 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10);

  // Shuffled: each epoch a permutation of the training samples, another one each epoch, the same on any
  // world size (the global sample index decides).
  const SampleSet big = counted_samples(37);
  BatchSampler shuffled(big, SamplerOptions{4, 1, 1, 1, 0, 0, 9, true});
  std::vector<int64_t> first, second;
  for (int64_t g = 0; g < 37; ++g) first.push_back(shuffled.sample_offset(g)), second.push_back(shuffled.sample_offset(37 + g));
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 37u);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 37u);
  EXPECT_EQ(*std::max_element(first.begin(), first.end()), 36);
  EXPECT_NE(first, second);
  std::vector<int64_t> ordered(37);
  for (int64_t i = 0; i < 37; ++i) ordered[i] = i;
  EXPECT_NE(first, ordered);
  BatchSampler two_ranks(big, SamplerOptions{4, 2, 1, 2, 1, 0, 9, true});
  two_ranks.train_batch(0, 0, in, tgt);  // rank 1's micro batch: global samples 2, 3
  EXPECT_EQ(in[0], first[2] * 100);
  EXPECT_EQ(in[4], first[3] * 100);
}

// data.tokens_in_memory false: an index of where each sample's line is, its tokens read again per batch. The same
// samples, counted targets and rows (packed or not, training and validation, on each rank) as the set in memory,
// with no token held; a file changed under a run is named, not trained on.
TEST(JsonlSamples, AnIndexedSetReadsTheSameRowsAsTheSetInMemory) {
  const auto tok = std::make_shared<const HfTokenizer>(tokenizer_dir("indexed", kQwen25Template));
  const std::string d = scratch("indexed_data");
  std::string lines;
  for (int i = 0; i < 40; ++i) {
    const std::string n = std::to_string(i);
    if (i % 3 == 0) lines += R"({"text": "Sample )" + n + R"( says: \" \", naïve café 日本語 🙂 )" + std::string(i * 3, 'x') + "\"}\n";
    else if (i % 3 == 1) lines += R"({"prompt": "What is )" + n + R"( + 1? ", "completion": ")" + std::to_string(i + 1) + "\"}\r\n";
    else lines += R"({"messages": [{"role": "user", "content": "Hi )" + n + R"("}, {"role": "assistant", "content": "Hello )" + std::string(i, 'y') + "\"}]}\n";
    if (i % 7 == 0) lines += "\n   \n";  // blank lines: no samples, but bytes before the next line
  }
  write(d + "/train.jsonl", lines);
  write(d + "/val.jsonl", R"({"messages": [{"role": "user", "content": "Val?"}, {"role": "assistant", "content": "Yes."}]})" "\n"
                          R"({"text": "validation text"})");  // no end of line at the end of the file
  const int64_t T = 24;
  auto read = [&](bool keep) {
    SampleOptions o;
    o.seq_len = T;
    o.keep_tokens = keep;
    o.source = "train.jsonl";
    SampleSet s = read_jsonl_samples({d + "/train.jsonl"}, tok, o);
    const SampleSet held = read_jsonl_samples({d + "/val.jsonl"}, tok, o);
    s.held_out_from = s.size();
    s.append(held);
    return s;
  };
  const SampleSet mem = read(true), idx = read(false);
  ASSERT_TRUE(idx.indexed);
  EXPECT_TRUE(idx.tokens.empty() && idx.trained.empty());
  ASSERT_EQ(idx.size(), 42);
  EXPECT_EQ(idx.starts, mem.starts);
  EXPECT_EQ(idx.counted, mem.counted);
  EXPECT_EQ(idx.description, mem.description);
  for (int64_t i = 0; i < idx.size(); ++i) {
    std::vector<int32_t> a, b;
    std::vector<uint8_t> ma, mb;
    mem.sample(i, 1 << 20, a, ma);
    idx.sample(i, 1 << 20, b, mb);
    ASSERT_EQ(a, b) << "sample " << i;
    ASSERT_EQ(ma, mb) << "sample " << i;
    EXPECT_EQ(static_cast<int64_t>(a.size()), mem.length(i));
  }
  for (const bool pack : {false, true}) {
    for (int rank = 0; rank < 2; ++rank) {
      const SamplerOptions o{T, 2, 2, 2, rank, 0, 11, true, pack};
      const BatchSampler m(mem, o), x(idx, o);
      std::vector<int32_t> in_m, tgt_m, in_x, tgt_x;
      RowSegments seg_m, seg_x;
      for (int64_t step = 0; step < 12; ++step) {
        EXPECT_EQ(m.step_counted_targets(step), x.step_counted_targets(step));
        for (int64_t micro = 0; micro < 2; ++micro) {
          m.train_batch(step, micro, in_m, tgt_m, &seg_m);
          x.train_batch(step, micro, in_x, tgt_x, &seg_x);
          ASSERT_EQ(in_m, in_x) << "step " << step << " micro " << micro << (pack ? " packed" : "");
          ASSERT_EQ(tgt_m, tgt_x);
          ASSERT_EQ(seg_m, seg_x);
          EXPECT_EQ(m.counted_targets(step, micro), x.counted_targets(step, micro));
        }
      }
      for (int64_t v = 0; v < 3; ++v) {
        m.val_batch(v, in_m, tgt_m);
        x.val_batch(v, in_x, tgt_x);
        ASSERT_EQ(in_m, in_x) << "validation batch " << v;
        ASSERT_EQ(tgt_m, tgt_x);
      }
    }
  }
  // The file changed under the run (here its size too, which a clock's coarse tick cannot hide), or cut short: named.
  std::string changed = lines;
  changed.replace(changed.find("Sample 0"), 8, "Sample 00");
  write(d + "/train.jsonl", changed);
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  try {
    idx.sample(0, 1 << 20, ids, mask);
    ADD_FAILURE() << "a changed line was read";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("train.jsonl' changed since the run read it"), std::string::npos) << e.what();
  }
  write(d + "/train.jsonl", "");
  EXPECT_THROW(idx.sample(5, 1 << 20, ids, mask), UserError);
  fs::remove_all(d);
}
