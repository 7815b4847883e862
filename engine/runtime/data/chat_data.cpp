#include "engine/runtime/data/chat_data.hpp"

#include <algorithm>
#include <sys/stat.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "engine/plan/packing.hpp"
#include "engine/runtime/data/token_source.hpp"  // DataReadError

namespace ds {
namespace {

using json = nlohmann::json;

// A line longer than this is refused: a jsonl sample is a conversation, not a book.
constexpr size_t kMaxLineBytes = size_t{16} << 20;
constexpr int kMaxLineNesting = 16;  // {"messages": [{"role", "content"}]} is three levels

const char* const kChoices =
    "name one in data.chat_template: chatml (Qwen 2/2.5), llama3 (Llama 3.0), llama3.1 (Llama 3.1-3.3), phi3 (Phi-3, Phi-3.5), "
    "gemma (Gemma, Gemma 2), gemma3 (Gemma 3), llama2 (Llama 2 chat), mistral (Mistral 7B Instruct v0.1/v0.2, Mixtral 8x7B Instruct v0.1), "
    "mistral-v3 (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Large 2407), qwen3 (Qwen3, with its <think> blocks)";

// Jinja's trim: Python's str.strip(), whose str.isspace() is White_Space and U+001C..U+001F.
bool python_space(uint32_t c) { return is_white_space(c) || (c >= 0x1C && c <= 0x1F); }

std::string trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    uint32_t cp;
    const int len = decode_utf8(s, begin, &cp);
    if (!python_space(cp)) break;
    begin += len;
  }
  while (end > begin) {
    const size_t start = code_point_before(s, end, begin);
    uint32_t cp;
    decode_utf8(s, start, &cp);
    if (!python_space(cp)) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

// The first string literal of the template that sits between `open` and `close` and is plain text (in the
// template's source, where a newline is written \n): the default system turn of Qwen's templates.
std::string literal_between(const std::string& tmpl, const std::string& open, const std::string& close) {
  for (size_t a = tmpl.find(open); a != std::string::npos; a = tmpl.find(open, a + 1)) {
    const size_t b = tmpl.find(close, a + open.size());
    if (b == std::string::npos) return "";
    const std::string text = tmpl.substr(a + open.size(), b - a - open.size());
    const bool expression = text.find_first_of("'\"") != std::string::npos || text.find("{{") != std::string::npos ||
                            text.find("{%") != std::string::npos;  // the literal ended inside: an expression follows
    if (!text.empty() && !expression) return text;
  }
  return "";
}

void require_tokens(const HfTokenizer& tok, const std::vector<std::string>& names, const std::string& format) {
  for (const std::string& n : names)
    if (tok.id_of(n) < 0)
      throw UserError("the " + format + " chat format needs the token " + n + ", which " + tok.path() + " does not hold",
                      std::string("this tokenizer is not of that family: ") + kChoices);
}

}  // namespace

std::string ChatFormat::describe() const {
  switch (kind) {
    case ChatFormatKind::chatml:
      return "chatml" + (default_system.empty() ? std::string() : " (default system turn \"" + default_system + "\")");
    case ChatFormatKind::llama3: return "llama3";
    case ChatFormatKind::llama3_1:
      return "llama3.1 (date \"" + date + "\"" +
             (date_of_the_day ? std::string(", the template's fallback: Hugging Face renders the day's date, which would change a run's samples "
                                            "from one day to the next")
                              : std::string()) +
             ")";
    case ChatFormatKind::phi3: return "phi3" + (eos.empty() ? std::string() : " (ending with " + eos + ")");
    case ChatFormatKind::gemma: return "gemma";
    case ChatFormatKind::gemma3: return "gemma3";
    case ChatFormatKind::llama2: return "llama2";
    case ChatFormatKind::mistral: return "mistral";
    case ChatFormatKind::mistral_v3: return "mistral-v3";
    case ChatFormatKind::qwen3: return "qwen3";
  }
  return "";
}

namespace {

// data.chat_template auto: the format whose official template the tokenizer's is, by its lines; UserError naming the
// choices when it is none of them.
std::string recognise_template(const HfTokenizer& tok) {
  const std::string& t = tok.chat_template();
  std::string kind;
  if (t.empty())
    throw UserError(tok.path() + " has no chat template (tokenizer_config.json's chat_template, or chat_template.jinja)",
                    kChoices);
  // ChatML as Qwen 2/2.5 write it: no BOS, contents as given (a template that trims them or adds a BOS,
  // such as Hermes 3's, renders otherwise and is refused here; naming chatml renders it ChatML's way).
  const bool chatml = t.find("<|im_start|>") != std::string::npos && t.find("<think>") == std::string::npos &&
                      t.find("bos_token") == std::string::npos && t.find("trim") == std::string::npos;
  // Phi-3 mini's and 3.5's; Phi-3 medium's spells '<|user|>' + '\n' and drops system turns: not this format.
  const bool phi3 = t.find("<|user|>") != std::string::npos && t.find("<|assistant|>") != std::string::npos &&
                    t.find("<|end|>") != std::string::npos && t.find("bos_token") == std::string::npos &&
                    t.find("trim") == std::string::npos && t.find("'<|user|>' + '\\n'") == std::string::npos;
  // Qwen3's: the reasoning of the turns after the last user turn shown in <think> blocks (tools aside, the
  // template's whole logic is in these lines; another handling of <think> is refused below).
  const auto has = [&](const char* piece) { return t.find(piece) != std::string::npos; };
  const auto count = [&](const char* piece) {
    int n = 0;
    for (size_t at = t.find(piece); at != std::string::npos; at = t.find(piece, at + 1)) ++n;
    return n;
  };
  const bool qwen3_parse = has("split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n')") ||
                           (has("(message.content.split('</think>')|first).rstrip('\\n')") &&
                            has("(reasoning_content.split('<think>')|last).lstrip('\\n')"));
  const bool qwen3 = has("<|im_start|>") && !has("bos_token") && qwen3_parse &&
                     has("startswith('<tool_response>') and message.content.endswith('</tool_response>')") &&
                     has("if loop.index0 > ns.last_query_index %}") &&
                     has("if loop.last or (not loop.last and reasoning_content) %}") &&
                     has("'<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
                         "content.lstrip('\\n') }}") &&
                     has("'<|im_start|>' + message.role + '\\n' + content }}");
  if (chatml) kind = "chatml";
  else if (qwen3) kind = "qwen3";
  else if (phi3) kind = "phi3";
  else if (t.find("<|start_header_id|>") != std::string::npos)
    kind = t.find("Cutting Knowledge Date") != std::string::npos ? "llama3.1" : "llama3";
  // Gemma 3's folds a system turn into the first user turn; Gemma's and Gemma 2's refuse one.
  else if (t.find("<start_of_turn>") != std::string::npos && t.find("first_user_prefix") != std::string::npos)
    kind = "gemma3";
  else if (t.find("<start_of_turn>") != std::string::npos && t.find("System role not supported") != std::string::npos)
    kind = "gemma";
  // Llama 2 chat's, without a default system prompt (some copies carry one: refused).
  else if (t.find("<<SYS>>") != std::string::npos && t.find("{% set system_message = false %}") != std::string::npos &&
           t.find("bos_token + '[INST] ' + content.strip() + ' [/INST]'") != std::string::npos &&
           t.find("' '  + content.strip() + ' ' + eos_token") != std::string::npos && t.find("DEFAULT") == std::string::npos &&
           t.find("false information") == std::string::npos && t.find("message['role'] == 'system' %}{{") == std::string::npos)
    kind = "llama2";
  // Mistral 7B Instruct v0.1's (and Mixtral's); later Mistral templates place a system turn otherwise.
  else if (t.find("'[INST] ' + message['content'] + ' [/INST]'") != std::string::npos &&
           t.find("message['content'] + eos_token") != std::string::npos &&
           t.find("Only user and assistant roles are supported!") != std::string::npos)
    kind = "mistral";
  // Mistral's v3 tokenizer's (7B Instruct v0.3, Mixtral 8x22B, Large 2407): every line a conversation without tools
  // goes through, one system_message set, and its 24 outputs ({{ ... }}: an edited copy that prints more is not it).
  // Nemo's (Tekken) drops the spaces after [INST] and before an answer: not this format.
  else if (count("{{") == 24 && count("set system_message") == 1 && has("{{- bos_token }}\n{%- for message in loop_messages %}") &&
           has("{%- set loop_messages = messages[1:] %}") && has("{%- else %}\n    {%- set loop_messages = messages %}") &&
           has("{%- set system_message = messages[0][\"content\"] %}") && has("{%- if loop.last and system_message is defined %}") &&
           has("\"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\"") &&
           has("\"[INST] \" + message[\"content\"] + \"[/INST]\" }}") && has("{{- \" \" + message[\"content\"]|trim + eos_token}}\n") &&
           has("(message[\"role\"] == \"user\") != (ns.index % 2 == 0)"))
    kind = "mistral-v3";
  else
    throw UserError("ds cannot render this tokenizer's chat template (" + tok.path() + "): it begins \"" + t.substr(0, 120) +
                        "\"" + (t.find("<think>") != std::string::npos ? " and handles reasoning turns (<think>)" : ""),
                    std::string("ds renders these formats exactly and approximates none: ") + kChoices);
  return kind;
}

}  // namespace

ChatFormat resolve_chat_format(const std::string& name, const HfTokenizer& tok) {
  const std::string& t = tok.chat_template();
  ChatFormat f;
  const std::string kind = name == "auto" ? recognise_template(tok) : name;
  if (kind == "qwen3") {
    f.kind = ChatFormatKind::qwen3;
    require_tokens(tok, {"<|im_start|>", "<|im_end|>"}, "qwen3");
  } else if (kind == "chatml") {
    f.kind = ChatFormatKind::chatml;
    f.default_system = literal_between(t, "<|im_start|>system\\n", "<|im_end|>");
    size_t at;
    while ((at = f.default_system.find("\\n")) != std::string::npos) f.default_system.replace(at, 2, "\n");
    require_tokens(tok, {"<|im_start|>", "<|im_end|>"}, "chatml");
  } else if (kind == "llama3" || kind == "llama3.1") {
    f.kind = kind == "llama3" ? ChatFormatKind::llama3 : ChatFormatKind::llama3_1;
    const std::string date = literal_between(t, "set date_string = \"", "\"");
    if (!date.empty()) f.date = date;
    f.date_of_the_day = t.find("strftime_now") != std::string::npos;
    require_tokens(tok, {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, kind);
  } else if (kind == "phi3") {
    f.kind = ChatFormatKind::phi3;
    // The official templates end a conversation with eos_token unless a generation prompt is asked for.
    f.eos = t.empty() || t.find("eos_token") != std::string::npos ? tok.eos_token() : "";
    f.skip_empty_system = t.find("== 'system' and message['content']") != std::string::npos;
    require_tokens(tok, {"<|user|>", "<|assistant|>", "<|end|>"}, "phi3");
  } else if (kind == "gemma" || kind == "gemma3") {
    f.kind = kind == "gemma" ? ChatFormatKind::gemma : ChatFormatKind::gemma3;
    f.bos = tok.bos_token();
    require_tokens(tok, {"<start_of_turn>", "<end_of_turn>"}, kind);
  } else if (kind == "llama2" || kind == "mistral" || kind == "mistral-v3") {
    f.kind = kind == "llama2" ? ChatFormatKind::llama2 : kind == "mistral" ? ChatFormatKind::mistral : ChatFormatKind::mistral_v3;
    f.bos = tok.bos_token();
    f.eos = tok.eos_token();
    if (f.eos.empty() || tok.eos_id() < 0)
      throw UserError("the " + kind + " chat format ends each answer with the EOS token, which " + tok.path() + " does not name",
                      "set eos_token in tokenizer_config.json (Llama 2 and Mistral: </s>)");
  } else {
    throw UserError("data.chat_template \"" + name + "\" is not a format ds renders", kChoices);
  }
  return f;
}

namespace {

// Python's str.lstrip('\n'), rstrip('\n') and strip('\n').
std::string lstrip_newlines(const std::string& s) { return s.substr(std::min(s.find_first_not_of('\n'), s.size())); }
std::string rstrip_newlines(const std::string& s) {
  const size_t last = s.find_last_not_of('\n');
  return last == std::string::npos ? std::string() : s.substr(0, last + 1);
}
std::string strip_newlines(const std::string& s) { return lstrip_newlines(rstrip_newlines(s)); }

// Qwen3's template. Its last query is the last user turn (one whose content is a <tool_response> aside);
// the whole conversation when there is none.
template <class Turn>
void render_qwen3(const std::vector<ChatMessage>& messages, size_t trained_from, Turn& turn) {
  size_t last_query = messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& c = messages[i].content;
    const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 && c.compare(c.size() - 16, 16, "</tool_response>") == 0;
    if (messages[i].role == "user" && !tool_response) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "assistant") {
      turn("<|im_start|>" + m.role + "\n", m.content, "<|im_end|>", false, "\n");
      continue;
    }
    std::string content = m.content, reasoning;
    if (m.reasoning) {
      reasoning = *m.reasoning;
    } else if (const size_t close = content.find("</think>"); close != std::string::npos) {
      // split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'), and what follows the last </think>
      std::string before = rstrip_newlines(content.substr(0, close));
      if (const size_t open = before.rfind("<think>"); open != std::string::npos) before = before.substr(open + 7);
      reasoning = lstrip_newlines(before);
      content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
    }
    const bool shown = i > last_query && (i + 1 == messages.size() || !reasoning.empty());
    const std::string body = shown ? "<think>\n" + strip_newlines(reasoning) + "\n</think>\n\n" + lstrip_newlines(content) : content;
    turn("<|im_start|>assistant\n", body, "<|im_end|>", i >= trained_from, "\n");
  }
}

// Mistral's v3 template: after an optional first system turn, user and assistant alternate; the system turn's content
// goes before the last message only when that is a user turn (a conversation that ends with an answer shows it nowhere).
template <class Turn>
void render_mistral_v3(const ChatFormat& f, const std::vector<ChatMessage>& messages, size_t trained_from, RenderedChat& r, Turn& turn) {
  r.text += f.bos;
  const bool has_system = !messages.empty() && messages[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if ((m.role == "user") != ((i - first) % 2 == 0))
      throw ChatRefused("Mistral's v3 chat template raises \"After the optional system message, conversation roles must alternate "
                        "user/assistant/user/assistant/...\" (message " + std::to_string(i) + " is " + m.role + "'s)");
    if (m.role == "user") {
      const bool system_here = has_system && i + 1 == messages.size();
      r.text += "[INST] " + (system_here ? messages[0].content + "\n\n" : std::string()) + m.content + "[/INST]";
    } else if (m.role == "assistant") {
      // The space before an answer is trained with it: SentencePiece joins it to the answer's first word.
      turn("", " " + trim(m.content), f.eos, i >= trained_from, "");
    } else {
      throw ChatRefused("Mistral's v3 chat template raises \"Only user and assistant roles are supported, with the exception of an "
                        "initial optional system message!\" (message " + std::to_string(i) + " is " + m.role + "'s)");
    }
  }
  r.system_left_out = has_system && messages.back().role != "user";
}

}  // namespace

