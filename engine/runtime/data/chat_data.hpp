// ds — fine-tuning data as people have it: jsonl files (or a directory of them) whose lines are
//   {"text": ...}                                        trained whole
//   {"prompt": ..., "completion": ...}                   the loss on the completion only
//   {"messages": [{"role": ..., "content": ...}, ...]}   rendered by the model's chat template, the loss on
//                                                        the assistant's turns only
// tokenized with the model's own tokenizer (hf_tokenizer.hpp). A conversation (or a prompt and its
// completion) is rendered to one string with the spans the loss counts marked, tokenized whole (so its
// tokens are exactly the template's), and a token is trained when its first byte lies in a marked span. Every problem in a file (not JSON, no known
// shape, an unknown role, a wrong type) is a UserError naming file:line, raised before training starts.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/runtime/data/hf_tokenizer.hpp"

namespace ds {

// The chat formats ds renders, each exactly as the model's official template does for plain
// conversations (no tools): chatml (Qwen 2/2.5: <|im_start|>role\n...<|im_end|>\n, with the template's
// default system turn when the conversation has none), llama3 (Llama 3.0: <|start_header_id|>role
// <|end_header_id|>\n\n...<|eot_id|>, contents trimmed), llama3.1 (3.1-3.3: a system turn always, with
// "Cutting Knowledge Date: December 2023" and the template's default date), phi3 (Phi-3 and 3.5:
// <|role|>\n...<|end|>\n, then the EOS token the template ends a conversation with), gemma (Gemma and
// Gemma 2: BOS, then <start_of_turn>user|model\n...<end_of_turn>\n, contents trimmed, no system turn, roles
// alternating from the user's), gemma3 (Gemma 3: the same, a system turn's content and a blank line put
// before the first user turn's), llama2 (Llama 2 chat: BOS [INST] user [/INST] answer EOS, a system turn
// in <<SYS>> before the first user turn's content) and mistral (Mistral 7B Instruct v0.1/v0.2, Mixtral
// 8x7B Instruct v0.1: BOS, then [INST] user [/INST]answer EOS, no system turn), mistral_v3 (Mistral 7B Instruct
// v0.3, Mixtral 8x22B Instruct, Mistral Large 2407: BOS, then [INST] user[/INST] answer EOS, answers trimmed, a system
// turn shown only before the last user turn when the conversation ends with it) and qwen3 (Qwen3: ChatML with
// no default system turn, each assistant turn's reasoning taken from its reasoning_content, or else from its
// content where that holds a </think> (what precedes the first one, after the last <think> there; the answer is
// what follows the last </think>); the turns after the last user turn show it in a <think> block,
// the last one always, empty when it has none; the earlier ones drop it).
enum class ChatFormatKind { chatml, llama3, llama3_1, phi3, gemma, gemma3, llama2, mistral, mistral_v3, qwen3 };

struct ChatFormat {
  ChatFormatKind kind = ChatFormatKind::chatml;
  std::string default_system;  // chatml: the system turn the template adds when a conversation has none
  std::string date = "26 Jul 2024";  // llama3.1: the template's default date_string
  bool date_of_the_day = false;      // llama3.1: the template prefers strftime_now (Llama 3.2): ds keeps the fixed date
  std::string eos;                   // phi3: what the template appends after the last turn (its eos_token)
  bool skip_empty_system = false;    // phi3: Phi-3.5's template leaves out a system turn with no content
  std::string bos;                   // gemma, gemma3, llama2, mistral, mistral_v3: the template's bos_token
  std::string describe() const;
};

// `name`: data.chat_template ("auto", "chatml", "llama3", "llama3.1", "phi3", "gemma", "gemma3", "llama2", "mistral",
// "mistral-v3", "qwen3"). "auto" recognises the tokenizer's
// template; a template ds cannot render is refused naming the choices, never approximated.
ChatFormat resolve_chat_format(const std::string& name, const HfTokenizer& tok);

struct ChatMessage {
  std::string role, content;
  std::optional<std::string> reasoning = std::nullopt;  // the message's "reasoning_content": read by qwen3 (the other templates ignore it)
};

// One conversation as the template renders it, and the byte spans [begin, end) the loss counts: each
// assistant turn's content and its end-of-turn token.
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> trained;
  bool system_left_out = false;  // the template rendered the conversation's system turn nowhere (mistral_v3's rule)
};
// A conversation the format's template refuses to render (Gemma's: a system turn, roles that do not
// alternate), with the template's reason.
struct ChatRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// `trained_from`: assistant turns before this message index are context, not trained (a conversational
// prompt/completion pair: the prompt's turns). Throws ChatRefused where the template raises.
RenderedChat render_chat(const ChatFormat& f, const std::vector<ChatMessage>& messages, size_t trained_from = 0);

