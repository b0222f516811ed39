#include "server/chat_template.h"

#include <array>

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
      out.push_back({m.role, system + "\n\n" + m.content});
      system.clear();
    } else {
      out.push_back(m);
    }
    began = true;
  }
  if (!system.empty()) out.push_back({"user", system});  // only system messages: they are the user's words
  return out;
}

std::string_view strip_newlines(std::string_view s, bool left, bool right) {
  while (left && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (right && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// Qwen3's template: an assistant turn's "<think>reasoning</think>answer" is
// split at the last </think>; turns before the last user message keep the
// answer only, later ones (and the last message) are written as
// "<think>\nreasoning\n</think>\n\nanswer".
std::string render_qwen3(std::span<const chat_message> messages, bool add_generation_prompt) {
  std::size_t last_query = messages.size() - 1;  // the template's default when no user message
  for (std::size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_query = i;
  std::string out;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const chat_message& m = messages[i];
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
    out += "<|im_end|>\n";
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

result<std::string> render_chat(chat_format f, std::span<const chat_message> messages,
                                const chat_special_tokens& tok, bool add_generation_prompt) {
  if (messages.empty()) return error(errc::invalid_argument, "messages: at least one message is needed");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      return error(errc::invalid_argument, "messages[{}].role: '{}' is not one of system, user, assistant", i, r);
  }
  std::string out;
  switch (f) {
    case chat_format::plain:
      for (std::size_t i = 0; i < messages.size(); ++i) {
        if (i > 0) out += '\n';
        out += messages[i].content;
      }
      return out;

    case chat_format::chatml:
      for (const chat_message& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;

    case chat_format::qwen3: return render_qwen3(messages, add_generation_prompt);

    case chat_format::llama3:
      for (const chat_message& m : messages)
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + std::string(trim(m.content)) + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;

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
      for (const chat_message& m : ms) {
        if (m.role == "user") out += "[INST] " + m.content + " [/INST]";
        else out += m.content + tok.eos;
      }
      return out;
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