RenderedChat render_chat(const ChatFormat& f, const std::vector<ChatMessage>& messages, size_t trained_from) {
  RenderedChat r;
  std::string& s = r.text;
  auto turn = [&](const std::string& open, const std::string& content, const std::string& close, bool trained,
                  const std::string& after) {
    s += open;
    const size_t begin = s.size();
    s += content + close;
    if (trained) r.trained.emplace_back(begin, s.size());
    s += after;
  };
  if (f.kind == ChatFormatKind::chatml) {
    if (!f.default_system.empty() && (messages.empty() || messages[0].role != "system"))
      turn("<|im_start|>system\n", f.default_system, "<|im_end|>", false, "\n");
    for (size_t i = 0; i < messages.size(); ++i)
      turn("<|im_start|>" + messages[i].role + "\n", messages[i].content, "<|im_end|>",
           messages[i].role == "assistant" && i >= trained_from, "\n");
    return r;
  }
  if (f.kind == ChatFormatKind::qwen3) {
    render_qwen3(messages, trained_from, turn);
    return r;
  }
  if (f.kind == ChatFormatKind::gemma || f.kind == ChatFormatKind::gemma3) {
    s += f.bos;
    size_t first = 0;
    std::string prefix;  // gemma3: the system turn's content, before the first user turn's
    if (!messages.empty() && messages[0].role == "system") {
      if (f.kind == ChatFormatKind::gemma) throw ChatRefused("Gemma's chat template raises \"System role not supported\"");
      prefix = messages[0].content + "\n\n";
      first = 1;
    }
    for (size_t i = first; i < messages.size(); ++i) {
      if ((messages[i].role == "user") != ((i - first) % 2 == 0))
        throw ChatRefused("Gemma's chat template raises \"Conversation roles must alternate user/assistant/user/assistant/...\" (message " +
                          std::to_string(i) + " is " + messages[i].role + "'s)");
      turn("<start_of_turn>" + std::string(messages[i].role == "assistant" ? "model" : messages[i].role.c_str()) + "\n" +
               (i == first ? prefix : ""),
           trim(messages[i].content), "<end_of_turn>", messages[i].role == "assistant" && i >= trained_from, "\n");
    }
    return r;
  }
  if (f.kind == ChatFormatKind::llama2 || f.kind == ChatFormatKind::mistral) {
    const bool llama2 = f.kind == ChatFormatKind::llama2;
    if (!llama2) s += f.bos;
    size_t first = 0;
    std::string system;
    if (llama2 && !messages.empty() && messages[0].role == "system") {
      system = "<<SYS>>\n" + messages[0].content + "\n<</SYS>>\n\n";
      first = 1;
    }
    for (size_t i = first; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if ((m.role == "user") != ((i - first) % 2 == 0))
        throw ChatRefused(std::string(llama2 ? "Llama 2's" : "Mistral's") +
                          " chat template raises \"Conversation roles must alternate user/assistant/user/assistant/...\" (message " +
                          std::to_string(i) + " is " + m.role + "'s)");
      if (!llama2 && m.role == "system") throw ChatRefused("Mistral's chat template raises \"Only user and assistant roles are supported!\"");
      const std::string content = i == first ? system + m.content : m.content;
      const bool trained = m.role == "assistant" && i >= trained_from;
      if (llama2 && m.role == "user") s += f.bos + "[INST] " + trim(content) + " [/INST]";
      else if (m.role == "user") s += "[INST] " + content + " [/INST]";
      // The answer's leading space is trained with it: SentencePiece joins it to the answer's first word.
      else if (llama2 && m.role == "assistant") turn("", " " + trim(content) + " ", f.eos, trained, "");
      else if (m.role == "assistant") turn("", content, f.eos, trained, "");
      // Llama 2's: a system turn past the first renders nothing.
    }
    return r;
  }
  if (f.kind == ChatFormatKind::mistral_v3) {
    render_mistral_v3(f, messages, trained_from, r, turn);
    return r;
  }
  if (f.kind == ChatFormatKind::phi3) {
    for (size_t i = 0; i < messages.size(); ++i) {
      if (messages[i].role == "system" && messages[i].content.empty() && f.skip_empty_system) continue;
      turn("<|" + messages[i].role + "|>\n", messages[i].content, "<|end|>", messages[i].role == "assistant" && i >= trained_from, "\n");
    }
    s += f.eos;
    return r;
  }
  s += "<|begin_of_text|>";
  size_t first = 0;
  if (f.kind == ChatFormatKind::llama3_1) {
    const bool has_system = !messages.empty() && messages[0].role == "system";
    turn("<|start_header_id|>system<|end_header_id|>\n\n",
         "Cutting Knowledge Date: December 2023\nToday Date: " + f.date + "\n\n" + (has_system ? trim(messages[0].content) : ""),
         "<|eot_id|>", false, "");
    first = has_system ? 1 : 0;
  }
  for (size_t i = first; i < messages.size(); ++i)
    turn("<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n", trim(messages[i].content), "<|eot_id|>",
         messages[i].role == "assistant" && i >= trained_from, "");
  return r;
}

