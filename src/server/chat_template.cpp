#include "server/chat_template.h"

#include <array>

#include <fmt/format.h>

namespace pagoda::server {
namespace {

constexpr std::array k_formats = {chat_format::plain,  chat_format::chatml, chat_format::qwen3, chat_format::llama2,
                                  chat_format::llama3, chat_format::mistral, chat_format::gemma,
                                  chat_format::phi3,   chat_format::zephyr, chat_format::deepseek,
                                  chat_format::deepseek3};

// Jinja's `trim` and Python's str.strip(): ASCII whitespace at both ends.
std::string_view trim(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\f\v";
  std::size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  std::size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

// Formats without a system role: leading system messages go in front of the
// first user message's content. A system message later on has no place.
result<std::vector<chat_message>> fold_system(std::span<const chat_message> messages, chat_format f) {
  std::vector<chat_message> out;
  std::string system;
  bool began = false;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const chat_message& m = messages[i];
    if (m.role == "system") {
      if (began)
        return error(errc::invalid_argument,
                     "messages[{}]: the {} chat format has no system role; system messages must come first", i,
                     chat_format_name(f));
      if (!system.empty()) system += "\n\n";
      system += m.content;
      continue;
    }
    if (!began && !system.empty() && m.role == "user") {
      out.push_back({m.role, system + "\n\n" + m.content, {}, {}});
      system.clear();
    } else {
      out.push_back(m);
    }
    began = true;
  }
  if (!system.empty()) out.push_back({"user", system, {}, {}});  // only system messages: they are the user's words
  return out;
}

std::string_view strip_newlines(std::string_view s, bool left, bool right) {
  while (left && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (right && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// A call's arguments as the templates write them: the JSON object re-written
// Python's way, keys in the order given (the text as is if it is not JSON).
std::string arguments_text(const std::string& arguments) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(arguments, nullptr, false);
  return j.is_discarded() ? arguments : python_json(j);
}

// Hermes (Qwen2.5 / Qwen3): the tools section of the system turn.
std::string hermes_tools(const chat_tools& tools) {
  std::string out =
      "# Tools\n\nYou can call the functions below to help with the user's request.\n\n"
      "Their signatures are inside <tools></tools> XML tags:\n<tools>";
  for (const nlohmann::ordered_json& f : tools.functions) out += "\n" + python_json(f);
  out +=
      "\n</tools>\n\nTo call a function, answer with a JSON object of its name and arguments inside "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
      "<args-json-object>}\n</tool_call>";
  return out;
}

// Hermes: an assistant turn's calls, after its content.
std::string hermes_calls(const chat_message& m, bool has_content) {
  std::string out;
  for (std::size_t i = 0; i < m.tool_calls.size(); ++i) {
    const chat_tool_call& c = m.tool_calls[i];
    if (i > 0 || has_content) out += '\n';
    out += "<tool_call>\n{\"name\": \"" + c.name + "\", \"arguments\": " + arguments_text(c.arguments) + "}\n</tool_call>";
  }
  return out;
}

// Hermes: tool results, consecutive ones in one user turn.
std::string hermes_tool_result(std::span<const chat_message> messages, std::size_t i) {
  std::string out;
  if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
  out += "\n<tool_response>\n" + messages[i].content + "\n</tool_response>";
  if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
  return out;
}

// Hermes: the system turn with the tools (the first message's text in front
// when it is a system message); returns how many messages it consumed.
std::size_t hermes_system(std::span<const chat_message> messages, const chat_tools& tools, std::string& out) {
  if (tools.functions.empty()) return 0;
  out += "<|im_start|>system\n";
  std::size_t used = 0;
  if (messages[0].role == "system") {
    out += messages[0].content + "\n\n";
    used = 1;
  }
  out += hermes_tools(tools) + "<|im_end|>\n";
  return used;
}

// Mistral's call ids: exactly 9 letters and digits.
std::string mistral_id(std::string_view id) {
  std::string alnum;
  for (char c : id)
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) alnum += c;
  if (alnum.size() > 9) alnum = alnum.substr(alnum.size() - 9);
  return std::string(9 - alnum.size(), '0') + alnum;
}

std::string render_chatml(std::span<const chat_message> messages, const chat_tools& tools, bool add_generation_prompt) {
  std::string out;
  for (std::size_t i = hermes_system(messages, tools, out); i < messages.size(); ++i) {
    const chat_message& m = messages[i];
    if (m.role == "tool") out += hermes_tool_result(messages, i);
    else if (m.role == "assistant" && !m.tool_calls.empty())
      out += "<|im_start|>assistant\n" + m.content + hermes_calls(m, !m.content.empty()) + "<|im_end|>\n";
    else out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

// Llama 3.1+: tools in front of the first user message, calls as JSON turns,
// results as ipython turns.
result<std::string> render_llama3(std::span<const chat_message> messages, const chat_tools& tools,
                                  bool add_generation_prompt) {
  std::string out;
  std::size_t i = 0;
  if (!tools.functions.empty()) {
    std::string system;
    if (messages[0].role == "system") system = std::string(trim(messages[i++].content));
    out += "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n" + system + "<|eot_id|>";
    if (i >= messages.size() || messages[i].role != "user")
      return error(errc::invalid_argument,
                   "messages[{}]: the llama3 tool format puts the tools in the first user message, and this "
                   "message is not one",
                   i);
    out += "<|start_header_id|>user<|end_header_id|>\n\n"
           "Answer the prompt below with a call to one of these functions, written as JSON with its arguments.\n\n"
           "Use the format {\"name\": function name, \"parameters\": object of argument names and values}, "
           "with literal values only.\n\n";
    for (const nlohmann::ordered_json& f : tools.functions) out += python_json(f, 4) + "\n\n";
    out += std::string(trim(messages[i++].content)) + "<|eot_id|>";
  }
  for (; i < messages.size(); ++i) {
    const chat_message& m = messages[i];
    if (m.role == "tool") {
      out += "<|start_header_id|>ipython<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
    } else if (m.role == "assistant" && !m.tool_calls.empty()) {
      if (m.tool_calls.size() != 1)
        return error(errc::invalid_argument,
                     "messages[{}].tool_calls: the llama3 tool format takes one call per assistant message, got {}", i,
                     m.tool_calls.size());
      const chat_tool_call& c = m.tool_calls[0];
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"" + c.name + "\", \"parameters\": " +
             arguments_text(c.arguments) + "}<|eot_id|>";
    } else {
      out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + std::string(trim(m.content)) + "<|eot_id|>";
    }
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

// Mistral: v0.1/v0.2 turns with v0.3's tool blocks.
std::string render_mistral(std::span<const chat_message> ms, const chat_special_tokens& tok, const chat_tools& tools,
                           bool add_generation_prompt) {
  std::size_t last_user = ms.size();
  for (std::size_t i = 0; i < ms.size(); ++i)
    if (ms[i].role == "user") last_user = i;
  std::string out;
  for (std::size_t i = 0; i < ms.size(); ++i) {
    const chat_message& m = ms[i];
    if (m.role == "user") {
      if (i == last_user && !tools.functions.empty()) {
        out += "[AVAILABLE_TOOLS] [";
        for (std::size_t t = 0; t < tools.functions.size(); ++t) out += (t ? ", " : "") + python_json(tools.functions[t]);
        out += "][/AVAILABLE_TOOLS]";
      }
      out += "[INST] " + m.content + " [/INST]";
    } else if (m.role == "tool") {
      out += "[TOOL_RESULTS] {\"content\": " + m.content + ", \"call_id\": \"" + mistral_id(m.tool_call_id) +
             "\"}[/TOOL_RESULTS]";
    } else if (!m.tool_calls.empty()) {
      out += "[TOOL_CALLS] [";
      for (std::size_t c = 0; c < m.tool_calls.size(); ++c) {
        const chat_tool_call& call = m.tool_calls[c];
        out += (c ? ", " : "") + std::string("{\"name\": \"") + call.name + "\", \"arguments\": " +
               arguments_text(call.arguments) + ", \"id\": \"" + mistral_id(call.id) + "\"}";
      }
      out += "]" + tok.eos;
    } else {
      out += m.content + tok.eos;
    }
  }
  if (tools.force_call && add_generation_prompt) out += "[TOOL_CALLS]";
  return out;
}

// Qwen3's template: an assistant turn's "<think>reasoning</think>answer" is
// split at the last </think>; turns before the last user message keep the
// answer only, later ones (and the last message) are written as
// "<think>\nreasoning\n</think>\n\nanswer".
std::string render_qwen3(std::span<const chat_message> messages, const chat_tools& tools, bool add_generation_prompt) {
  std::size_t last_query = messages.size() - 1;  // the template's default when no user message
  for (std::size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_query = i;
  std::string out;
  for (std::size_t i = hermes_system(messages, tools, out); i < messages.size(); ++i) {
    const chat_message& m = messages[i];
    if (m.role == "tool") {
      out += hermes_tool_result(messages, i);
      continue;
    }
    out += "<|im_start|>" + m.role + "\n";
    if (m.role != "assistant") {
      out += m.content + "<|im_end|>\n";
      continue;
    }
    std::string_view content = m.content, reasoning;
    if (const std::size_t end = content.rfind("</think>"); end != std::string_view::npos) {
      std::string_view before = strip_newlines(content.substr(0, content.find("</think>")), false, true);
      if (const std::size_t open = before.rfind("<think>"); open != std::string_view::npos) before = before.substr(open + 7);
      reasoning = strip_newlines(before, true, false);
      content = strip_newlines(content.substr(end + 8), true, false);
    }
    const bool last = i + 1 == messages.size();
    if (i > last_query && (last || !reasoning.empty()))
      out += "<think>\n" + std::string(strip_newlines(reasoning, true, true)) + "\n</think>\n\n" +
             std::string(strip_newlines(content, true, false));
    else
      out += content;
    out += hermes_calls(m, !content.empty()) + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace

const char* chat_format_name(chat_format f) {
  switch (f) {
    case chat_format::plain: return "plain";
    case chat_format::chatml: return "chatml";
    case chat_format::qwen3: return "qwen3";
    case chat_format::llama2: return "llama2";
    case chat_format::llama3: return "llama3";
    case chat_format::mistral: return "mistral";
    case chat_format::gemma: return "gemma";
    case chat_format::phi3: return "phi3";
    case chat_format::zephyr: return "zephyr";
    case chat_format::deepseek: return "deepseek";
    case chat_format::deepseek3: return "deepseek3";
  }
  return "?";
}

std::span<const chat_format> all_chat_formats() { return k_formats; }

std::optional<chat_format> chat_format_from_name(std::string_view name) {
  for (chat_format f : k_formats)
    if (name == chat_format_name(f)) return f;
  return std::nullopt;
}

std::optional<chat_format> detect_chat_format(std::string_view t) {
  // Most specific markers first: Phi-3 and Zephyr share <|user|>, Llama 2 and
  // Mistral share [INST].
  if (contains(t, "<|im_start|>")) return contains(t, "enable_thinking") ? chat_format::qwen3 : chat_format::chatml;
  if (contains(t, "<|start_header_id|>") && contains(t, "<|end_header_id|>")) return chat_format::llama3;
  if (contains(t, "<start_of_turn>")) return chat_format::gemma;
  if (contains(t, "<|assistant|>") && contains(t, "<|end|>")) return chat_format::phi3;
  if (contains(t, "<|user|>") && contains(t, "<|assistant|>")) return chat_format::zephyr;
  if (contains(t, "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>") && contains(t, "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>"))
    return chat_format::deepseek3;
  if (contains(t, "User: ") && contains(t, "Assistant:")) return chat_format::deepseek;
  if (contains(t, "[INST]")) return contains(t, "<<SYS>>") ? chat_format::llama2 : chat_format::mistral;
  return std::nullopt;
}

bool chat_format_has_tools(chat_format f) {
  return f == chat_format::chatml || f == chat_format::qwen3 || f == chat_format::llama3 || f == chat_format::mistral;
}

namespace {

template <class J>
void append_python_json(const J& v, int indent, int level, std::string& out) {
  if (!v.is_object() && !v.is_array()) {
    out += v.dump(-1, ' ', false, J::error_handler_t::replace);
    return;
  }
  const bool object = v.is_object();
  if (v.empty()) {
    out += object ? "{}" : "[]";
    return;
  }
  out += object ? '{' : '[';
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!first) out += indent > 0 ? "," : ", ";
    first = false;
    if (indent > 0) out += '\n' + std::string(static_cast<std::size_t>((level + 1) * indent), ' ');
    if (object) out += J(it.key()).dump(-1, ' ', false, J::error_handler_t::replace) + ": ";
    append_python_json(it.value(), indent, level + 1, out);
  }
  if (indent > 0) out += '\n' + std::string(static_cast<std::size_t>(level * indent), ' ');
  out += object ? '}' : ']';
}

}  // namespace

std::string python_json(const nlohmann::ordered_json& v, int indent) {
  std::string out;
  append_python_json(v, indent, 0, out);
  return out;
}

result<std::string> render_chat(chat_format f, std::span<const chat_message> messages,
                                const chat_special_tokens& tok, bool add_generation_prompt, const chat_tools& tools) {
  if (messages.empty()) return error(errc::invalid_argument, "messages: at least one message is needed");
  const bool has_tools = chat_format_has_tools(f);
  if (!tools.functions.empty() && !has_tools)
    return error(errc::invalid_argument, "tools: the {} chat format has no tool format", chat_format_name(f));
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r == "tool" && !has_tools)
      return error(errc::invalid_argument, "messages[{}].role: the {} chat format has no tool format, so no tool role",
                   i, chat_format_name(f));
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      return error(errc::invalid_argument, "messages[{}].role: '{}' is not one of system, user, assistant, tool", i, r);
    if (!messages[i].tool_calls.empty() && (r != "assistant" || !has_tools))
      return error(errc::invalid_argument, "messages[{}].tool_calls: {}", i,
                   r != "assistant" ? "only assistant messages make tool calls"
                                    : fmt::format("the {} chat format has no tool format", chat_format_name(f)));
  }
  std::string out;
  switch (f) {
    case chat_format::plain:
      for (std::size_t i = 0; i < messages.size(); ++i) {
        if (i > 0) out += '\n';
        out += messages[i].content;
      }
      return out;

    case chat_format::chatml: return render_chatml(messages, tools, add_generation_prompt);

    case chat_format::qwen3: return render_qwen3(messages, tools, add_generation_prompt);

    case chat_format::llama3: return render_llama3(messages, tools, add_generation_prompt);

    case chat_format::llama2: {
      // The system message rides in the first turn's [INST] block; every user
      // turn but the first (whose BOS the tokenizer adds) starts with BOS.
      std::size_t first = 0;
      std::string system;
      if (messages[0].role == "system") {
        system = messages[0].content;
        first = 1;
      }
      for (std::size_t i = first; i < messages.size(); ++i) {
        const chat_message& m = messages[i];
        if (m.role == "system")
          return error(errc::invalid_argument, "messages[{}]: the llama2 chat format takes one system message, first", i);
        std::string content = m.content;
        if (i == first && first == 1) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
        if (m.role == "user") {
          if (i != first) out += tok.bos;
          out += "[INST] " + std::string(trim(content)) + " [/INST]";
        } else {
          out += " " + std::string(trim(content)) + " " + tok.eos;
        }
      }
      return out;
    }

    case chat_format::mistral: {
      PAGODA_ASSIGN_OR_RETURN(std::vector<chat_message> ms, fold_system(messages, f));
      return render_mistral(ms, tok, tools, add_generation_prompt);
    }

    case chat_format::gemma: {
      PAGODA_ASSIGN_OR_RETURN(std::vector<chat_message> ms, fold_system(messages, f));
      for (const chat_message& m : ms) {
        const char* role = m.role == "assistant" ? "model" : "user";
        out += std::string("<start_of_turn>") + role + "\n" + std::string(trim(m.content)) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      return out;
    }

    case chat_format::phi3:
      for (const chat_message& m : messages) out += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
      if (add_generation_prompt) out += "<|assistant|>\n";
      else out += tok.eos;
      return out;

    case chat_format::zephyr:
      for (const chat_message& m : messages) out += "<|" + m.role + "|>\n" + m.content + tok.eos + "\n";
      if (add_generation_prompt) out += "<|assistant|>\n";
      return out;

    case chat_format::deepseek:
      for (const chat_message& m : messages) {
        if (m.role == "system") out += m.content + "\n\n";
        else if (m.role == "user") out += "User: " + m.content + "\n\n";
        else out += "Assistant: " + m.content + tok.eos;
      }
      if (add_generation_prompt) out += "Assistant:";
      return out;

    case chat_format::deepseek3: {
      const std::string user = "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>";
      const std::string assistant = "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
      // System prompts come first, right after BOS, whatever their position,
      // joined by blank lines.
      bool first_system = true;
      for (const chat_message& m : messages) {
        if (m.role != "system") continue;
        if (!first_system) out += "\n\n";
        out += m.content;
        first_system = false;
      }
      for (const chat_message& m : messages) {
        if (m.role == "user") out += user + m.content;
        else if (m.role == "assistant") out += assistant + m.content + tok.eos;
      }
      if (add_generation_prompt) out += assistant;
      return out;
    }
  }
  return error(errc::internal, "unknown chat format");
}

}  // namespace pagoda::server
