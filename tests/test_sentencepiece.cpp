// SentencePiece's tokenizer.model as ds reads it (without the library), against the library itself (Debian's
// libsentencepiece, linked into this test only): a BPE model shaped like Llama 2's (byte fallback, the identity
// normalizer, a '▁' put first) trained here on the corpus, then the same ids on the corpus line by line and on
// hostile text; the control pieces matched whole in a text (as Hugging Face's Llama tokenizers do), the BOS
// tokenizer(text) adds, decoding, and the models ds refuses.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"
#include "test_helpers.hpp"

using namespace ds;
namespace fs = std::filesystem;

namespace {

std::string scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("ds_spm_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// A model trained on the corpus's first lines with the library's trainer, written as `dir`/tokenizer.model.
void train(const std::string& dir, const std::string& options) {
  write(dir + "/corpus.txt", test::read_text(std::string(DS_SHARED_DIR) + "/data/tinyshakespeare.txt").substr(0, 200000) +
                                 "naïve café 日本語のテキスト 中文 🙂👍🏽 हिन्दी العربية 1234567 3.14159\n");
  const std::string args = "--input=" + dir + "/corpus.txt --model_prefix=" + dir + "/tokenizer --minloglevel=2 --num_threads=2 " + options;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  ASSERT_TRUE(status.ok()) << status.ToString();
}

const char* const kLlamaLike =
    "--model_type=bpe --vocab_size=1200 --byte_fallback=true --normalization_rule_name=identity --remove_extra_whitespaces=false "
    "--add_dummy_prefix=true --character_coverage=0.9995 --split_digits=true --allow_whitespace_only_pieces=true "
    "--control_symbols=[INST],[/INST] --max_sentence_length=100000";

// The library's ids of `text`.
std::vector<int32_t> library_ids(const sentencepiece::SentencePieceProcessor& lib, const std::string& text) {
  std::vector<int> ids;
  EXPECT_TRUE(lib.Encode(text, &ids).ok());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string replaced(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

// Texts that trip SentencePiece's BPE: every printable and control ASCII character, runs of spaces (which merge into
// whitespace pieces), characters the model lacks (byte fallback), a literal '▁', emoji with modifiers, CJK.
std::vector<std::string> hostile_texts() {
  std::string ascii;
  for (int c = 1; c < 128; ++c) ascii += static_cast<char>(c);
  return {ascii,
          "   three leading spaces and  two  inside   ",
          std::string(120, ' ') + "end" + std::string(30, '\n') + "!!!???...",
          "naïve café é ὈΔΥΣΣΕΎΣ 日本語のテキスト 中文 한국어 ǅ ꙮ",
          "🙂👍🏽 👨‍👩‍👧 हिन्दी العربية ٣٤٥٦ Ⅻ ½",
          "\xE2\x96\x81" "already marked \xE2\x96\x81\xE2\x96\x81 twice",
          "tabs\tand\r\nnewlines\n\n\tmixed",
          "x",
          ""};
}

}  // namespace

TEST(SentencePieceModel, EncodesTheCorpusAndHostileTextAsTheLibraryDoes) {
  DS_REQUIRE_SHARED_DATA();
  const struct {
    const char* name;
    std::string options, described;
  } models[] = {
      {"llama_like", kLlamaLike, "SentencePiece BPE, 1,200 pieces (5 special, 256 bytes), '▁' before every segment"},
      // Without byte fallback: characters the vocabulary lacks become <unk>, a run of them one.
      {"no_fallback", replaced(replaced(kLlamaLike, "--byte_fallback=true", "--byte_fallback=false"), "--character_coverage=0.9995", "--character_coverage=0.98"),
       "SentencePiece BPE, 1,200 pieces (5 special, 0 bytes)"},
      // No '▁' put first (Gemma's way).
      {"no_prefix", replaced(kLlamaLike, "--add_dummy_prefix=true", "--add_dummy_prefix=false"), "SentencePiece BPE, 1,200 pieces (5 special, 256 bytes)"},
  };
  for (const auto& model : models) {
  SCOPED_TRACE(model.name);
  const std::string dir = scratch(model.name);
  train(dir, model.options);
  sentencepiece::SentencePieceProcessor lib;
  ASSERT_TRUE(lib.Load(dir + "/tokenizer.model").ok());
  fs::remove(dir + "/tokenizer.vocab");
  const HfTokenizer tok(dir);  // no tokenizer.json: the model file
  EXPECT_NE(tok.describe().find("tokenizer.model: " + model.described), std::string::npos) << tok.describe();
  EXPECT_EQ(tok.vocab_size(), lib.GetPieceSize());

  std::vector<std::string> texts = hostile_texts();
  std::istringstream corpus(test::read_text(std::string(DS_SHARED_DIR) + "/data/tinyshakespeare.txt").substr(200000, 60000));
  for (std::string line; std::getline(corpus, line);) texts.push_back(line);
  size_t compared = 0;
  for (const std::string& text : texts) {
    std::vector<int> want;
    ASSERT_TRUE(lib.Encode(text, &want).ok());
    std::vector<int32_t> lengths;
    const std::vector<int32_t> got = tok.encode(text, false, &lengths);
    ASSERT_EQ(got, std::vector<int32_t>(want.begin(), want.end())) << "'" << text << "'";
    int64_t covered = 0;  // the lengths map the tokens back onto the text exactly
    for (int32_t n : lengths) covered += n;
    EXPECT_EQ(covered, static_cast<int64_t>(text.size())) << text;
    std::string decoded;  // the library writes an <unk> as " \u2047 ", ds as the token itself (as Hugging Face does)
    ASSERT_TRUE(lib.Decode(want, &decoded).ok());
    if (std::find(want.begin(), want.end(), lib.unk_id()) == want.end()) {
      EXPECT_EQ(tok.decode(got), decoded) << "'" << text << "'";
    }
    ++compared;
  }
  EXPECT_GT(compared, 1000u);
  }
}

TEST(SentencePieceModel, ControlPiecesAreMatchedWholeAndTheBosComesFirst) {
  DS_REQUIRE_SHARED_DATA();
  const std::string dir = scratch("controls");
  train(dir, kLlamaLike);
  sentencepiece::SentencePieceProcessor lib;
  ASSERT_TRUE(lib.Load(dir + "/tokenizer.model").ok());
  const auto lib_ids = [&](const std::string& text) { return library_ids(lib, text); };
  const HfTokenizer tok(dir + "/tokenizer.model");  // the file named
  ASSERT_EQ(tok.bos_id(), lib.bos_id());
  ASSERT_EQ(tok.eos_id(), lib.eos_id());
  EXPECT_EQ(tok.bos_token(), "<s>");
  EXPECT_EQ(tok.eos_token(), "</s>");
  const int32_t inst = lib.PieceToId("[INST]"), end_inst = lib.PieceToId("[/INST]");
  ASSERT_GT(inst, 2);
  // Each text between special pieces is encoded as SentencePiece encodes a text ('▁' first: Hugging Face's legacy way).
  std::vector<int32_t> want = {tok.bos_id(), inst};
  for (int32_t id : lib_ids(" What is 2+2? ")) want.push_back(id);
  want.push_back(end_inst);
  for (int32_t id : lib_ids("It is 4.")) want.push_back(id);
  want.push_back(tok.eos_id());
  std::vector<int32_t> lengths;
  EXPECT_EQ(tok.encode("<s>[INST] What is 2+2? [/INST]It is 4.</s>", false, &lengths), want);
  EXPECT_EQ(lengths[0], 3);  // <s>
  EXPECT_EQ(tok.decode(want), "<s>[INST]  What is 2+2? [/INST] It is 4.</s>");  // each segment's '▁' decodes as a space
  // tokenizer(text): the BOS first (add_bos_token defaults to true), no EOS; tokenizer_config.json may say otherwise.
  std::vector<int32_t> with_bos = lib_ids("Hi");
  with_bos.insert(with_bos.begin(), tok.bos_id());
  EXPECT_EQ(tok.encode("Hi", true), with_bos);
  write(dir + "/tokenizer_config.json", R"({"add_bos_token": false, "add_eos_token": true, "legacy": false})");
  const HfTokenizer no_bos(dir);
  std::vector<int32_t> with_eos = lib_ids("Hi");
  with_eos.push_back(lib.eos_id());
  EXPECT_EQ(no_bos.encode("Hi", true), with_eos);
  // "legacy": false: the '▁' before the text's start only, not after a special piece.
  const std::vector<int32_t> after = no_bos.encode("[INST]Hi");
  ASSERT_GE(after.size(), 2u);
  EXPECT_EQ(after.front(), inst);
  EXPECT_NE(std::vector<int32_t>(after.begin() + 1, after.end()), lib_ids("Hi"));  // the library's would start with '▁'
  EXPECT_EQ(no_bos.decode(after), "[INST]Hi");
  EXPECT_NE(no_bos.describe().find("'▁' before the text's first segment"), std::string::npos) << no_bos.describe();
  // A chat template from tokenizer_config.json, rendered with the model file's tokens.
  write(dir + "/tokenizer_config.json",
        R"({"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"})");
  const HfTokenizer chat(dir);
  JsonlSamples reader(chat, {});
  reader.add_line(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})", "chat.jsonl:1");
  const SampleSet s = reader.take();
  ASSERT_EQ(s.size(), 1);
  EXPECT_EQ(s.tokens.front(), chat.bos_id());
  EXPECT_EQ(s.tokens.back(), chat.eos_id());
  EXPECT_NE(s.description.find("chat format mistral"), std::string::npos) << s.description;
}

// A user-defined piece is matched whole in the text, and the text on each side encoded on its own, as Hugging
// Face's tokenizers made from the file do (the library itself would not put a '▁' after one); null flags in
// tokenizer_config.json are Hugging Face's defaults.
TEST(SentencePieceModel, UserDefinedPiecesSplitTheTextAsHuggingFacesTokenizersDo) {
  DS_REQUIRE_SHARED_DATA();
  const std::string dir = scratch("user_defined");
  train(dir, std::string(kLlamaLike) + " --user_defined_symbols=<U>,@@");
  sentencepiece::SentencePieceProcessor lib;
  ASSERT_TRUE(lib.Load(dir + "/tokenizer.model").ok());
  const auto lib_ids = [&](const std::string& text) { return library_ids(lib, text); };
  write(dir + "/tokenizer_config.json", R"({"legacy": null, "add_bos_token": null})");
  const HfTokenizer tok(dir);
  std::vector<int32_t> want = lib_ids("hello");
  want.push_back(lib.PieceToId("@@"));
  for (int32_t id : lib_ids("world")) want.push_back(id);
  EXPECT_EQ(tok.encode("hello@@world"), want);
  EXPECT_EQ(tok.encode("Hi", true).front(), lib.bos_id());  // add_bos_token null: the default, true
}

TEST(SentencePieceModel, ModelsItCannotEncodeExactlyAreRefusedNamingWhatTheyHold) {
  DS_REQUIRE_SHARED_DATA();
  const struct {
    const char* name;
    std::string options, expected;
  } cases[] = {
      {"unigram", "--model_type=unigram --vocab_size=800 --normalization_rule_name=identity --remove_extra_whitespaces=false",
       "its model type is Unigram"},
      {"nfkc", "--model_type=bpe --vocab_size=800 --remove_extra_whitespaces=false", "its normalizer is 'nmt_nfkc'"},
      {"squeezed", "--model_type=bpe --vocab_size=800 --normalization_rule_name=identity", "removes extra whitespace"},
  };
  for (const auto& c : cases) {
    const std::string dir = scratch(c.name);
    train(dir, c.options);
    try {
      HfTokenizer tok(dir);
      ADD_FAILURE() << c.name << " read as " << tok.describe();
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tokenizer.model"), std::string::npos) << e.what();
    }
  }
  // A vocabulary whose piece "ab" holds a character, b, that is not a piece: SentencePiece would build "ab" from
  // the characters, ds from the pieces it has. Written by hand (field 1: pieces {1: text, 2: score, 3: type};
  // 2: the trainer {3: model type BPE}; 3: the normalizer {1: "identity", 4: remove_extra_whitespaces false}).
  const auto field = [](int number, const std::string& bytes) {
    return std::string(1, static_cast<char>(number << 3 | 2)) + static_cast<char>(bytes.size()) + bytes;
  };
  const auto piece = [&](const std::string& text, int type) {
    return field(1, field(1, text) + std::string("\x15\0\0\0\0", 5) + std::string(1, '\x18') + static_cast<char>(type));
  };
  const std::string edited = scratch("edited");
  write(edited + "/tokenizer.model", piece("<unk>", 2) + piece("a", 1) + piece("ab", 1) + field(2, std::string("\x18\x02", 2)) +
                                         field(3, field(1, "identity") + std::string("\x20\x00", 2)));
  try {
    HfTokenizer tok(edited);
    ADD_FAILURE() << "read as " << tok.describe();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("its piece 'ab' holds the character 'b', which is not a piece of its own"), std::string::npos)
        << e.what();
  }
  write(edited + "/tokenizer.model", piece("<unk>", 2) + piece("a", 1) + piece("b", 1) + piece("ab", 1) + field(2, std::string("\x18\x02", 2)) +
                                         field(3, field(1, "identity") + std::string("\x20\x00", 2)));
  EXPECT_EQ(HfTokenizer(edited).encode("ab ab"), (std::vector<int32_t>{0, 3, 0, 3}));  // '▁' is no piece here: <unk>
  const std::string broken = scratch("broken");
  write(broken + "/tokenizer.model", std::string("\x0a\xff\xff\xff\x0f", 5));  // a piece longer than the file
  EXPECT_THROW(HfTokenizer{broken}, UserError);
}