namespace {

// Tokens of `text` and whether each is trained: its first byte lies in one of the spans.
void tokens_with_mask(const std::string& text, const std::vector<std::pair<size_t, size_t>>& spans, const HfTokenizer& tok,
                      std::vector<int32_t>& ids, std::vector<uint8_t>& mask) {
  std::vector<int32_t> lengths;
  ids = tok.encode(text, false, &lengths);
  mask.assign(ids.size(), 0);
  size_t at = 0, span = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    while (span < spans.size() && spans[span].second <= at) ++span;
    mask[k] = span < spans.size() && spans[span].first <= at;
    at += static_cast<size_t>(lengths[k]);
  }
}

// A line that is no sample (data.skip_bad_lines skips these, and only these).
struct BadLine : UserError {
  using UserError::UserError;
};

[[noreturn]] void bad_line(const std::string& where, const std::string& what) {
  throw BadLine(where + ": " + what,
                  "each line is one JSON object: {\"text\": ...}, {\"prompt\": ..., \"completion\": ...} or "
                  "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]} (roles system, user, assistant)");
}

std::vector<ChatMessage> read_messages(const json& list, const std::string& where, const char* key) {
  if (!list.is_array()) bad_line(where, std::string("\"") + key + "\" is " + list.type_name() + ", not a list of messages");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    const std::string at = std::string(key) + "[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") || !m["content"].is_string())
      bad_line(where, at + " is not {\"role\": string, \"content\": string}: " + m.dump().substr(0, 200));
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      bad_line(where, at + " has the role \"" + role + "\" (ds reads system, user and assistant; tool turns are not read yet)");
    // Templates render a message's tool calls (Mistral's [TOOL_CALLS], Qwen's <tool_call>): not read yet, so refused
    // rather than trained without them.
    if (m.contains("tool_calls") && !m["tool_calls"].is_null())
      bad_line(where, at + " has tool_calls (ds reads system, user and assistant turns without tools; tool turns are not read yet)");
    ChatMessage message{role, m["content"].get<std::string>(), std::nullopt};
    if (m.contains("reasoning_content") && !m["reasoning_content"].is_null()) {
      if (!m["reasoning_content"].is_string())
        bad_line(where, at + "'s reasoning_content is " + m["reasoning_content"].type_name() + ", not a string");
      message.reasoning = m["reasoning_content"].get<std::string>();
    }
    out.push_back(std::move(message));
  }
  if (out.empty()) bad_line(where, std::string("\"") + key + "\" is empty");
  return out;
}

}  // namespace

