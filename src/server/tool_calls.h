// Function calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice`
// and `parallel_tool_calls` read from a request, the grammar that forces a
// call, and the model's text parsed back into `tool_calls`, whole or as
// stream deltas.
//
//   tool_choice  "none"      no tools in the prompt, the output is text (as
//                            vLLM does with --exclude-tools-when-tool-choice-none),
//                            so any chat format takes it
//                "auto"      (the default with tools) tools in the prompt, free
//                            text, calls parsed out of it
//                "required"  one or more calls (exactly one without
//                            parallel_tool_calls, and always in llama3), forced
//                            by a grammar from the tools' parameter schemas in
//                            the chat format's call syntax
//                {"type": "function", "function": {"name": N}}  exactly one
//                            call to N, forced the same way
//
// The call syntax per chat format (server/chat_template.h says how tools are
// rendered): chatml/qwen3 `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`
// after optional content; llama3 the whole answer is `{"name": N,
// "parameters": {...}}` (an optional <|python_tag|> before it); mistral
// `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]` (the marker is a
// control token that decodes to nothing, so a bare `[...]` answer counts as
// well; forced calls get the marker at the end of the prompt). Either key,
// "arguments" or "parameters", is read in every format.
//
// Parsing: a call names one of the request's tools and its arguments are a
// JSON object (or a string holding one). When the output starts a call that
// does not parse (a bad name, bad JSON, cut by max_tokens), the whole text is
// the message's content and finish_reason is the engine's, as vLLM does.
// Calls made give finish_reason "tool_calls" under auto and required, and
// "stop" under a named function (what OpenAI and vLLM answer). `arguments`
// is the model's text of the object, so the streamed pieces add up to it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pagoda/status.h"
#include "server/api_error.h"
#include "server/chat_template.h"

namespace pagoda::server {

inline constexpr std::size_t k_max_tools = 128;  // OpenAI's limit

enum class tool_choice_kind { none, automatic, required, named };

struct tool_function {
  std::string name;
  nlohmann::json parameters;           // its JSON Schema; null when the function takes none
  nlohmann::ordered_json definition;   // as the prompt shows it (chat_tools)
};

struct tool_request {
  chat_format format = chat_format::plain;
  std::vector<tool_function> functions;
  tool_choice_kind choice = tool_choice_kind::none;
  std::string named;     // choice named: the function
  bool parallel = true;  // parallel_tool_calls

  // Tools are in the prompt and the output is parsed for calls.
  bool active() const { return choice != tool_choice_kind::none && !functions.empty(); }
  // The output must be calls (a grammar forces them).
  bool forced() const { return choice == tool_choice_kind::required || choice == tool_choice_kind::named; }
  // At most one call.
  bool single() const { return choice == tool_choice_kind::named || !parallel || format == chat_format::llama3; }
  const tool_function* find(std::string_view name) const;
};

// Reads tools, tool_choice and parallel_tool_calls of a chat body for a
// model whose template is `format`. 400s name the field: a tool that is not
// {"type": "function", "function": {...}}, a name missing, repeated or not
// [a-zA-Z0-9_-]{1,64}, parameters that are not a schema of an object,
// tool_choice naming an unknown function or forcing a call without tools,
// tools with a chat format that has no tool format (unless tool_choice is "none").
std::optional<api_error> read_tools(const nlohmann::json& body, chat_format format, tool_request& out);

// A message's tool parts: an assistant's tool_calls ([{"id", "type":
// "function", "function": {"name", "arguments": JSON text of an object}}]) and
// a tool message's tool_call_id (required). `name` is the message's field
// ("messages[3]"), which the 400s extend; tool_calls need a chat format with a
// tool format.
std::optional<api_error> read_message_tools(const nlohmann::json& msg, const std::string& name, chat_format format,
                                            chat_message& m);

// What the prompt shows: the tools unless tool_choice is none.
chat_tools prompt_tools(const tool_request& t);

// The GBNF that forces the calls of a required or named tool_choice: the
// format's call syntax around each function's parameter schema
// (grammar/convert.h). An error (a schema it cannot express, a grammar past
// the size limits) starts with the field at fault, also set in *bad_field.
result<std::string> tool_call_grammar(const tool_request& t, std::string* bad_field = nullptr);

struct parsed_tool_output {
  bool called = false;  // the output was calls to the request's tools
  std::string content;  // called: the text before the calls, trailing whitespace cut; else the whole text
  std::vector<chat_tool_call> calls;  // ids left empty
};
parsed_tool_output parse_tool_output(const tool_request& t, std::string_view text);

// A call's id: "call_" and 24 hex digits, or for mistral the 9 letters and
// digits its format takes; a function of the response id, choice and call index.
std::string tool_call_id(chat_format f, std::string_view response_id, std::size_t choice, std::size_t index);

// The finish reason of a choice whose output was (called) or was not calls.
std::string tool_finish_reason(const tool_request& t, bool called, const std::string& engine_reason);

// One piece of a streamed answer.
struct tool_delta {
  bool is_call = false;  // else content
  std::size_t index = 0;   // call: which call
  std::string name;      // call: set on the call's first delta only
  std::string text;      // content, or a piece of the call's arguments
};

// Streams one choice's text as content and call deltas: text that may still
// turn out to be a call is held back, a call's name goes out once it is
// known and its arguments as they arrive. Deltas once sent stand: a call
// that turns out malformed after its name went out ends the stream with the
// engine's finish reason; held text that was no call goes out as content.
class tool_call_stream {
 public:
  explicit tool_call_stream(std::shared_ptr<const tool_request> t) : tools_(std::move(t)) {}
  void feed(std::string_view text, std::vector<tool_delta>& out);
  // The rest, at the end of the output; returns whether it was calls.
  bool finish(std::vector<tool_delta>& out);

 private:
  // The deltas text_ releases beyond what went out.
  void release(std::vector<tool_delta>& out);

  std::shared_ptr<const tool_request> tools_;
  std::string text_;
  std::size_t content_sent_ = 0;          // bytes of text_ sent as content
  std::vector<std::size_t> args_sent_;    // [call]: bytes of its arguments sent (one entry per call announced)
  bool calls_began_ = false;              // a call's name went out
};

}  // namespace pagoda::server
