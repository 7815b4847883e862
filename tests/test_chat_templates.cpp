// The chat formats rendered as the models' official templates render them: each family's rendering of a
// conversation against the exact string its template produces (written here from the template's text), the
// templates "auto" recognises, and those it refuses.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "chat_test_helpers.hpp"
#include "common/error.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"

using namespace ds;
using namespace chat_test;

namespace {

// Llama 3.1's template, the parts a conversation without tools goes through.
const char* const kLlama31Template =
    "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n";

// Llama 3.0's template, whole.
const char* const kLlama3Template =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

}  // namespace

TEST(ChatTemplate, ChatmlIsQwensTemplateWithItsDefaultSystemTurn) {
  const HfTokenizer tok(tokenizer_dir("chatml", kQwen25Template));
  const ChatFormat f = resolve_chat_format("auto", tok);
  ASSERT_EQ(f.kind, ChatFormatKind::chatml);
  EXPECT_EQ(f.default_system, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  const RenderedChat r = render_chat(f, three_turns(false));
  EXPECT_EQ(r.text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n Paris. <|im_end|>\n");
  EXPECT_EQ(trained_runs(tok, r.text, r.trained), (std::vector<std::string>{"Hello!<|im_end|>", " Paris. <|im_end|>"}));
  EXPECT_EQ(render_chat(f, three_turns(true)).text.rfind("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi", 0), 0u);
}

TEST(ChatTemplate, Llama3AndLlama31AreTheirTemplatesExactly) {
  const HfTokenizer l3(tokenizer_dir("llama3", kLlama3Template));
  const ChatFormat f3 = resolve_chat_format("auto", l3);
  ASSERT_EQ(f3.kind, ChatFormatKind::llama3);
  const RenderedChat r3 = render_chat(f3, three_turns(true));
  const std::string turns =
      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>";
  EXPECT_EQ(r3.text, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" + turns);
  EXPECT_EQ(trained_runs(l3, r3.text, r3.trained), (std::vector<std::string>{"Hello!<|eot_id|>", "Paris.<|eot_id|>"}));

  const HfTokenizer l31(tokenizer_dir("llama31", kLlama31Template));
  const ChatFormat f31 = resolve_chat_format("auto", l31);
  ASSERT_EQ(f31.kind, ChatFormatKind::llama3_1);
  EXPECT_EQ(f31.date, "26 Jul 2024");
  const std::string header = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  EXPECT_EQ(render_chat(f31, three_turns(false)).text, header + "<|eot_id|>" + turns);
  EXPECT_EQ(render_chat(f31, three_turns(true)).text, header + "Be brief.<|eot_id|>" + turns);
  EXPECT_FALSE(f31.date_of_the_day);
  // Llama 3.2's asks for the day's date where the renderer offers strftime_now: ds keeps its fallback, and says so.
  std::string l32_template = kLlama31Template;
  const std::string fixed = "    {%- set date_string = \"26 Jul 2024\" %}\n";
  ASSERT_NE(l32_template.find(fixed), std::string::npos);
  l32_template.replace(l32_template.find(fixed), fixed.size(),
                       "    {%- if strftime_now is defined %}\n        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n    {%- else %}\n"
                       "        {%- set date_string = \"26 Jul 2024\" %}\n    {%- endif %}\n");
  const ChatFormat f32 = resolve_chat_format("auto", HfTokenizer(tokenizer_dir("llama32", l32_template)));
  ASSERT_EQ(f32.kind, ChatFormatKind::llama3_1);
  EXPECT_EQ(f32.date, "26 Jul 2024");
  EXPECT_TRUE(f32.date_of_the_day);
  EXPECT_NE(f32.describe().find("the template's fallback: Hugging Face renders the day's date"), std::string::npos) << f32.describe();
  EXPECT_EQ(render_chat(f32, three_turns(false)).text, header + "<|eot_id|>" + turns);
}

// Phi-3-mini-4k-instruct's template, whole, and Phi-3.5's (which leaves out an empty system turn).
const char* const kPhi3Template =
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";

TEST(ChatTemplate, Phi3IsItsTemplateEndingWithTheEosToken) {
  const HfTokenizer tok(tokenizer_dir("phi3", kPhi3Template, example_tokenizer(), "<|endoftext|>"));
  const ChatFormat f = resolve_chat_format("auto", tok);
  ASSERT_EQ(f.kind, ChatFormatKind::phi3);
  const RenderedChat r = render_chat(f, three_turns(true));
  EXPECT_EQ(r.text,
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nCapital of France?<|end|>\n"
            "<|assistant|>\n Paris. <|end|>\n<|endoftext|>");
  EXPECT_EQ(trained_runs(tok, r.text, r.trained), (std::vector<std::string>{"Hello!<|end|>", " Paris. <|end|>"}));
  std::vector<ChatMessage> empty_system = three_turns(false);
  empty_system.insert(empty_system.begin(), {"system", ""});
  EXPECT_EQ(render_chat(f, empty_system).text.rfind("<|system|>\n<|end|>\n<|user|>\nHi", 0), 0u);  // Phi-3 keeps it
  std::string phi35 = kPhi3Template;
  phi35.replace(phi35.find("== 'system' %}"), 14, "== 'system' and message['content'] %}");
  const HfTokenizer tok35(tokenizer_dir("phi35", phi35, example_tokenizer(), "<|endoftext|>"));
  EXPECT_EQ(render_chat(resolve_chat_format("auto", tok35), empty_system).text.rfind("<|user|>\nHi<|end|>\n", 0), 0u);  // 3.5 drops it
}

// Gemma's and Gemma 2's template (google/gemma-2-2b-it's tokenizer_config.json), whole, and Gemma 3's (as
// transformers' Gemma 3 conversion script writes it), whole.
const char* const kGemmaTemplate =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation "
    "roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = "
    "'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";
const char* const kGemma3Template =
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n            {%- endif -%}\n"
    "        {%- endfor -%}\n    {%- else -%}\n        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n";

TEST(ChatTemplate, GemmaAndGemma3AreTheirTemplatesExactlyAndRefuseWhatTheyRefuse) {
  const HfTokenizer g(tokenizer_dir("gemma", kGemmaTemplate, example_tokenizer(), "<eos>", "<bos>"));
  const ChatFormat f = resolve_chat_format("auto", g);
  ASSERT_EQ(f.kind, ChatFormatKind::gemma);
  const std::string turns =
      "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
      "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\nParis.<end_of_turn>\n";
  const RenderedChat r = render_chat(f, three_turns(false));
  EXPECT_EQ(r.text, "<bos>" + turns);
  EXPECT_EQ(trained_runs(g, r.text, r.trained), (std::vector<std::string>{"Hello!<end_of_turn>", "Paris.<end_of_turn>"}));
  // What the template raises on: a system turn first, roles out of turn.
  EXPECT_THROW(render_chat(f, three_turns(true)), ChatRefused);
  EXPECT_THROW(render_chat(f, {{"user", "a"}, {"user", "b"}}), ChatRefused);
  EXPECT_THROW(render_chat(f, {{"assistant", "a"}}), ChatRefused);

  const HfTokenizer g3(tokenizer_dir("gemma3", kGemma3Template, example_tokenizer(), "<eos>", "<bos>"));
  const ChatFormat f3 = resolve_chat_format("auto", g3);
  ASSERT_EQ(f3.kind, ChatFormatKind::gemma3);
  EXPECT_EQ(render_chat(f3, three_turns(false)).text, "<bos>" + turns);
  std::vector<ChatMessage> with_system = three_turns(false);
  with_system.insert(with_system.begin(), {"system", " Be brief. "});  // not trimmed: the prefix is the content as given
  const RenderedChat r3 = render_chat(f3, with_system);
  EXPECT_EQ(r3.text, "<bos><start_of_turn>user\n Be brief. \n\nHi<end_of_turn>\n" + turns.substr(turns.find("<start_of_turn>model")));
  EXPECT_EQ(trained_runs(g3, r3.text, r3.trained), (std::vector<std::string>{"Hello!<end_of_turn>", "Paris.<end_of_turn>"}));
  EXPECT_THROW(render_chat(f3, {{"system", "s"}, {"assistant", "a"}}), ChatRefused);

  // In a file: the line the template refuses is named.
  const std::string d = scratch("gemma_file");
  write(d + "/chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}]}\n"
                           "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Hi\"}]}\n");
  try {
    JsonlSamples(g, SampleOptions{}).add_file(d + "/chat.jsonl");
    ADD_FAILURE() << "a system turn was rendered for Gemma";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(d + "/chat.jsonl:2: Gemma's chat template raises \"System role not supported\"", 0), 0u) << e.what();
  }
  JsonlSamples folds(g3, SampleOptions{});  // Gemma 3 folds the system turn into the user's
  EXPECT_NO_THROW(folds.add_file(d + "/chat.jsonl"));
  EXPECT_EQ(folds.take().size(), 2);
  fs::remove_all(d);
}

// Llama-2-13b-chat-hf's template and Mixtral-8x7B-Instruct-v0.1's (Mistral 7B Instruct v0.1's), whole.
const char* const kLlama2Template =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = "
    "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}"
    "{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
    "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";
const char* const kMistralTemplate =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
    "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

TEST(ChatTemplate, Llama2AndMistralAreTheirTemplatesExactly) {
  const HfTokenizer l2(tokenizer_dir("llama2", kLlama2Template, example_tokenizer(), "</s>", "<s>"));
  const ChatFormat f2 = resolve_chat_format("auto", l2);
  ASSERT_EQ(f2.kind, ChatFormatKind::llama2);
  const RenderedChat r2 = render_chat(f2, three_turns(true));
  EXPECT_EQ(r2.text, "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Capital of France? [/INST] Paris. </s>");
  EXPECT_EQ(trained_runs(l2, r2.text, r2.trained), (std::vector<std::string>{" Hello! </s>", " Paris. </s>"}));
  EXPECT_EQ(render_chat(f2, three_turns(false)).text, "<s>[INST] Hi [/INST] Hello! </s><s>[INST] Capital of France? [/INST] Paris. </s>");
  EXPECT_THROW(render_chat(f2, {{"user", "a"}, {"user", "b"}}), ChatRefused);

  const HfTokenizer m(tokenizer_dir("mistral", kMistralTemplate, example_tokenizer(), "</s>", "<s>"));
  const ChatFormat fm = resolve_chat_format("auto", m);
  ASSERT_EQ(fm.kind, ChatFormatKind::mistral);
  const RenderedChat rm = render_chat(fm, three_turns(false));
  EXPECT_EQ(rm.text, "<s>[INST] Hi [/INST]Hello!</s>[INST] Capital of France? [/INST] Paris. </s>");
  EXPECT_EQ(trained_runs(m, rm.text, rm.trained), (std::vector<std::string>{"Hello!</s>", " Paris. </s>"}));
  EXPECT_THROW(render_chat(fm, three_turns(true)), ChatRefused);  // the template has no system turn
  // Llama 2 templates that carry a default system prompt render otherwise: not recognised.
  std::string with_default = kLlama2Template;
  with_default.replace(with_default.find("{% set system_message = false %}"), 32,
                       "{% set system_message = 'You are a helpful assistant. If you don\\'t know, please don\\'t share false information.' %}");
  EXPECT_THROW(resolve_chat_format("auto", HfTokenizer(tokenizer_dir("llama2_default", with_default, example_tokenizer(), "</s>", "<s>"))),
               UserError);
}

namespace {

// Mistral's v3 template (7B Instruct v0.3, Mixtral 8x22B, Large 2407) as tokenizer_config.json holds it, its tool
// branches included (a conversation without tools never enters them).
const char* const kMistralV3Template =
    "{%- if messages[0][\"role\"] == \"system\" %}\n    {%- set system_message = messages[0][\"content\"] %}\n    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{%- set user_messages = loop_messages | selectattr(\"role\", \"equalto\", \"user\") | list %}\n\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n{%- set ns = namespace() %}\n"
    "{%- set ns.index = 0 %}\n{%- for message in loop_messages %}\n    {%- if not (message.role == \"tool\" or message.role == \"tool_results\" or "
    "(message.tool_calls is defined and message.tool_calls is not none)) %}\n        {%- if (message[\"role\"] == \"user\") != (ns.index % 2 == 0) %}\n"
    "            {{- raise_exception(\"After the optional system message, conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "        {%- endif %}\n        {%- set ns.index = ns.index + 1 %}\n    {%- endif %}\n{%- endfor %}\n\n{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n    {%- if message[\"role\"] == \"user\" %}\n        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    "            {{- \"[AVAILABLE_TOOLS] [\" }}\n            {%- for tool in tools %}\n                {%- set tool = tool.function %}\n"
    "                {{- '{\"type\": \"function\", \"function\": {' }}\n                {%- for key, val in tool.items() if key != \"return\" %}\n"
    "                    {%- if val is string %}\n                        {{- '\"' + key + '\": \"' + val + '\"' }}\n                    {%- else %}\n"
    "                        {{- '\"' + key + '\": ' + val|tojson }}\n                    {%- endif %}\n                    {%- if not loop.last %}\n"
    "                        {{- \", \" }}\n                    {%- endif %}\n                {%- endfor %}\n                {{- \"}}\" }}\n"
    "                {%- if not loop.last %}\n                    {{- \", \" }}\n                {%- else %}\n                    {{- \"]\" }}\n"
    "                {%- endif %}\n            {%- endfor %}\n            {{- \"[/AVAILABLE_TOOLS]\" }}\n            {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- else %}\n            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n        {%- endif %}\n"
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n        {{- \"[TOOL_CALLS] [\" }}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    "                {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n            {%- endif %}\n"
    "            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n            {%- if not loop.last %}\n                {{- \", \" }}\n            {%- else %}\n"
    "                {{- \"]\" + eos_token }}\n            {%- endif %}\n        {%- endfor %}\n    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- \" \" + message[\"content\"]|trim + eos_token}}\n    {%- elif message[\"role\"] == \"tool_results\" or message[\"role\"] == \"tool\" %}\n"
    "        {%- if message.content is defined and message.content.content is defined %}\n            {%- set content = message.content.content %}\n"
    "        {%- else %}\n            {%- set content = message.content %}\n        {%- endif %}\n"
    "        {{- '[TOOL_RESULTS] {\"content\": ' + content|string + \", \" }}\n"
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    "            {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n        {%- endif %}\n"
    "        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n    {%- else %}\n"
    "        {{- raise_exception(\"Only user and assistant roles are supported, with the exception of an initial optional system message!\") }}\n"
    "    {%- endif %}\n{%- endfor %}\n";

std::string replaced(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

}  // namespace

TEST(ChatTemplate, MistralV3IsItsTemplateAndShowsTheSystemTurnOnlyBeforeALastQuestion) {
  const HfTokenizer tok(tokenizer_dir("mistral_v3", kMistralV3Template, example_tokenizer(), "</s>", "<s>"));
  const ChatFormat f = resolve_chat_format("auto", tok);
  ASSERT_EQ(f.kind, ChatFormatKind::mistral_v3);
  EXPECT_EQ(f.describe(), "mistral-v3");
  // A conversation that ends with an answer: the template shows its system turn nowhere.
  const RenderedChat r = render_chat(f, three_turns(true));
  EXPECT_EQ(r.text, "<s>[INST] Hi[/INST] Hello!</s>[INST] Capital of France?[/INST] Paris.</s>");
  EXPECT_TRUE(r.system_left_out);
  EXPECT_EQ(trained_runs(tok, r.text, r.trained), (std::vector<std::string>{" Hello!</s>", " Paris.</s>"}));
  const RenderedChat plain = render_chat(f, three_turns(false));
  EXPECT_EQ(plain.text, r.text);
  EXPECT_FALSE(plain.system_left_out);
  // Ending with a question, the system turn's content comes before it (the last one, not the first).
  const RenderedChat q = render_chat(f, {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Why?"}});
  EXPECT_EQ(q.text, "<s>[INST] Hi[/INST] Hello!</s>[INST] Be brief.\n\nWhy?[/INST]");
  EXPECT_FALSE(q.system_left_out);
  // What the template raises on.
  EXPECT_THROW(render_chat(f, {{"user", "a"}, {"user", "b"}}), ChatRefused);
  EXPECT_THROW(render_chat(f, {{"assistant", "a"}}), ChatRefused);
  EXPECT_THROW(render_chat(f, {{"user", "a"}, {"system", "b"}}), ChatRefused);  // alternation holds; the role does not
  // The reader counts the conversations whose system turn went unrendered and names the first.
  JsonlSamples reader(tok, {});
  reader.add_line(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})", "chat.jsonl:1");
  reader.add_line(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})",
                  "chat.jsonl:2");
  reader.add_line(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})",
                  "chat.jsonl:3");
  // A reasoning_content this template has no place for is counted too, not dropped unsaid.
  reader.add_line(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "Greet."}]})",
                  "chat.jsonl:4");
  const SampleSet s = reader.take();
  EXPECT_NE(s.description.find("; 2 conversations' system turn is not rendered (the first at chat.jsonl:2)"), std::string::npos)
      << s.description;
  EXPECT_NE(s.description.find("; 1 conversation's reasoning_content is not rendered (the first at chat.jsonl:4): the mistral-v3 chat "
                               "template has no place for it"),
            std::string::npos)
      << s.description;
  // Mistral Nemo's (Tekken) template drops the spaces: another format, refused by auto; an edited v3 line too.
  const std::string tekken = replaced(replaced(replaced(kMistralV3Template, "\"[INST] \"", "\"[INST]\""), "\" \" + message[\"content\"]|trim", "message[\"content\"]"),
                                      "[AVAILABLE_TOOLS] [", "[AVAILABLE_TOOLS][");
  EXPECT_THROW(resolve_chat_format("auto", HfTokenizer(tokenizer_dir("tekken", tekken, example_tokenizer(), "</s>", "<s>"))), UserError);
  // Edited copies that render otherwise (found by an outside review: each was taken for v3 before).
  const std::string edited = replaced(kMistralV3Template, "loop.last and system_message", "loop.first and system_message");
  for (const std::string& other : {edited, replaced(kMistralV3Template, "{{- bos_token }}\n", ""),
                                   replaced(kMistralV3Template, "{%- set loop_messages = messages[1:] %}", "{%- set loop_messages = messages %}"),
                                   replaced(kMistralV3Template, "{%- if not tools is defined %}",
                                            "{%- set system_message = \"Be nice.\" %}\n{%- if not tools is defined %}"),
                                   replaced(kMistralV3Template, "|trim + eos_token}}", "|trim + eos_token + \"\\n\"}}"),
                                   replaced(kMistralV3Template, "{%- endfor %}\n\n{{- bos_token }}", "{%- endfor %}\n{{- '[SYS]' }}\n{{- bos_token }}")})
    EXPECT_THROW(resolve_chat_format("auto", HfTokenizer(tokenizer_dir("edited", other, example_tokenizer(), "</s>", "<s>"))), UserError)
        << other;
  EXPECT_EQ(resolve_chat_format("mistral-v3", HfTokenizer(tokenizer_dir("named", edited, example_tokenizer(), "</s>", "<s>"))).kind,
            ChatFormatKind::mistral_v3);
}

TEST(ChatTemplate, AutoRefusesWhatItCannotRenderAndNamesTheChoices) {
  for (const std::string& tmpl : {std::string("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"),
                                  std::string("{{bos_token}}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                                              "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"),  // Hermes 3: ChatML after a BOS
                                  std::string(kQwen25Template) + "{%- if '<think>' in content %}{% endif %}", std::string()}) {
    const HfTokenizer tok(tokenizer_dir("unknown", tmpl));
    try {
      resolve_chat_format("auto", tok);
      ADD_FAILURE() << "rendered " << tmpl;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("chat template"), std::string::npos) << e.what();
      EXPECT_NE(e.hint().find("chatml"), std::string::npos) << e.hint();
      EXPECT_NE(e.hint().find("llama3.1"), std::string::npos) << e.hint();
    }
    EXPECT_EQ(resolve_chat_format("chatml", tok).kind, ChatFormatKind::chatml);  // named: rendered as asked
  }
  const std::string plain = scratch("plain");  // the example's tokenizer alone: no Llama 3 tokens
  write(plain + "/tokenizer.json", example_tokenizer().dump());
  try {
    resolve_chat_format("llama3", HfTokenizer(plain));
    ADD_FAILURE() << "llama3 without its tokens";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("needs the token <|begin_of_text|>"), std::string::npos) << e.what();
  }
}

namespace {

// Qwen3's template (Qwen/Qwen3-8B's tokenizer_config.json), whole but for the tools branch of its system turn.
const char* const kQwen3Template =
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n        {%- set content = message.content %}\n    {%- else %}\n"
    "        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}\n            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}";

}  // namespace

TEST(ChatTemplate, Qwen3ShowsTheReasoningOfTheTurnsAfterTheLastQueryAndDropsTheEarlierOnes) {
  const HfTokenizer tok(tokenizer_dir("qwen3", kQwen3Template));
  const ChatFormat f = resolve_chat_format("auto", tok);
  ASSERT_EQ(f.kind, ChatFormatKind::qwen3);
  // No default system turn; the last answer gets an empty <think> block; the first answer's reasoning (in its
  // content) is dropped, being before the last user turn.
  std::vector<ChatMessage> m = three_turns(false);
  m[1].content = "<think>\nGreet back.\n</think>\n\nHello!";
  RenderedChat r = render_chat(f, m);
  EXPECT_EQ(r.text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n Paris. <|im_end|>\n");
  EXPECT_EQ(trained_runs(tok, r.text, r.trained), (std::vector<std::string>{"Hello!<|im_end|>", "<think>\n\n</think>\n\n Paris. <|im_end|>"}));
  // A system turn as given; the last answer's reasoning from reasoning_content, stripped of newlines (its content
  // then taken whole); an answer after the last user turn that is not the last keeps its block only with reasoning.
  m = three_turns(true);
  m[4].reasoning = "\n\nThe capital.\n";
  m.push_back({"assistant", "\nAnything else?"});
  m.push_back({"assistant", "<think>a</think>b</think>\n\nDone."});
  EXPECT_EQ(render_chat(f, m).text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n<think>\nThe capital.\n</think>\n\n Paris. <|im_end|>\n"
            "<|im_start|>assistant\n\nAnything else?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\na\n</think>\n\nDone.<|im_end|>\n");
  // A conversation with no user turn: the last turn is the last query, so no answer shows a block.
  EXPECT_EQ(render_chat(f, {{"system", "S"}, {"assistant", "<think>x</think>y"}}).text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n");
  // Read from a jsonl line: the message's reasoning_content, trained with its answer.
  JsonlSamples reader(tok, SampleOptions{});
  reader.add_line(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "Greet."}]})",
                  "data.jsonl:1");
  const SampleSet s = reader.take();
  std::vector<int32_t> trained;
  for (size_t k = 0; k < s.tokens.size(); ++k)
    if (s.trained[k]) trained.push_back(s.tokens[k]);
  EXPECT_EQ(tok.decode(trained), "<think>\nGreet.\n</think>\n\nYo<|im_end|>");
  // Qwen2.5's template is still chatml, and another handling of <think> is refused.
  EXPECT_EQ(resolve_chat_format("auto", HfTokenizer(tokenizer_dir("qwen25", kQwen25Template))).kind, ChatFormatKind::chatml);
  // A tool response is no query: the answer before it, after the last user turn, shows its reasoning.
  EXPECT_EQ(render_chat(f, {{"user", "Q"}, {"assistant", "<think>r1</think>A1"}, {"user", "<tool_response>x</tool_response>"},
                            {"assistant", "A2"}})
                .text,
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n"
            "<|im_start|>user\n<tool_response>x</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n");
  // Edited templates that render otherwise are refused: blocks for every answer, or the reasoning kept whole.
  for (const auto& [piece, edit] : {std::pair<std::string, std::string>{"if loop.index0 > ns.last_query_index %}", "if true %}"},
                                    {"loop.last or (not loop.last and reasoning_content)", "true"},
                                    {".split('<think>')[-1]", ""}}) {
    std::string other = kQwen3Template;
    other.replace(other.find(piece), piece.size(), edit);
    EXPECT_THROW(resolve_chat_format("auto", HfTokenizer(tokenizer_dir("qwen3_other", other))), UserError) << edit;
  }
}