namespace {

// One line's sample, and what the reader counts of it.
struct LineSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  int shape = 0;  // 0 text, 1 prompt/completion, 2 conversation
  bool system_left_out = false, reasoning_left_out = false;
};

// A line as a sample: the one code path that reads a line the first time and again when an indexed set needs it.
// `format` gives the chat format (resolved at the first conversation).
LineSample sample_of_line(const std::string& line, const std::string& where, const HfTokenizer& tok, const SampleOptions& o,
                          const std::function<const ChatFormat&()>& format) {
  if (json_nesting_exceeded_at(line, kMaxLineNesting) != std::string::npos)
    bad_line(where, "nests deeper than " + std::to_string(kMaxLineNesting) + " levels");
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    bad_line(where, std::string("not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) bad_line(where, std::string("a JSON ") + j.type_name() + ", not an object");
  LineSample out;
  const auto chat = [&](const std::vector<ChatMessage>& messages, size_t trained_from) {
    RenderedChat r;
    try {
      r = render_chat(format(), messages, trained_from);
    } catch (const ChatRefused& e) {
      throw BadLine(where + ": " + e.what(), "the model's chat template refuses this conversation: fix the line, or leave it out");
    }
    out.system_left_out = r.system_left_out;
    // Only Qwen3's template renders a reasoning_content; the others have no place for it.
    out.reasoning_left_out = format().kind != ChatFormatKind::qwen3 &&
                             std::any_of(messages.begin(), messages.end(), [](const ChatMessage& m) { return m.reasoning && !m.reasoning->empty(); });
    tokens_with_mask(r.text, o.train_on_prompt ? std::vector<std::pair<size_t, size_t>>{{0, r.text.size()}} : r.trained, tok, out.ids, out.mask);
  };
  if (j.contains("messages")) {
    chat(read_messages(j["messages"], where, "messages"), 0);
    out.shape = 2;
  } else if (j.contains("prompt") || j.contains("completion")) {
    if (!j.contains("prompt") || !j.contains("completion")) bad_line(where, "has \"prompt\" or \"completion\" but not both");
    const json &p = j["prompt"], &c = j["completion"];
    if (p.is_string() && c.is_string()) {  // prompt + completion tokenized as one text (as TRL does), then EOS
      const std::string prompt = p.get<std::string>(), text = prompt + c.get<std::string>();
      std::vector<int32_t> body;
      std::vector<uint8_t> body_mask;
      tokens_with_mask(text, {{o.train_on_prompt ? 0 : prompt.size(), text.size()}}, tok, body, body_mask);
      out.ids = tok.prefix_ids();
      out.mask.assign(out.ids.size(), o.train_on_prompt ? 1 : 0);
      out.ids.insert(out.ids.end(), body.begin(), body.end());
      out.mask.insert(out.mask.end(), body_mask.begin(), body_mask.end());
      if (tok.eos_id() >= 0) out.ids.push_back(tok.eos_id()), out.mask.push_back(1);
    } else if (p.is_array() && c.is_array()) {  // conversational: the prompt's turns, then the completion's
      std::vector<ChatMessage> m = read_messages(p, where, "prompt");
      const std::vector<ChatMessage> more = read_messages(c, where, "completion");
      const size_t prompt_turns = m.size();
      m.insert(m.end(), more.begin(), more.end());
      chat(m, prompt_turns);
    } else {
      bad_line(where, std::string("\"prompt\" is ") + p.type_name() + " and \"completion\" " + c.type_name() +
                          " (both strings, or both lists of messages)");
    }
    out.shape = 1;
  } else if (j.contains("text")) {
    if (!j["text"].is_string()) bad_line(where, std::string("\"text\" is ") + j["text"].type_name() + ", not a string");
    out.ids = tok.prefix_ids();
    const std::vector<int32_t> body = tok.encode(j["text"].get<std::string>());
    out.ids.insert(out.ids.end(), body.begin(), body.end());
    if (tok.eos_id() >= 0) out.ids.push_back(tok.eos_id());
    out.mask.assign(out.ids.size(), 1);
  } else {
    std::string keys;
    for (const auto& [k, v] : j.items()) keys += (keys.empty() ? "" : ", ") + k;
    bad_line(where, "has none of the keys text, prompt + completion, messages (it has: " + (keys.empty() ? "nothing" : keys) + ")");
  }
  return out;
}

// Targets the loss counts within a row of seq_len positions: those of the sample's first positions.
int32_t counted_targets(const std::vector<uint8_t>& mask, int64_t seq_len) {
  const int64_t last = sample_positions(static_cast<int64_t>(mask.size()), seq_len);
  int32_t c = 0;
  for (int64_t t = 0; t < last; ++t) c += mask[static_cast<size_t>(t + 1)] ? 1 : 0;
  return c;
}

}  // namespace

class SampleLines {
 public:
  SampleLines(std::shared_ptr<const HfTokenizer> tok, SampleOptions o, std::optional<ChatFormat> format)
      : tok_(std::move(tok)), o_(std::move(o)), format_(std::move(format)) {}
  // The sample of a line read before (its chat format, if it needs one, resolved then).
  LineSample sample(const std::string& line, const std::string& where) const {
    return sample_of_line(line, where, *tok_, o_, [&]() -> const ChatFormat& {
      DS_CHECK(format_.has_value(), "a conversation read again whose chat format was never resolved");
      return *format_;
    });
  }

 private:
  std::shared_ptr<const HfTokenizer> tok_;
  SampleOptions o_;
  std::optional<ChatFormat> format_;
};

JsonlSamples::JsonlSamples(const HfTokenizer& tok, SampleOptions o) : tok_(tok), o_(std::move(o)) {
  DS_CHECK(o_.keep_tokens, "an indexed sample set reads its lines again with a tokenizer it shares");
  out_.pad_id = tok.eos_id() >= 0 ? tok.eos_id() : 0;
}

JsonlSamples::JsonlSamples(std::shared_ptr<const HfTokenizer> tok, SampleOptions o) : owned_(std::move(tok)), tok_(*owned_), o_(std::move(o)) {
  out_.pad_id = tok_.eos_id() >= 0 ? tok_.eos_id() : 0;
  out_.indexed = !o_.keep_tokens;
  out_.counted_seq_len = o_.seq_len;
}

void JsonlSamples::add_line(const std::string& line, const std::string& where) {
  DS_CHECK(o_.keep_tokens, "an indexed sample set reads lines from files (add_file)");
  add_line_at(line, where, nullptr);
}

void JsonlSamples::add_line_at(const std::string& line, const std::string& where, const SampleSet::Place* place) {
  LineSample l;
  try {
    l = sample_of_line(line, where, tok_, o_, [&]() -> const ChatFormat& {
      if (!format_) format_ = resolve_chat_format(o_.chat_template, tok_);
      return *format_;
    });
  } catch (const BadLine& e) {
    if (!o_.skip_bad_lines) throw;
    if (skipped_++ == 0) first_skipped_ = e.what();
    return;
  }
  ++shapes_[l.shape];
  if (l.system_left_out && systems_left_out_++ == 0) first_system_left_out_ = where;
  if (l.reasoning_left_out && reasoning_left_out_++ == 0) first_reasoning_left_out_ = where;
  for (uint8_t t : l.mask) trained_ += t;
  if (out_.indexed) {
    out_.places.push_back(*place);
    out_.starts.push_back(out_.starts.back() + static_cast<int64_t>(l.ids.size()));
  } else {
    out_.add(l.ids, l.mask);
  }
  if (o_.seq_len > 0) out_.counted.push_back(counted_targets(l.mask, o_.seq_len));
  // A sample none of whose targets is trained (a conversation with no assistant turn, one that renders to
  // nothing; its first token is no one's target) costs its rows and teaches nothing: counted, named once.
  if (std::find(l.mask.begin() + std::min<size_t>(1, l.mask.size()), l.mask.end(), uint8_t{1}) == l.mask.end()) {
    if (untrained_++ == 0) first_untrained_ = where;
  }
}

namespace {

// Each line of a jsonl file that is not blank (blank lines separate nothing), with its number from 1; a
// line longer than kMaxLineBytes is refused where it is found.
void each_sample_line(const std::string& file, const std::function<void(const std::string& line, int64_t number, int64_t offset)>& take) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(file.c_str(), "rb"), std::fclose);
  if (!f) throw UserError("cannot read '" + file + "'", "check data.path and data.val_path");
  std::string line;
  int64_t number = 0, offset = 0;
  for (bool eof = false; !eof;) {
    line.clear();
    const int64_t begin = offset;
    int c;
    while ((c = std::fgetc(f.get())) != EOF && c != '\n') {
      if (line.size() >= kMaxLineBytes)
        bad_line(file + ":" + std::to_string(number + 1), "longer than " + format_bytes(static_cast<double>(kMaxLineBytes)));
      line.push_back(static_cast<char>(c));
    }
    eof = c == EOF;
    offset += static_cast<int64_t>(line.size()) + (eof ? 0 : 1);
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    take(line, number, begin);
  }
}

