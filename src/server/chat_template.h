// Chat templates: messages -> the prompt text a chat model was trained on.
//
// A GGUF carries its template as Jinja (tokenizer.chat_template). Pagoda does
// not run Jinja: it recognises the common families by marker strings in the
// template text and renders each family's format exactly, as the reference
// Hugging Face template of that family does (llama.cpp's llm_chat_template does
// the same). `--chat-template NAME` picks a family by name; a model without a
// template, or with one no family matches, gets `plain`: message contents
// joined with newlines, no role markers.
//
// Families and the reference template each follows:
//   chatml     <|im_start|>role\n...<|im_end|>\n           (Qwen, OpenHermes, Yi, ...)
//   qwen3      chatml with Qwen3's thinking blocks: <think>...</think> is
//              dropped from assistant turns before the last user message and
//              kept, normalised, after it (detected by `enable_thinking`)
//   llama2     [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] (Llama-2-chat)
//   llama3     <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>  (Llama 3.x)
//   mistral    [INST] ... [/INST]...</s>                   (Mistral-7B-Instruct v0.1/v0.2)
//   gemma      <start_of_turn>user\n...<end_of_turn>\n     (Gemma, Gemma 2, Gemma 3)
//   phi3       <|user|>\n...<|end|>\n<|assistant|>\n        (Phi-3, Phi-3.5)
//   zephyr     <|user|>\n...</s>\n<|assistant|>\n           (Zephyr)
//   deepseek   User: ...\n\nAssistant: ...<eos>            (DeepSeek LLM / V2 chat)
//   deepseek3  <｜User｜>...<｜Assistant｜>...<eos>          (DeepSeek V3 / R1)
//
// The BOS token at the very start is never rendered: the tokenizer adds it as
// the vocabulary asks (tokenizer.ggml.add_bos_token), so it is there once.
// BOS and EOS inside the conversation (llama2, mistral, zephyr, deepseek) are
// rendered as their token text, and the prompt is tokenized with special
// tokens parsed, as vLLM and llama.cpp do.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::server {

enum class chat_format { plain, chatml, qwen3, llama2, llama3, mistral, gemma, phi3, zephyr, deepseek, deepseek3 };

struct chat_message {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// The texts of the special tokens some formats write between turns.
struct chat_special_tokens {
  std::string bos;  // "<s>", "<｜begin▁of▁sentence｜>", ...
  std::string eos;  // "</s>", "<｜end▁of▁sentence｜>", ...
};

const char* chat_format_name(chat_format f);
// Every family name, for help texts and errors.
std::span<const chat_format> all_chat_formats();
// By name ("chatml", "llama3", ...); std::nullopt for an unknown name.
std::optional<chat_format> chat_format_from_name(std::string_view name);
// The family whose markers the Jinja text contains; std::nullopt when none does.
std::optional<chat_format> detect_chat_format(std::string_view jinja);

// The prompt text for `messages`. With add_generation_prompt the text ends with
// the assistant's turn opened, ready for the model to write it.
// Formats without a system role (mistral, gemma) put leading system messages
// before the first user message's content, separated by a blank line, as
// their later templates do. Errors (errc::invalid_argument, naming the message
// index): an empty list, a role other than system/user/assistant, a system
// message after the conversation began in those formats.
result<std::string> render_chat(chat_format format, std::span<const chat_message> messages,
                                const chat_special_tokens& tokens, bool add_generation_prompt);

}  // namespace pagoda::server