// How a jsonl line becomes a sample (the tokenizer, the resolved chat format, the options): what an indexed
// SampleSet reads its samples again with. Defined in chat_data.cpp.
class SampleLines;
struct SampleFile {
  std::string path;
  std::shared_ptr<const SampleLines> lines;
  int64_t bytes = 0, modified_ns = 0;  // as it was read: a file changed since is refused, not trained on
};

// Samples one after another: sample i is tokens [starts[i], starts[i + 1]); trained[k] says whether the
// loss counts token k as a target (its prediction from token k - 1). Indexed (data whose tokens would not fit
// in memory): tokens and trained stay empty, starts still gives each sample's length, and `places` where its
// line is, read and tokenized again when a batch needs it (the same tokens: the same code reads both times).
struct SampleSet {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> trained;
  std::vector<int64_t> starts{0};
  int32_t pad_id = 0;
  int64_t held_out_from = -1;  // >= 0: samples from here on validate (data.val_path), whatever data.val_fraction says
  std::string description;  // "chat.jsonl: 1,204 samples (1,204 messages), 201,337 tokens, 84,112 trained"
  // Each sample's counted targets within a row of `counted_seq_len` positions (its targets the loss counts
  // there); filled when the reader knew the row length (SampleOptions::seq_len).
  std::vector<int32_t> counted;
  int64_t counted_seq_len = 0;
  struct Place {
    int64_t offset;  // the line's first byte in its file
    int32_t bytes;   // the line's length, its end of line left out
    int32_t file;    // in `files`
  };
  bool indexed = false;
  std::vector<Place> places;
  std::vector<SampleFile> files;

  int64_t size() const { return static_cast<int64_t>(starts.size()) - 1; }
  int64_t length(int64_t i) const { return starts[i + 1] - starts[i]; }
  int64_t total_tokens() const { return starts.back(); }
  // Sample i's first min(length, limit) tokens and whether each is trained, from memory or from its file.
  void sample(int64_t i, int64_t limit, std::vector<int32_t>& ids, std::vector<uint8_t>& mask) const;
  void add(const std::vector<int32_t>& ids, const std::vector<uint8_t>& mask);
  void append(const SampleSet& more);  // its samples after these (both in memory, or both indexed)
};

struct SampleOptions {
  std::string chat_template = "auto";  // data.chat_template, resolved at the first conversation
  bool train_on_prompt = false;        // the loss counts the prompt's (and the user's) tokens too
  std::string source;                  // for messages: data.path
  int64_t seq_len = 0;                 // > 0: count each sample's trained targets within a row of this many positions
  bool keep_tokens = true;             // false: indexed (read_jsonl_samples with a shared tokenizer only)
  bool skip_bad_lines = false;         // a line that is no sample is skipped and counted, not an error
};

// Reads samples line by line, keeping what the lines share: the chat format (resolved when the first
// conversation needs it, so a file of texts needs no template) and how many of each shape it read.
class JsonlSamples {
 public:
  JsonlSamples(const HfTokenizer& tok, SampleOptions o);  // in memory
  JsonlSamples(std::shared_ptr<const HfTokenizer> tok, SampleOptions o);  // in memory, or indexed (keep_tokens false)
  // One line's sample: UserError "where: ..." (where = file:line) for a line that is not one. In memory only.
  void add_line(const std::string& line, const std::string& where);
  // Every line of a file; blank lines are skipped.
  void add_file(const std::string& path);
  // The samples read, described; UserError when there are none.
  SampleSet take();

 private:
  void add_line_at(const std::string& line, const std::string& where, const SampleSet::Place* place);
  std::shared_ptr<const HfTokenizer> owned_;
  const HfTokenizer& tok_;
  SampleOptions o_;
  std::optional<ChatFormat> format_;
  SampleSet out_;
  int64_t shapes_[3] = {0, 0, 0};  // text, prompt/completion, conversations
  int64_t trained_ = 0;            // targets the loss counts, over every sample
  int64_t untrained_ = 0;          // samples none of whose targets is trained
  std::string first_untrained_;    // the first one's file:line
  int64_t systems_left_out_ = 0;   // conversations whose system turn the template rendered nowhere
  std::string first_system_left_out_;
  int64_t skipped_ = 0;             // lines that are no sample, skipped (skip_bad_lines)
  std::string first_skipped_;       // the first one's file:line and why
  int64_t reasoning_left_out_ = 0;  // conversations with a reasoning_content the format does not render
  std::string first_reasoning_left_out_;
};

// The samples these jsonl files hold, counted without tokenizing them: their lines that are not blank (each is
// one sample, or an error when read). For train.epochs, which the plan resolves before the data is read.
int64_t count_jsonl_samples(const std::vector<std::string>& files);

// The samples of these jsonl files, in file then line order (in memory; indexed with the shared tokenizer
// and o.keep_tokens false).
SampleSet read_jsonl_samples(const std::vector<std::string>& files, const HfTokenizer& tok, const SampleOptions& o);
SampleSet read_jsonl_samples(const std::vector<std::string>& files, std::shared_ptr<const HfTokenizer> tok, const SampleOptions& o);

}  // namespace ds