// A file's size and modification time, which tell a file changed since it was read.
std::pair<int64_t, int64_t> file_version(const std::string& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return {-1, -1};
  return {static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// `bytes` bytes of `file` from `offset`: an indexed sample's line, read again.
std::string read_line_at(const std::string& file, int64_t offset, int32_t bytes) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(file.c_str(), "rb"), std::fclose);
  std::string line(static_cast<size_t>(bytes), '\0');
  if (!f || ::fseeko(f.get(), static_cast<off_t>(offset), SEEK_SET) != 0 || std::fread(line.data(), 1, line.size(), f.get()) != line.size())
    throw DataReadError("cannot read '" + file + "' again at byte " + format_count(offset) + " (the training data is read from it as it goes)",
                    "a file of data.path or data.val_path was moved, truncated or replaced during the run: restore it and resume");
  return line;
}

}  // namespace

void JsonlSamples::add_file(const std::string& file) {
  const int32_t index = static_cast<int32_t>(out_.files.size());
  const auto [bytes, modified_ns] = file_version(file);
  out_.files.push_back({file, nullptr, bytes, modified_ns});
  each_sample_line(file, [&](const std::string& line, int64_t number, int64_t offset) {
    const SampleSet::Place place{offset, static_cast<int32_t>(line.size()), index};
    add_line_at(line, file + ":" + std::to_string(number), &place);
  });
}

