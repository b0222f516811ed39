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
// Tool calling (OpenAI's `tools`, server/tool_calls.h) has a format in four
// families, each with the structure of its reference template (the
// instruction sentences are Pagoda's own words):
//   chatml, qwen3  Qwen2.5 / Qwen3 (Hermes): a "# Tools" section with one
//                  JSON tool per line inside <tools></tools> in the system
//                  turn; calls are <tool_call>\n{"name": ..., "arguments":
//                  {...}}\n</tool_call> after the assistant's content; tool
//                  results are <tool_response>\n...\n</tool_response> blocks,
//                  consecutive ones in one user turn. Qwen2.5's default
//                  system sentence is not written (chatml is generic).
//   llama3         Llama 3.1+ JSON calls: "Environment: ipython" in the
//                  system turn, the tools (JSON, indent 4) in front of the
//                  first user message, a call is the assistant turn
//                  {"name": ..., "parameters": {...}} (one per turn), a
//                  result an `ipython` turn. The date lines of 3.1's system
//                  turn are left out, as this family leaves them out without tools.
//   mistral        Mistral v0.3: [AVAILABLE_TOOLS] [tools][/AVAILABLE_TOOLS]
//                  before the last user turn, [TOOL_CALLS] [{"name", "arguments",
//                  "id"}, ...]</s>, [TOOL_RESULTS] {"content": ..., "call_id":
//                  ...}[/TOOL_RESULTS]; call ids are the 9 characters the
//                  format wants (the last 9 letters and digits of the id given,
//                  zero-padded). The turns themselves stay v0.1/v0.2's.
// phi3 has none: the Phi-3 / Phi-3.5 templates carry no tool section (Phi-4-
// mini's <|tool|> format belongs to a different template), and neither do the
// other families here.
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

#include <nlohmann/json.hpp>

#include "pagoda/status.h"

namespace pagoda::server {

enum class chat_format { plain, chatml, qwen3, llama2, llama3, mistral, gemma, phi3, zephyr, deepseek, deepseek3 };

// A function call an assistant message made (OpenAI's tool_calls[i]).
struct chat_tool_call {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct chat_message {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::vector<chat_tool_call> tool_calls;  // assistant: the calls it made
  std::string tool_call_id;                // tool: the call this is the result of
};

// The function tools a prompt offers, each the JSON object
// {"type": "function", "function": {"name", "description", "parameters"}}
// written in that order.
struct chat_tools {
  std::vector<nlohmann::ordered_json> functions;
  // The answer must be calls (tool_choice required or named): mistral, whose
  // call marker [TOOL_CALLS] is a control token a grammar cannot produce,
  // writes it at the end of the prompt.
  bool force_call = false;
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
// Whether the family has a tool format (chatml, qwen3, llama3, mistral).
bool chat_format_has_tools(chat_format f);
// JSON text as Python's json.dumps (Jinja's tojson) writes it: ", " and ": "
// separators, or with indent > 0 one item a line; keys in the object's order.
std::string python_json(const nlohmann::ordered_json& v, int indent = -1);

// The prompt text for `messages`. With add_generation_prompt the text ends with
// the assistant's turn opened, ready for the model to write it.
// Formats without a system role (mistral, gemma) put leading system messages
// before the first user message's content, separated by a blank line, as
// their later templates do. Errors (errc::invalid_argument, naming the message
// index): an empty list, a role other than system/user/assistant (and tool
// where the family has a tool format), tool calls or tools in a family
// without one, a system message after the conversation began in those
// formats, llama3 tools without a first user message or with several calls
// in one assistant message.
result<std::string> render_chat(chat_format format, std::span<const chat_message> messages,
                                const chat_special_tokens& tokens, bool add_generation_prompt,
                                const chat_tools& tools = {});

}  // namespace pagoda::server
