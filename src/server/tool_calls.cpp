#include "server/tool_calls.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/hash.h"
#include "grammar/convert.h"
#include "grammar/gbnf.h"

namespace pagoda::server {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
constexpr std::size_t npos = std::string_view::npos;

const json* present(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

bool valid_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// tools[i]: {"type": "function", "function": {"name", "description"?, "parameters"?}}.
std::optional<api_error> read_tool(const json& tool, std::size_t i, tool_request& out) {
  const std::string at = fmt::format("tools[{}]", i);
  if (!tool.is_object()) return bad_request(at, fmt::format("'{}' must be an object {{\"type\": \"function\", ...}}", at));
  const json* type = present(tool, "type");
  if (!type || *type != "function")
    return bad_request(at + ".type", fmt::format("'{}.type' must be \"function\" (the only tool type served)", at));
  const json* fn = present(tool, "function");
  if (!fn || !fn->is_object())
    return bad_request(at + ".function", fmt::format("'{}.function' must be an object with a 'name'", at));
  const json* name = present(*fn, "name");
  if (!name || !name->is_string())
    return bad_request(at + ".function.name", fmt::format("'{}.function.name' is required (a string)", at));
  tool_function f{name->get<std::string>(), json(), ordered_json::object()};
  if (!valid_name(f.name))
    return bad_request(at + ".function.name",
                       fmt::format("'{}.function.name' must be 1 to 64 letters, digits, '_' or '-'", at));
  if (out.find(f.name))
    return bad_request(at + ".function.name", fmt::format("two tools are named '{}'", f.name));
  f.definition["type"] = "function";
  ordered_json& d = f.definition["function"];
  d["name"] = f.name;
  if (const json* desc = present(*fn, "description")) {
    if (!desc->is_string())
      return bad_request(at + ".function.description", fmt::format("'{}.function.description' must be a string", at));
    d["description"] = desc->get<std::string>();
  }
  if (const json* params = present(*fn, "parameters")) {
    const std::string field = at + ".function.parameters";
    if (!params->is_object())
      return bad_request(field, fmt::format("'{}' must be a JSON Schema object", field));
    if (const json* t = present(*params, "type"); t && *t != "object")
      return bad_request(field + ".type",
                         fmt::format("'{}.type' must be \"object\": a call's arguments are an object", field));
    f.parameters = *params;
    d["parameters"] = ordered_json::parse(params->dump());
  }
  out.functions.push_back(std::move(f));
  return {};
}

std::optional<api_error> read_choice(const json& body, tool_request& out) {
  const json* v = present(body, "tool_choice");
  out.choice = out.functions.empty() ? tool_choice_kind::none : tool_choice_kind::automatic;
  if (!v) return {};
  const char* shape = "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
  if (v->is_string()) {
    const std::string s = v->get<std::string>();
    if (s == "none") out.choice = tool_choice_kind::none;
    else if (s == "auto") out.choice = out.functions.empty() ? tool_choice_kind::none : tool_choice_kind::automatic;
    else if (s == "required") out.choice = tool_choice_kind::required;
    else return bad_request("tool_choice", shape);
  } else if (v->is_object()) {
    const json* type = present(*v, "type");
    if (!type || *type != "function") return bad_request("tool_choice.type", shape);
    const json* fn = present(*v, "function");
    const json* name = fn && fn->is_object() ? present(*fn, "name") : nullptr;
    if (!name || !name->is_string()) return bad_request("tool_choice.function.name", shape);
    out.choice = tool_choice_kind::named;
    out.named = name->get<std::string>();
    if (!out.find(out.named))
      return bad_request("tool_choice.function.name",
                         fmt::format("'tool_choice' names the function '{}', which is not among the tools",
                                     out.named.substr(0, 64)));
  } else {
    return bad_request("tool_choice", shape);
  }
  if (out.forced() && out.functions.empty())
    return bad_request("tool_choice", "'tool_choice' asks for a tool call, but the request has no 'tools'");
  return {};
}

// ---- Scanning the model's text for calls ----

enum class scan { ok, more, bad };  // more: the text ends before it can tell

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

struct cursor {
  std::string_view s;
  std::size_t i = 0;
  bool at_end() const { return i >= s.size(); }
  void ws() {
    while (i < s.size() && is_ws(s[i])) ++i;
  }
  scan literal(std::string_view lit) {
    const std::size_t n = std::min(lit.size(), s.size() - i);
    if (s.substr(i, n) != lit.substr(0, n)) return scan::bad;
    if (n < lit.size()) return scan::more;
    i += n;
    return scan::ok;
  }
};

// Past one JSON value; what is inside is checked by json::parse afterwards.
scan skip_value(cursor& c) {
  if (c.at_end()) return scan::more;
  const char first = c.s[c.i];
  if (first == '"' || first == '{' || first == '[') {
    int depth = 0;
    bool in_string = false, escaped = false;
    for (; c.i < c.s.size(); ++c.i) {
      const char x = c.s[c.i];
      if (in_string) {
        if (escaped) escaped = false;
        else if (x == '\\') escaped = true;
        else if (x == '"') in_string = false;
        if (!in_string && depth == 0) {
          ++c.i;
          return scan::ok;
        }
        continue;
      }
      if (x == '"') in_string = true;
      else if (x == '{' || x == '[') ++depth;
      else if ((x == '}' || x == ']') && --depth == 0) {
        ++c.i;
        return scan::ok;
      }
    }
    return scan::more;
  }
  const std::size_t b = c.i;
  while (c.i < c.s.size() && std::string_view("-+.0123456789eEtruefalsn").find(c.s[c.i]) != npos) ++c.i;
  if (c.i == b) return scan::bad;
  return c.at_end() ? scan::more : scan::ok;
}

struct call_scan {
  std::optional<std::string> name;
  std::size_t args_begin = npos, args_end = npos;  // the arguments value in the text
  bool complete = false;                           // the object closed
};

// {"name": ..., "arguments": ...} (any key order, other keys skipped).
scan scan_call(cursor& c, call_scan& call) {
  if (scan r = c.literal("{"); r != scan::ok) return r;
  c.ws();
  if (c.at_end()) return scan::more;
  while (c.s[c.i] != '}') {
    const std::size_t key_begin = c.i;
    if (c.s[c.i] != '"') return scan::bad;
    if (scan r = skip_value(c); r != scan::ok) return r;
    const json key = json::parse(c.s.substr(key_begin, c.i - key_begin), nullptr, false);
    if (!key.is_string()) return scan::bad;
    c.ws();
    if (scan r = c.literal(":"); r != scan::ok) return r;
    c.ws();
    const std::size_t value_begin = c.i;
    const bool is_args = key == "arguments" || key == "parameters";
    if (is_args && call.args_begin != npos) return scan::bad;  // which would it be?
    if (is_args) call.args_begin = value_begin;
    if (scan r = skip_value(c); r != scan::ok) return r;
    if (is_args) call.args_end = c.i;
    if (key == "name") {
      if (call.name) return scan::bad;
      const json v = json::parse(c.s.substr(value_begin, c.i - value_begin), nullptr, false);
      if (!v.is_string()) return scan::bad;
      call.name = v.get<std::string>();
    }
    c.ws();
    if (c.at_end()) return scan::more;
    if (c.s[c.i] == ',') {
      ++c.i;
      c.ws();
      if (c.at_end()) return scan::more;
    } else if (c.s[c.i] != '}') {
      return scan::bad;
    }
  }
  ++c.i;
  call.complete = true;
  return scan::ok;
}

struct output_scan {
  std::size_t content_end = 0;  // the content is text[0, content_end)
  std::size_t hold = 0;         // bytes at the content's end that may begin a call marker
  bool has_calls = false;       // the calls' syntax begins at content_end
  bool complete = false;        // has_calls: the text as it stands is whole calls
  bool bad = false;             // has_calls: the text cannot become calls
  std::vector<call_scan> calls;
};

// The longest suffix of `text` that is a proper prefix of `marker`.
std::size_t marker_prefix_at_end(std::string_view text, std::string_view marker) {
  for (std::size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

// Hermes: (<tool_call> {call} </tool_call>)*, the last closing tag optional at the end.
void scan_hermes(cursor& c, output_scan& o) {
  while (true) {
    c.ws();
    if (c.at_end()) return void(o.complete = !o.calls.empty());
    if (scan r = c.literal("<tool_call>"); r != scan::ok) return void(o.bad = r == scan::bad);
    c.ws();
    call_scan& call = o.calls.emplace_back();
    if (scan r = scan_call(c, call); r != scan::ok) return void(o.bad = r == scan::bad);
    c.ws();
    if (c.at_end()) return void(o.complete = true);
    if (scan r = c.literal("</tool_call>"); r != scan::ok) return void(o.bad = r == scan::bad);
  }
}

// Mistral: [ {call}, {call} ].
void scan_array(cursor& c, output_scan& o) {
  c.ws();
  if (scan r = c.literal("["); r != scan::ok) return void(o.bad = r == scan::bad);
  while (true) {
    c.ws();
    call_scan& call = o.calls.emplace_back();
    if (scan r = scan_call(c, call); r != scan::ok) return void(o.bad = r == scan::bad);
    c.ws();
    if (c.at_end()) return;
    if (c.s[c.i] == ']') break;
    if (c.s[c.i] != ',') return void(o.bad = true);
    ++c.i;
  }
  ++c.i;
  c.ws();
  if (!c.at_end()) return void(o.bad = true);
  o.complete = true;
}

// Llama 3: one {call}, the whole answer.
void scan_single(cursor& c, output_scan& o) {
  call_scan& call = o.calls.emplace_back();
  if (scan r = scan_call(c, call); r != scan::ok) return void(o.bad = r == scan::bad);
  c.ws();
  if (!c.at_end()) return void(o.bad = true);
  o.complete = true;
}

output_scan scan_output(chat_format f, std::string_view text) {
  output_scan o;
  o.content_end = text.size();
  const std::size_t first = std::min(text.find_first_not_of(" \t\r\n"), text.size());
  const std::string_view rest = text.substr(first);
  std::size_t start = npos, body = npos;  // where the calls begin, and their body after the marker
  if (f == chat_format::chatml || f == chat_format::qwen3) {
    start = body = text.find("<tool_call>");
    if (start == npos) o.hold = marker_prefix_at_end(text, "<tool_call>");
  } else if (f == chat_format::mistral) {
    const std::string_view marker = "[TOOL_CALLS]";
    if (start = text.find(marker); start != npos) body = start + marker.size();
    else if (rest.size() < marker.size() && marker.starts_with(rest)) o.hold = text.size() - first;
    else if (rest.starts_with("[")) start = body = first;
    else o.hold = marker_prefix_at_end(text, marker);
  } else if (f == chat_format::llama3) {
    const std::string_view tag = "<|python_tag|>";
    if (rest.starts_with(tag)) start = first, body = first + tag.size();
    else if (!rest.empty() && tag.starts_with(rest)) o.hold = rest.size();
    else if (rest.starts_with("{")) start = body = first;
  }
  if (start == npos) return o;
  o.content_end = start;
  o.has_calls = true;
  cursor c{text, body};
  if (f == chat_format::llama3) c.ws();
  if (f == chat_format::chatml || f == chat_format::qwen3) scan_hermes(c, o);
  else if (f == chat_format::mistral) scan_array(c, o);
  else scan_single(c, o);
  return o;
}

std::string_view trim_right(std::string_view s) {
  while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
  return s;
}

// A scanned call as the response gives it; nullopt when it is not a valid call.
std::optional<chat_tool_call> finish_call(const tool_request& t, std::string_view text, const call_scan& s) {
  if (!s.complete || !s.name || !t.find(*s.name)) return std::nullopt;
  chat_tool_call call{"", *s.name, "{}"};
  if (s.args_begin == npos) return call;
  const std::string_view raw = text.substr(s.args_begin, s.args_end - s.args_begin);
  const json args = json::parse(raw, nullptr, false);
  if (args.is_object()) {
    call.arguments = std::string(raw);
  } else if (args.is_string()) {  // arguments as JSON text, OpenAI's own shape
    const json inner = json::parse(args.get<std::string>(), nullptr, false);
    if (!inner.is_object()) return std::nullopt;
    call.arguments = args.get<std::string>();
  } else {
    return std::nullopt;
  }
  return call;
}

// ---- The grammar of forced calls ----

// One call to `f` in the format's syntax; `args` is the arguments' expression.
std::string call_expression(chat_format format, const std::string& name, const std::string& args) {
  const std::string head = grammar::gbnf_literal("{\"name\": \"" + name + "\", \"" +
                                                 (format == chat_format::llama3 ? "parameters" : "arguments") + "\": ");
  std::string call = head + " ( " + args + " ) \"}\"";
  if (format == chat_format::chatml || format == chat_format::qwen3)
    call = grammar::gbnf_literal("<tool_call>\n") + " " + call + " " + grammar::gbnf_literal("\n</tool_call>");
  return call;
}

}  // namespace

const tool_function* tool_request::find(std::string_view name) const {
  for (const tool_function& f : functions)
    if (f.name == name) return &f;
  return nullptr;
}

std::optional<api_error> read_tools(const json& body, chat_format format, tool_request& out) {
  out = tool_request{};
  out.format = format;
  if (const json* tools = present(body, "tools")) {
    if (!tools->is_array()) return bad_request("tools", "'tools' must be an array");
    if (tools->size() > k_max_tools)
      return bad_request("tools", fmt::format("at most {} tools per request, got {}", k_max_tools, tools->size()));
    for (std::size_t i = 0; i < tools->size(); ++i)
      if (auto e = read_tool((*tools)[i], i, out)) return e;
  }
  if (const json* p = present(body, "parallel_tool_calls")) {
    if (!p->is_boolean()) return bad_request("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    out.parallel = p->get<bool>();
  }
  if (auto e = read_choice(body, out)) return e;
  if (out.active() && !chat_format_has_tools(format))
    return bad_request("tools",
                       fmt::format("this model's chat template ({}) has no tool format; tools work with the chatml, "
                                   "qwen3, llama3 and mistral templates (--chat-template), or with tool_choice \"none\"",
                                   chat_format_name(format)));
  return {};
}

std::optional<api_error> read_message_tools(const json& msg, const std::string& name, chat_format format,
                                            chat_message& m) {
  if (m.role == "tool") {
    const json* id = present(msg, "tool_call_id");
    if (!id || !id->is_string())
      return bad_request(name + ".tool_call_id", "a tool message needs 'tool_call_id' (a string)");
    m.tool_call_id = id->get<std::string>();
  }
  const json* tc = present(msg, "tool_calls");
  if (!tc || (tc->is_array() && tc->empty())) return {};
  const std::string at = name + ".tool_calls";
  if (m.role != "assistant") return bad_request(at, "only assistant messages carry 'tool_calls'");
  if (!chat_format_has_tools(format))
    return bad_request(at, fmt::format("this model's chat template ({}) has no tool format", chat_format_name(format)));
  if (!tc->is_array()) return bad_request(at, fmt::format("'{}' must be an array", at));
  if (tc->size() > k_max_tools) return bad_request(at, fmt::format("at most {} tool calls per message", k_max_tools));
  for (std::size_t j = 0; j < tc->size(); ++j) {
    const json& c = (*tc)[j];
    const std::string cj = fmt::format("{}[{}]", at, j);
    if (!c.is_object()) return bad_request(cj, fmt::format("'{}' must be an object", cj));
    chat_tool_call call;
    if (const json* id = present(c, "id")) {
      if (!id->is_string()) return bad_request(cj + ".id", fmt::format("'{}.id' must be a string", cj));
      call.id = id->get<std::string>();
    }
    if (const json* type = present(c, "type"); type && *type != "function")
      return bad_request(cj + ".type", fmt::format("'{}.type' must be \"function\"", cj));
    const json* fn = present(c, "function");
    if (!fn || !fn->is_object())
      return bad_request(cj + ".function", "a tool call needs 'function': {\"name\", \"arguments\"}");
    const json* fname = present(*fn, "name");
    if (!fname || !fname->is_string() || fname->get_ref<const std::string&>().empty())
      return bad_request(cj + ".function.name", "a tool call needs 'function.name' (a non-empty string)");
    call.name = fname->get<std::string>();
    const json* args = present(*fn, "arguments");
    if (args && args->is_object()) {
      call.arguments = args->dump();
    } else if (!args || !args->is_string() || !json::parse(args->get<std::string>(), nullptr, false).is_object()) {
      return bad_request(cj + ".function.arguments", "'function.arguments' must be a JSON object as text");
    } else {
      call.arguments = args->get<std::string>();
    }
    m.tool_calls.push_back(std::move(call));
  }
  return {};
}

chat_tools prompt_tools(const tool_request& t) {
  chat_tools out;
  if (!t.active()) return out;
  for (const tool_function& f : t.functions) out.functions.push_back(f.definition);
  out.force_call = t.forced();
  return out;
}

result<std::string> tool_call_grammar(const tool_request& t, std::string* bad_field) {
  std::vector<const tool_function*> fns;
  std::vector<json> schemas;
  std::vector<std::string> prefixes;
  std::vector<std::size_t> with_schema;  // index into fns
  for (std::size_t i = 0; i < t.functions.size(); ++i) {
    const tool_function& f = t.functions[i];
    if (t.choice == tool_choice_kind::named && f.name != t.named) continue;
    fns.push_back(&f);
    if (f.parameters.is_null()) continue;
    // One at a time first, so an error names its tool.
    if (auto one = grammar::json_schema_to_gbnf(f.parameters); !one.ok()) {
      const std::string field = fmt::format("tools[{}].function.parameters", i);
      if (bad_field) *bad_field = field;
      return error(errc::invalid_argument, "'{}': {}", field, one.error().message());
    }
    schemas.push_back(f.parameters);
    prefixes.push_back(fmt::format("tool{}-", fns.size() - 1));
    with_schema.push_back(fns.size() - 1);
  }
  grammar::schema_set_gbnf set;
  PAGODA_ASSIGN_OR_RETURN(set, grammar::json_schemas_to_gbnf(schemas, prefixes));
  std::string calls, rules;
  for (std::size_t i = 0, k = 0; i < fns.size(); ++i) {
    std::string args = "\"{}\"";
    if (k < with_schema.size() && with_schema[k] == i) args = set.tops[k++];
    const std::string rule = fmt::format("call{}", i);
    rules += rule + " ::= " + call_expression(t.format, fns[i]->name, args) + "\n";
    calls += (calls.empty() ? "" : " | ") + rule;
  }
  std::string root;
  if (t.format == chat_format::mistral)
    root = t.single() ? "\" \"? \"[\" call \"]\"" : "\" \"? \"[\" call ( \", \" call )* \"]\"";
  else if (t.format == chat_format::llama3 || t.single())
    root = "call";
  else
    root = "call ( \"\\n\" call )*";
  std::string text = "root ::= " + root + "\ncall ::= " + calls + "\n" + rules + set.rules;
  if (auto g = grammar::parse_gbnf(text); !g.ok()) {
    if (bad_field) *bad_field = "tools";
    return error(errc::invalid_argument, "'tools': the calls' grammar: {}", g.error().message());
  }
  return text;
}

parsed_tool_output parse_tool_output(const tool_request& t, std::string_view text) {
  parsed_tool_output out;
  out.content = std::string(text);
  const output_scan o = scan_output(t.format, text);
  if (!o.has_calls || o.bad || !o.complete) return out;
  std::vector<chat_tool_call> calls;
  for (const call_scan& s : o.calls) {
    auto call = finish_call(t, text, s);
    if (!call) return out;
    calls.push_back(std::move(*call));
  }
  out.called = true;
  out.calls = std::move(calls);
  out.content = std::string(trim_right(text.substr(0, o.content_end)));
  return out;
}

std::string tool_call_id(chat_format f, std::string_view response_id, std::size_t choice, std::size_t index) {
  const std::string key = fmt::format("{}/{}/{}", response_id, choice, index);
  const std::uint64_t a = hash_bytes(key.data(), key.size(), 0x7461626c65ull);
  const std::uint64_t b = hash_bytes(key.data(), key.size(), a);
  if (f == chat_format::mistral) {
    constexpr std::string_view digits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    std::string id;
    std::uint64_t x = a;
    for (int i = 0; i < 9; ++i, x /= digits.size()) id += digits[x % digits.size()];
    return id;
  }
  return fmt::format("call_{:016x}{:08x}", a, static_cast<std::uint32_t>(b));
}

std::string tool_finish_reason(const tool_request& t, bool called, const std::string& engine_reason) {
  if (!called || engine_reason == "abort" || engine_reason == "error") return engine_reason;
  return t.choice == tool_choice_kind::named ? "stop" : "tool_calls";
}

void tool_call_stream::feed(std::string_view text, std::vector<tool_delta>& out) {
  text_ += text;
  release(out);
}

void tool_call_stream::release(std::vector<tool_delta>& out) {
  const output_scan o = scan_output(tools_->format, text_);
  if (!calls_began_) {
    // Content, less what may begin a call and the trailing whitespace (which
    // goes out with the text after it, or is dropped before calls).
    std::size_t limit = o.content_end - (o.has_calls ? 0 : o.hold);
    while (limit > content_sent_ && is_ws(text_[limit - 1])) --limit;
    if (limit > content_sent_) {
      out.push_back({false, 0, "", text_.substr(content_sent_, limit - content_sent_)});
      content_sent_ = limit;
    }
  }
  if (!o.has_calls || o.bad) return;
  for (std::size_t k = 0; k < o.calls.size(); ++k) {
    const call_scan& s = o.calls[k];
    if (k >= args_sent_.size()) {
      if (!s.name || !tools_->find(*s.name)) return;
      out.push_back({true, k, *s.name, ""});
      args_sent_.push_back(0);
      calls_began_ = true;
    }
    if (s.args_begin != npos && s.args_begin < text_.size() && text_[s.args_begin] == '{') {
      const std::size_t end = s.args_end != npos ? s.args_end : text_.size();
      if (end - s.args_begin > args_sent_[k]) {
        out.push_back({true, k, "", text_.substr(s.args_begin + args_sent_[k], end - s.args_begin - args_sent_[k])});
        args_sent_[k] = end - s.args_begin;
      }
    }
    if (!s.complete) return;
  }
}

bool tool_call_stream::finish(std::vector<tool_delta>& out) {
  const parsed_tool_output parsed = parse_tool_output(*tools_, text_);
  if (!parsed.called) {
    if (!calls_began_ && text_.size() > content_sent_) out.push_back({false, 0, "", text_.substr(content_sent_)});
    content_sent_ = text_.size();
    return false;
  }
  if (!calls_began_ && parsed.content.size() > content_sent_)
    out.push_back({false, 0, "", parsed.content.substr(content_sent_)});
  for (std::size_t k = 0; k < parsed.calls.size(); ++k) {
    const chat_tool_call& c = parsed.calls[k];
    if (k >= args_sent_.size()) {
      out.push_back({true, k, c.name, ""});
      args_sent_.push_back(0);
    }
    if (c.arguments.size() > args_sent_[k]) out.push_back({true, k, "", c.arguments.substr(args_sent_[k])});
    args_sent_[k] = c.arguments.size();
  }
  calls_began_ = true;
  return true;
}

}  // namespace pagoda::server