int64_t count_jsonl_samples(const std::vector<std::string>& files) {
  int64_t n = 0;
  for (const std::string& f : files) each_sample_line(f, [&](const std::string&, int64_t, int64_t) { ++n; });
  return n;
}

SampleSet JsonlSamples::take() {
  if (out_.size() == 0) throw UserError(o_.source + " holds no samples", "each line of a jsonl file is one sample");
  const int64_t trained = trained_;
  if (out_.indexed) {
    const auto lines = std::make_shared<const SampleLines>(owned_, o_, format_);
    for (SampleFile& f : out_.files) f.lines = lines;
  }
  std::string kinds;
  const char* names[3] = {"text", "prompt/completion", "conversations"};
  for (int k = 0; k < 3; ++k)
    if (shapes_[k]) kinds += (kinds.empty() ? "" : ", ") + format_count(shapes_[k]) + " " + names[k];
  out_.description = o_.source + ": " + format_count(out_.size()) + " samples (" + kinds + "), " +
                     format_count(out_.total_tokens()) + " tokens, " + format_count(trained) + " trained; " +
                     tok_.describe() + (format_ ? "; chat format " + format_->describe() : "");
  if (untrained_ > 0)
    out_.description += "; " + format_count(untrained_) + (untrained_ == 1 ? " sample trains" : " samples train") +
                        " nothing (no answer within it, the first at " + first_untrained_ +
                        "): it costs its place in a batch and teaches nothing; leave such lines out, or set data.train_on_prompt";
  if (skipped_ > 0)
    out_.description += "; " + format_count(skipped_) + (skipped_ == 1 ? " line is" : " lines are") +
                        " no sample and skipped (data.skip_bad_lines; the first: " + first_skipped_ + ")";
  if (systems_left_out_ > 0)
    out_.description += "; " + format_count(systems_left_out_) + (systems_left_out_ == 1 ? " conversation's" : " conversations'") +
                        " system turn is not rendered (the first at " + first_system_left_out_ +
                        "): the chat template shows it only before a last user turn; to train with it, put it at the start of the "
                        "first user turn's content";
  if (reasoning_left_out_ > 0)
    out_.description += "; " + format_count(reasoning_left_out_) + (reasoning_left_out_ == 1 ? " conversation's" : " conversations'") +
                        " reasoning_content is not rendered (the first at " + first_reasoning_left_out_ + "): the " +
                        format_->describe() + " chat template has no place for it (qwen3's has)";
  if (tok_.texts_not_normalized() > 0)
    out_.description += "; " + format_count(tok_.texts_not_normalized()) +
                        " texts hold characters the tokenizer's NFC normalizer could compose: tokenized as written";
  return std::move(out_);
}

SampleSet read_jsonl_samples(const std::vector<std::string>& files, const HfTokenizer& tok, const SampleOptions& o) {
  JsonlSamples reader(tok, o);
  for (const std::string& f : files) reader.add_file(f);
  return reader.take();
}

SampleSet read_jsonl_samples(const std::vector<std::string>& files, std::shared_ptr<const HfTokenizer> tok, const SampleOptions& o) {
  JsonlSamples reader(std::move(tok), o);
  for (const std::string& f : files) reader.add_file(f);
  return reader.take();
}

void SampleSet::add(const std::vector<int32_t>& ids, const std::vector<uint8_t>& mask) {
  DS_CHECK(!indexed, "an indexed sample set keeps no tokens");
  tokens.insert(tokens.end(), ids.begin(), ids.end());
  trained.insert(trained.end(), mask.begin(), mask.end());
  starts.push_back(static_cast<int64_t>(tokens.size()));
}

void SampleSet::append(const SampleSet& more) {
  DS_CHECK(indexed == more.indexed && counted_seq_len == more.counted_seq_len, "appending samples kept otherwise");
  const int64_t base = total_tokens();
  tokens.insert(tokens.end(), more.tokens.begin(), more.tokens.end());
  trained.insert(trained.end(), more.trained.begin(), more.trained.end());
  for (size_t i = 1; i < more.starts.size(); ++i) starts.push_back(base + more.starts[i]);
  counted.insert(counted.end(), more.counted.begin(), more.counted.end());
  const int32_t file_base = static_cast<int32_t>(files.size());
  files.insert(files.end(), more.files.begin(), more.files.end());
  for (Place p : more.places) {
    p.file += file_base;
    places.push_back(p);
  }
}

void SampleSet::sample(int64_t i, int64_t limit, std::vector<int32_t>& ids, std::vector<uint8_t>& mask) const {
  DS_CHECK(i >= 0 && i < size(), "no sample " + std::to_string(i));
  const int64_t n = std::min(length(i), limit);
  if (!indexed) {
    ids.assign(tokens.begin() + starts[i], tokens.begin() + starts[i] + n);
    mask.assign(trained.begin() + starts[i], trained.begin() + starts[i] + n);
    return;
  }
  const Place& p = places[static_cast<size_t>(i)];
  const SampleFile& f = files[static_cast<size_t>(p.file)];
  if (file_version(f.path) != std::make_pair(f.bytes, f.modified_ns))
    throw DataReadError("'" + f.path + "' changed since the run read it (its size or modification time): its samples are read from it as "
                        "the run goes",
                    "restore the file as it was and resume, or start a run on the new data");
  LineSample l;
  try {
    l = f.lines->sample(read_line_at(f.path, p.offset, p.bytes), f.path + " at byte " + format_count(p.offset));
  } catch (const BadLine& e) {  // it read as a sample when the run began
    throw DataReadError(std::string(e.what()) + " (it read as a sample when the run began)",
                        "a file of data.path or data.val_path changed during the run: restore it and resume");
  }
  if (static_cast<int64_t>(l.ids.size()) != length(i))
    throw DataReadError(f.path + " at byte " + format_count(p.offset) + " reads as " + format_count(static_cast<int64_t>(l.ids.size())) +
                        " tokens now, " + format_count(length(i)) + " when the run began",
                    "a file of data.path or data.val_path changed during the run: restore it and resume");
  l.ids.resize(static_cast<size_t>(n));
  l.mask.resize(static_cast<size_t>(n));
  ids = std::move(l.ids);
  mask = std::move(l.mask);
}

}  // namespace ds
