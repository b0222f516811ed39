#include "server/openai_request.h"

#include "policy/streaming.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <random>

#include "core/clock.h"
#include "policy/kv_policy.h"
#include "spec/speculative.h"
#include "server/image_input.h"
#include "server/prompt_segments.h"
#include "server/structured_output.h"
#include "server/tool_calls.h"

namespace pagoda::server {
namespace {

using nlohmann::json;
using maybe_error = std::optional<api_error>;

// Evaluates an expression yielding maybe_error; returns the error if there is one.
#define PAGODA_API_TRY(expr)                      \
  do {                                            \
    if (maybe_error pagoda_e_ = (expr)) return std::move(*pagoda_e_); \
  } while (0)

// The field's value; nullptr when absent or null (null means "the default").
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

const char* json_type(const json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number_float()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

std::string excerpt(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s;
}

api_error type_error(const std::string& name, const char* expected, const json& v) {
  return bad_request(name, fmt::format("'{}' must be {}, not {}", name, expected, json_type(v)));
}

api_error range_error(const std::string& name, const std::string& range, const json& v) {
  return bad_request(name, fmt::format("'{}' must be {}, got {}", name, range, excerpt(v)));
}

api_error unsupported(const std::string& name, const std::string& neutral) {
  return bad_request(name, fmt::format("'{}' is not supported by this server; omit it or set it to {}", name, neutral),
                     "unsupported_parameter");
}

// An integer in [lo, hi]; a number with no fraction counts as an integer.
maybe_error read_int(const json& v, const std::string& name, std::int64_t lo, std::int64_t hi, std::int64_t& out) {
  const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
  if (v.is_number_unsigned()) {
    std::uint64_t u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi)) return range_error(name, range, v);
    out = static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    out = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    if (d != std::floor(d)) return type_error(name, "an integer", v);
    if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) return range_error(name, range, v);
    out = static_cast<std::int64_t>(d);
  } else {
    return type_error(name, "an integer", v);
  }
  if (out < lo || out > hi) return range_error(name, range, v);
  return {};
}

maybe_error read_int(const json& body, const char* name, std::int64_t lo, std::int64_t hi,
                     std::optional<std::int64_t>& out) {
  const json* v = field(body, name);
  if (!v) return {};
  std::int64_t x = 0;
  PAGODA_API_TRY(read_int(*v, name, lo, hi, x));
  out = x;
  return {};
}

// A number in [lo, hi] (or (lo, hi] when lo_open), as the float the engine
// uses: a positive value too small for a float (5e-324) becomes the smallest
// positive float rather than 0, so what passes here never fails later.
maybe_error read_number(const json& body, const char* name, double lo, double hi, bool lo_open,
                        std::optional<double>& out) {
  const json* v = field(body, name);
  if (!v) return {};
  if (!v->is_number()) return type_error(name, "a number", *v);
  double d = v->get<double>();
  if (!(lo_open ? d > lo : d >= lo) || !(d <= hi))
    return range_error(name, fmt::format("a number in {}{}, {}]", lo_open ? "(" : "[", lo, hi), *v);
  if (lo_open && static_cast<float>(d) <= static_cast<float>(lo))
    d = std::nextafter(static_cast<float>(lo), std::numeric_limits<float>::infinity());
  out = d;
  return {};
}

// logit_bias: {"token id": bias}, OpenAI's shape; ids in the vocabulary, biases in [-100, 100].
maybe_error read_logit_bias(const json& body, int n_vocab, std::vector<std::pair<token_id, float>>& out) {
  const json* v = field(body, "logit_bias");
  if (!v) return {};
  if (!v->is_object()) return type_error("logit_bias", "an object", *v);
  for (const auto& [key, bias] : v->items()) {
    const std::string name = fmt::format("logit_bias[{}]", excerpt(json(key)));
    std::int64_t id = -1;
    if (!key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == std::string::npos) id = std::stoll(key);
    if (id < 0 || id >= n_vocab)
      return bad_request("logit_bias",
                         fmt::format("'logit_bias' keys must be token ids in [0, {}], got {}", n_vocab - 1, excerpt(json(key))));
    if (!bias.is_number()) return type_error(name, "a number", bias);
    const double b = bias.get<double>();
    if (!(b >= -100.0 && b <= 100.0)) return range_error(name, "a number in [-100, 100]", bias);
    out.emplace_back(static_cast<token_id>(id), static_cast<float>(b));
  }
  return {};
}

maybe_error read_bool(const json& body, const char* name, bool& out) {
  const json* v = field(body, name);
  if (!v) return {};
  if (!v->is_boolean()) return type_error(name, "a boolean", *v);
  out = v->get<bool>();
  return {};
}

maybe_error read_string(const json& body, const char* name, std::optional<std::string>& out) {
  const json* v = field(body, name);
  if (!v) return {};
  if (!v->is_string()) return type_error(name, "a string", *v);
  out = v->get<std::string>();
  return {};
}

std::uint64_t fresh_seed() {
  static std::atomic<std::uint64_t> state{(static_cast<std::uint64_t>(std::random_device{}()) << 32) ^
                                          static_cast<std::uint64_t>(now_us())};
  // splitmix64 over a shared counter: distinct seeds across threads, no lock.
  std::uint64_t z = state.fetch_add(0x9E3779B97F4A7C15ull) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fields accepted only at their neutral value.
maybe_error check_neutral_fields(const json& body, api_kind kind, int n) {
  {
    std::optional<std::int64_t> v;
    PAGODA_API_TRY(read_int(body, "min_tokens", 0, std::numeric_limits<std::int32_t>::max(), v));
    if (v && *v != 0) return unsupported("min_tokens", "0");
  }
  for (const char* name : {"tools", "functions"}) {
    if (kind == api_kind::chat && std::string_view(name) == "tools") continue;  // server/tool_calls.h
    if (const json* v = field(body, name)) {
      if (!v->is_array()) return type_error(name, "an array", *v);
      if (!v->empty()) return unsupported(name, "[]");
    }
  }
  if (const json* v = kind == api_kind::completion ? field(body, "tool_choice") : nullptr) {
    if (!v->is_string() || (*v != "none" && *v != "auto")) return unsupported("tool_choice", "\"none\"");
  }
  if (kind == api_kind::completion) {
    std::optional<std::string> suffix;
    PAGODA_API_TRY(read_string(body, "suffix", suffix));
    if (suffix && !suffix->empty()) return unsupported("suffix", "null");
    std::optional<std::int64_t> best_of;
    PAGODA_API_TRY(read_int(body, "best_of", 1, 1 << 20, best_of));
    if (best_of && *best_of != n) return unsupported("best_of", "n");
  }
  return {};
}

// Everything but the prompt and max_tokens: sampling, stops, streaming, tenancy.
// An extension field naming a KV policy ("NAME[:key=value,...]"), checked
// here so that a bad one is a 400 naming the field.
maybe_error read_kv_policy(const json& body, const char* name, std::string& out) {
  std::optional<std::string> text;
  PAGODA_API_TRY(read_string(body, name, text));
  if (!text) return {};
  if (text->size() > 1024) return bad_request(name, fmt::format("'{}' is at most 1024 bytes", name));
  auto spec = parse_kv_policy_spec(*text);
  if (!spec.ok()) return bad_request(name, spec.error().message());
  if (status st = check_kv_policy(*spec); !st.ok()) return bad_request(name, st.message());
  out = *text;
  return {};
}

// "speculative": "ngram:k=4" (docs/speculative.md); a bad one is a 400 naming the field.
maybe_error read_speculative(const json& body, std::string& out) {
  std::optional<std::string> text;
  PAGODA_API_TRY(read_string(body, "speculative", text));
  if (!text) return {};
  if (text->size() > 1024) return bad_request("speculative", "'speculative' is at most 1024 bytes");
  auto spec = parse_spec_config(*text);
  if (!spec.ok()) return bad_request("speculative", spec.error().message());
  out = spec->enabled() ? *text : "none";
  return {};
}

maybe_error parse_common(const json& body, const api_context& ctx, api_kind kind, const std::string& tenant,
                         api_call& call, request& base) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) return type_error("model", "a string", *m);
    const std::string& name = m->get_ref<const std::string&>();
    if (std::find(ctx.model_names.begin(), ctx.model_names.end(), name) == ctx.model_names.end())
      return bad_request("model",
                         fmt::format("The model '{}' does not exist; this server serves '{}'", name.substr(0, 200),
                                     ctx.model_names.empty() ? "" : ctx.model_names.front()),
                         "model_not_found");
  }

  // vLLM's SamplingParams defaults: temperature 1, top_p 1, top_k and min_p off.
  std::optional<double> temperature, top_p, min_p;
  std::optional<std::int64_t> top_k, n, priority;
  PAGODA_API_TRY(read_number(body, "temperature", 0.0, 2.0, false, temperature));
  PAGODA_API_TRY(read_number(body, "top_p", 0.0, 1.0, true, top_p));
  PAGODA_API_TRY(read_number(body, "min_p", 0.0, 1.0, false, min_p));
  PAGODA_API_TRY(read_int(body, "top_k", -1, std::numeric_limits<std::int32_t>::max(), top_k));
  PAGODA_API_TRY(read_int(body, "n", 1, ctx.limits.max_choices, n));
  PAGODA_API_TRY(read_int(body, "priority", -(1ll << 30), 1ll << 30, priority));
  base.sampling.temperature = static_cast<float>(temperature.value_or(1.0));
  base.sampling.top_p = static_cast<float>(top_p.value_or(1.0));
  base.sampling.min_p = static_cast<float>(min_p.value_or(0.0));
  base.sampling.top_k = static_cast<int>(std::max<std::int64_t>(top_k.value_or(0), 0));  // -1 and 0: off
  std::optional<double> presence, frequency, repetition;
  PAGODA_API_TRY(read_number(body, "presence_penalty", -2.0, 2.0, false, presence));
  PAGODA_API_TRY(read_number(body, "frequency_penalty", -2.0, 2.0, false, frequency));
  PAGODA_API_TRY(read_number(body, "repetition_penalty", 0.0, 2.0, true, repetition));
  base.sampling.presence_penalty = static_cast<float>(presence.value_or(0.0));
  base.sampling.frequency_penalty = static_cast<float>(frequency.value_or(0.0));
  base.sampling.repetition_penalty = static_cast<float>(repetition.value_or(1.0));
  PAGODA_API_TRY(read_logit_bias(body, ctx.vocab->n_vocab(), base.sampling.logit_bias));
  PAGODA_API_TRY(read_structured_output(body, base.sampling.grammar));
  call.n = static_cast<int>(n.value_or(1));
  base.n = call.n;
  base.priority = static_cast<int>(priority.value_or(0));

  if (const json* s = field(body, "seed")) {
    if (s->is_number_unsigned()) base.sampling.seed = s->get<std::uint64_t>();
    else if (s->is_number_integer()) base.sampling.seed = static_cast<std::uint64_t>(s->get<std::int64_t>());
    else return type_error("seed", "an integer", *s);
  } else {
    base.sampling.seed = fresh_seed();
  }

  if (const json* s = field(body, "stop")) {
    std::vector<std::string> stops;
    if (s->is_string()) {
      stops.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (std::size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) return type_error(fmt::format("stop[{}]", i), "a string", (*s)[i]);
        stops.push_back((*s)[i].get<std::string>());
      }
    } else {
      return type_error("stop", "a string or an array of strings", *s);
    }
    if (static_cast<int>(stops.size()) > ctx.limits.max_stop)
      return bad_request("stop", fmt::format("at most {} stop strings are allowed, got {}", ctx.limits.max_stop, stops.size()));
    for (const std::string& st : stops) {
      if (st.empty()) return bad_request("stop", "stop strings must not be empty");
      if (static_cast<int>(st.size()) > ctx.limits.max_stop_bytes)
        return bad_request("stop", fmt::format("a stop string is at most {} bytes", ctx.limits.max_stop_bytes));
    }
    base.stop = std::move(stops);
  }
  if (const json* s = field(body, "stop_token_ids")) {
    if (!s->is_array()) return type_error("stop_token_ids", "an array of integers", *s);
    if (static_cast<int>(s->size()) > ctx.limits.max_stop * 4)
      return bad_request("stop_token_ids", fmt::format("at most {} stop token ids are allowed", ctx.limits.max_stop * 4));
    for (std::size_t i = 0; i < s->size(); ++i) {
      std::int64_t id = 0;
      PAGODA_API_TRY(read_int((*s)[i], fmt::format("stop_token_ids[{}]", i), 0, ctx.vocab->n_vocab() - 1, id));
      base.stop_token_ids.push_back(static_cast<token_id>(id));
    }
  }
  PAGODA_API_TRY(read_bool(body, "ignore_eos", base.ignore_eos));

  PAGODA_API_TRY(read_bool(body, "stream", call.stream));
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) return type_error("stream_options", "an object", *so);
    if (!call.stream) return bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true");
    if (auto iu = so->find("include_usage"); iu != so->end() && !iu->is_null()) {
      if (!iu->is_boolean()) return type_error("stream_options.include_usage", "a boolean", *iu);
      call.include_usage = iu->get<bool>();
    }
  }

  if (kind == api_kind::completion) {
    std::optional<std::int64_t> lp;
    PAGODA_API_TRY(read_int(body, "logprobs", 0, ctx.limits.max_logprobs, lp));
    call.logprobs = lp ? static_cast<int>(*lp) : -1;
  } else {
    bool lp = false;
    std::optional<std::int64_t> top;
    PAGODA_API_TRY(read_bool(body, "logprobs", lp));
    PAGODA_API_TRY(read_int(body, "top_logprobs", 0, ctx.limits.max_logprobs, top));
    if (top && !lp) return bad_request("top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
    call.logprobs = lp ? static_cast<int>(top.value_or(0)) : -1;
  }
  base.logprobs = call.logprobs;
  PAGODA_API_TRY(read_bool(body, "return_tokens_as_token_ids", call.tokens_as_ids));

  std::optional<std::string> salt, user;
  PAGODA_API_TRY(read_string(body, "cache_salt", salt));
  if (salt && salt->empty()) return bad_request("cache_salt", "'cache_salt' must be a non-empty string when given");
  if (salt && salt->size() > 1024) return bad_request("cache_salt", "'cache_salt' is at most 1024 bytes");
  base.cache_salt = salt.value_or("");
  PAGODA_API_TRY(read_string(body, "user", user));  // accepted for compatibility; tenancy comes from the key
  base.tenant = tenant;
  PAGODA_API_TRY(read_kv_policy(body, "kv_policy", base.kv_policy));
  PAGODA_API_TRY(read_speculative(body, base.speculative));

  return check_neutral_fields(body, kind, call.n);
}

// max_completion_tokens wins over max_tokens, as in vLLM. Returns the value
// asked for and the field it came from; nullopt when neither is set.
maybe_error read_max_tokens(const json& body, std::int64_t most, std::optional<std::int64_t>& out, std::string& param) {
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    std::optional<std::int64_t> v;
    PAGODA_API_TRY(read_int(body, name, 0, most, v));
    if (v && !out) {
      out = v;
      param = name;
    }
  }
  return {};
}

// echo and prompt_logprobs (docs/serving.md, "Scoring a prompt"): the
// requests' prompt_logprobs is what the response needs of the engine, the
// larger of echo's logprobs and prompt_logprobs.
maybe_error read_scoring(const json& body, const api_context& ctx, api_kind kind, api_call& call, request& base) {
  PAGODA_API_TRY(read_bool(body, "echo", call.echo));
  std::optional<std::int64_t> n;
  PAGODA_API_TRY(read_int(body, "prompt_logprobs", 0, ctx.limits.max_logprobs, n));
  if (kind == api_kind::chat) {
    if (call.echo)
      return bad_request("echo", "'echo' is accepted on /v1/completions only; send the prompt there to have it echoed "
                         "and scored", "unsupported_parameter");
    if (n)
      return bad_request("prompt_logprobs", "'prompt_logprobs' is accepted on /v1/completions only; send the rendered "
                         "prompt there to score it", "unsupported_parameter");
    return {};
  }
  call.prompt_logprobs = n ? static_cast<int>(*n) : -1;
  base.prompt_logprobs = std::max(call.echo && call.logprobs >= 0 ? call.logprobs : -1, call.prompt_logprobs);
  return {};
}

// What echo puts before each prompt's completions: the prompt's text as
// sent, or for a prompt of token ids its decoded text.
std::vector<std::string> echo_texts(const json& body, const api_context& ctx, const std::vector<request>& requests) {
  std::vector<std::string> out;
  const json* p = field(body, "prompt");
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (p && p->is_string()) {
      out.push_back(p->get<std::string>());
    } else if (p && p->is_array() && !p->empty() && (*p)[0].is_object()) {  // parts of one prompt
      std::string text;
      for (const json& part : *p) text += part["text"].get<std::string>();
      out.push_back(std::move(text));
    } else if (p && p->is_array() && i < p->size() && (*p)[i].is_string()) {
      out.push_back((*p)[i].get<std::string>());
    } else {
      out.push_back(ctx.vocab->decode(requests[i].prompt));
    }
  }
  return out;
}

// " (N of them images')" for a prompt with images, so a context error says where the tokens went.
std::string images_note(const request& r) {
  std::int64_t n = 0;
  for (const image_span& s : r.images) n += s.n_tokens;
  return n > 0 ? fmt::format(" ({} of them images')", n) : std::string();
}

// Sets max_tokens on each request and checks the prompt against the limits.
maybe_error finish_requests(const json& body, const api_context& ctx, api_kind kind,
                            std::vector<std::vector<token_id>> prompts, const request& base, api_call& call) {
  const char* prompt_param = kind == api_kind::chat ? "messages" : "prompt";
  std::optional<std::int64_t> asked;
  std::string param;
  // A streaming window (StreamingLLM) generates past the context: its
  // max_tokens is bounded by the server's cap only.
  const bool streams = streams_past_context(base.kv_policy.empty() ? ctx.default_kv_policy : base.kv_policy,
                                            ctx.limits.max_model_len);
  PAGODA_API_TRY(read_max_tokens(body, streams ? ctx.limits.max_streaming_tokens : ctx.limits.max_tokens, asked, param));
  if (asked && *asked == 0 && !call.echo)
    return bad_request(param, fmt::format("'{}' 0 generates nothing: it is accepted with 'echo': true on "
                                          "/v1/completions, to score the prompt",
                                          param));
  if (static_cast<std::int64_t>(prompts.size()) * call.n > ctx.limits.max_choices)
    return bad_request("n", fmt::format("{} prompts x n = {} choices, more than the server's limit of {}", prompts.size(),
                                        prompts.size() * call.n, ctx.limits.max_choices));
  for (std::vector<token_id>& p : prompts) {
    const std::int64_t n_prompt = static_cast<std::int64_t>(p.size());
    if (n_prompt == 0) return bad_request(prompt_param, "the prompt is empty");
    if (n_prompt > ctx.limits.max_prompt_tokens || n_prompt >= ctx.limits.max_model_len)
      return bad_request(prompt_param,
                         fmt::format("the prompt is {} tokens{}, more than this server accepts ({} tokens, context {})",
                                     n_prompt, images_note(base), std::min(ctx.limits.max_prompt_tokens,
                                                                           ctx.limits.max_model_len - 1),
                                     ctx.limits.max_model_len),
                         "context_length_exceeded");
    const std::int64_t room = ctx.limits.max_model_len - n_prompt;
    std::int64_t max_tokens = 0;
    if (asked) {
      if (n_prompt + *asked > ctx.limits.max_model_len && !streams)
        return bad_request(param,
                           fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                       "tokens ({} in the {}{}, {} in the completion). Please reduce the length of the "
                                       "{} or completion.",
                                       ctx.limits.max_model_len, n_prompt + *asked, n_prompt, prompt_param,
                                       images_note(base), *asked, prompt_param),
                           "context_length_exceeded");
      max_tokens = *asked;
    } else {
      // OpenAI's defaults: 16 for completions, the rest of the context for chat.
      const std::int64_t def = kind == api_kind::chat ? ctx.limits.max_tokens : 16;
      max_tokens = std::min(def, room);
    }
    request r = base;
    r.prompt = std::move(p);
    r.max_tokens = static_cast<int>(max_tokens);
    call.requests.push_back(std::move(r));
  }
  return {};
}

std::vector<token_id> encode_text(const api_context& ctx, const std::string& text) {
  return ctx.vocab->encode(text, ctx.vocab->add_bos_default(), /*parse_special=*/true);
}

// prompt: a string, an array of token ids, or an array of either (several prompts).
// The pieces with a KV policy or type become the request's segments.
maybe_error segments_of(const api_context& ctx, const std::string& text, std::span<const token_id> prompt,
                        std::span<const text_piece> pieces, request& base) {
  const auto n_kv = std::count_if(pieces.begin(), pieces.end(), [](const text_piece& p) { return p.kv.any(); });
  if (n_kv == 0) return {};
  if (n_kv > k_max_kv_parts)
    return bad_request(pieces.front().param.starts_with("messages") ? "messages" : "prompt",
                       fmt::format("{} parts of this request carry a KV policy or type; at most {} may", n_kv,
                                   k_max_kv_parts));
  auto placed = place_segments(*ctx.vocab, ctx.vocab->add_bos_default(), text, prompt, pieces);
  if (!placed.ok()) return std::move(placed.error);
  base.segments = std::move(*placed.value);
  return {};
}

// A chat image_url part, read and not yet encoded.
struct pending_image {
  std::vector<std::uint8_t> bytes;  // the file (PNG or JPEG)
  kv_choice kv;                     // the part's own "kv"
  std::string param;                // "messages[1].content[0]"
};

// The prompt of a chat with images: the rendered text split at the media
// markers (one per image, in order), each piece tokenized (BOS before the
// first only, special tokens parsed), each marker replaced by its image's
// prompt part. The text parts' KV choices are placed within the piece that
// holds them, so no segment overlaps an image.
maybe_error image_prompt(const api_context& ctx, const std::string& text, std::span<const text_piece> pieces,
                         std::span<const pending_image> images, std::vector<token_id>& prompt, request& base) {
  std::vector<std::size_t> marks;
  for (std::size_t at = text.find(k_media_marker); at != std::string::npos;
       at = text.find(k_media_marker, at + k_media_marker.size()))
    marks.push_back(at);
  if (marks.size() != images.size())
    return bad_request("messages", fmt::format("the prompt holds {} image markers \"{}\" for {} images: the marker "
                                               "stands for an image part and may not appear in text",
                                               marks.size(), k_media_marker, images.size()));
  const auto n_kv = std::count_if(pieces.begin(), pieces.end(), [](const text_piece& p) { return p.kv.any(); });
  if (n_kv + static_cast<std::int64_t>(images.size()) > k_max_kv_parts)
    return bad_request("messages", fmt::format("{} parts of this request carry a KV policy or type or are images; at "
                                               "most {} may", n_kv + static_cast<std::int64_t>(images.size()),
                                               k_max_kv_parts));
  // The text between the markers, tokenized; the text alone must leave room
  // for the images (checked again with them, after encoding).
  std::vector<std::string> texts;
  std::vector<std::vector<token_id>> ids;
  std::size_t from = 0, n_text_tokens = 0;
  for (std::size_t i = 0; i <= marks.size(); ++i) {
    const std::size_t end = i < marks.size() ? marks[i] : text.size();
    texts.push_back(text.substr(from, end - from));
    ids.push_back(ctx.vocab->encode(texts.back(), i == 0 && ctx.vocab->add_bos_default(), /*parse_special=*/true));
    n_text_tokens += ids.back().size();
    from = end + k_media_marker.size();
  }
  if (static_cast<std::int64_t>(n_text_tokens) >= ctx.limits.max_model_len)
    return bad_request("messages", fmt::format("the text alone is {} tokens, more than the context ({}) holds with "
                                               "images", n_text_tokens, ctx.limits.max_model_len),
                       "context_length_exceeded");
  // Each text part goes to the piece of text it is found in (in order, as place_segments finds them).
  std::vector<std::vector<text_piece>> piece_of(texts.size());
  from = 0;
  for (const text_piece& p : pieces) {
    const std::size_t at = p.text.empty() ? from : text.find(p.text, from);
    if (at == std::string::npos) continue;  // place_segments names it below, in its piece
    from = at + p.text.size();
    const auto k = static_cast<std::size_t>(std::upper_bound(marks.begin(), marks.end(), at) - marks.begin());
    piece_of[k].push_back(p);
  }
  for (std::size_t i = 0; i < texts.size(); ++i) {
    if (i > 0) {
      const pending_image& img = images[i - 1];
      auto part = ctx.images->encode(img.bytes);
      if (!part.ok()) return from_status(part.error(), img.param + ".image_url.url");
      const auto offset = static_cast<std::int32_t>(prompt.size());
      prompt.insert(prompt.end(), part->tokens.begin(), part->tokens.end());
      for (image_span& s : part->spans) {
        s.begin += offset;
        s.kv_type = img.kv.type;
        s.kv_policy = img.kv.policy;
        base.images.push_back(std::move(s));
      }
    }
    const auto offset = static_cast<std::int32_t>(prompt.size());
    if (std::any_of(piece_of[i].begin(), piece_of[i].end(), [](const text_piece& p) { return p.kv.any(); })) {
      auto placed = place_segments(*ctx.vocab, i == 0 && ctx.vocab->add_bos_default(), texts[i], ids[i], piece_of[i]);
      if (!placed.ok()) return std::move(placed.error);
      for (prompt_segment& seg : *placed.value) {
        seg.begin += offset;
        seg.end += offset;
        base.segments.push_back(std::move(seg));
      }
    }
    prompt.insert(prompt.end(), ids[i].begin(), ids[i].end());
  }
  return {};
}

// prompt as parts of one prompt: [{"text": "...", "kv": {"policy": "...", "type": "..."}}, ...], concatenated.
maybe_error parse_prompt_parts(const json& parts, const api_context& ctx, std::size_t max_text_bytes,
                               std::vector<token_id>& ids, request& base) {
  if (parts.size() > static_cast<std::size_t>(k_max_kv_parts))
    return bad_request("prompt", fmt::format("the prompt has {} parts; at most {} are accepted (each may carry a KV "
                                             "policy or type)",
                                             parts.size(), k_max_kv_parts));
  std::string text;
  std::vector<text_piece> pieces;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const json& part = parts[i];
    const std::string name = fmt::format("prompt[{}]", i);
    if (!part.is_object()) return type_error(name, "an object {\"text\": ..., \"kv\": {...}} like the others", part);
    const auto t = part.find("text");
    if (t == part.end() || !t->is_string()) return bad_request(name + ".text", "a prompt part needs 'text' to be a string");
    text_piece piece{t->get<std::string>(), {}, name};
    PAGODA_API_TRY(read_kv_object(part, name, piece.kv));
    text += piece.text;
    pieces.push_back(std::move(piece));
  }
  if (text.size() > max_text_bytes) return bad_request("prompt", "the prompt is too long", "context_length_exceeded");
  ids = encode_text(ctx, text);
  return segments_of(ctx, text, ids, pieces, base);
}

maybe_error parse_prompts(const json& body, const api_context& ctx, std::vector<std::vector<token_id>>& out,
                          request& base) {
  const json* p = field(body, "prompt");
  if (!p) return bad_request("prompt", "'prompt' is required");
  auto token_list = [&](const json& arr, const std::string& name, std::vector<token_id>& ids) -> maybe_error {
    if (static_cast<std::int64_t>(arr.size()) > ctx.limits.max_prompt_tokens)
      return bad_request(name, fmt::format("the prompt is {} tokens, more than this server accepts ({})", arr.size(),
                                           ctx.limits.max_prompt_tokens),
                         "context_length_exceeded");
    for (std::size_t i = 0; i < arr.size(); ++i) {
      std::int64_t id = 0;
      PAGODA_API_TRY(read_int(arr[i], fmt::format("{}[{}]", name, i), 0, ctx.vocab->n_vocab() - 1, id));
      ids.push_back(static_cast<token_id>(id));
    }
    return {};
  };
  // Text longer than this many bytes has more tokens than any limit allows
  // only for absurd vocabularies; it bounds the tokenizer's work per request.
  const std::size_t max_text_bytes = static_cast<std::size_t>(ctx.limits.max_prompt_tokens) * 64 + 4096;
  auto text = [&](const json& s, const std::string& name, std::vector<token_id>& ids) -> maybe_error {
    const std::string& t = s.get_ref<const std::string&>();
    if (t.size() > max_text_bytes) return bad_request(name, "the prompt is too long", "context_length_exceeded");
    ids = encode_text(ctx, t);
    return {};
  };
  if (p->is_string()) {
    PAGODA_API_TRY(text(*p, "prompt", out.emplace_back()));
    return {};
  }
  if (!p->is_array()) return type_error("prompt", "a string, an array of token ids, or an array of those", *p);
  if (p->empty()) return bad_request("prompt", "'prompt' must not be an empty array");
  if ((*p)[0].is_number()) {
    PAGODA_API_TRY(token_list(*p, "prompt", out.emplace_back()));
    return {};
  }
  if ((*p)[0].is_object()) return parse_prompt_parts(*p, ctx, max_text_bytes, out.emplace_back(), base);
  if (static_cast<int>(p->size()) > ctx.limits.max_prompts)
    return bad_request("prompt", fmt::format("at most {} prompts per request, got {}", ctx.limits.max_prompts, p->size()));
  for (std::size_t i = 0; i < p->size(); ++i) {
    const json& e = (*p)[i];
    const std::string name = fmt::format("prompt[{}]", i);
    if (e.is_string()) PAGODA_API_TRY(text(e, name, out.emplace_back()));
    else if (e.is_array() && !e.empty()) PAGODA_API_TRY(token_list(e, name, out.emplace_back()));
    else return type_error(name, "a string or a non-empty array of token ids", e);
  }
  return {};
}

// An image_url content part, decoded to its file's bytes (the URL checked,
// base64 decoded, the size limit applied; the image itself is decoded when
// encoded). Its KV type and policy are its own `kv`'s only: the message's
// `kv` and kv_policy_by_role apply to text, and an image without its own
// follows the server's --kv-image-type / --kv-image-policy.
maybe_error read_image_part(const json& part, const std::string& pname, const api_context& ctx,
                            std::vector<pending_image>& images) {
  if (!ctx.images)
    return bad_request(pname + ".type", "content parts of type \"image_url\" need a vision projector: this server was "
                                        "started without --mmproj, so it takes text only");
  const auto iu = part.find("image_url");
  const std::string uname = pname + ".image_url.url";
  const json* url = nullptr;
  if (iu != part.end() && iu->is_string()) url = &*iu;  // a bare URL, as some clients send it
  else if (iu != part.end() && iu->is_object() && iu->contains("url")) url = &(*iu)["url"];
  if (!url || !url->is_string())
    return bad_request(uname, "an image_url part needs \"image_url\": {\"url\": \"data:image/png;base64,...\"}");
  const int most = ctx.images->options().max_images;
  if (static_cast<int>(images.size()) >= most) {
    ctx.images->count_refused();
    return bad_request(pname, fmt::format("more than {} images in one request; this server takes at most {} "
                                          "(--max-images-per-request)", most, most));
  }
  auto bytes = vision::image_url_bytes(url->get_ref<const std::string&>(), ctx.images->options().limits);
  if (!bytes.ok()) {
    ctx.images->count_refused();
    return bad_request(uname, bytes.error().message());
  }
  pending_image img{std::move(*bytes), {}, pname};
  PAGODA_API_TRY(read_kv_object(part, pname, img.kv));
  if (img.kv.reuse_chunk)
    return bad_request(pname + ".kv.reuse", "an image part cannot be reused as a chunk; its KV is prefix-cached by "
                                            "the image's content already");
  images.push_back(std::move(img));
  return {};
}

// messages[i].content: a string, or an array of {"type": "text", "text": ...} parts (joined by newlines).
// Each part (or the whole string) is a piece of text with the message's KV
// policy, or its own (`kv`).
maybe_error parse_content(const json& c, const std::string& name, std::string& out, const kv_choice& kv,
                          std::vector<text_piece>& pieces, const api_context& ctx, std::vector<pending_image>& images) {
  if (c.is_string()) {
    out = c.get<std::string>();
    pieces.push_back({out, kv, name});
    return {};
  }
  if (!c.is_array()) return type_error(name, "a string or an array of content parts", c);
  for (std::size_t j = 0; j < c.size(); ++j) {
    const json& part = c[j];
    const std::string pname = fmt::format("{}[{}]", name, j);
    if (!part.is_object()) return type_error(pname, "an object", part);
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) return bad_request(pname + ".type", "a content part needs a 'type'");
    if (*type == "image_url") {
      PAGODA_API_TRY(read_image_part(part, pname, ctx, images));
      if (!out.empty()) out += '\n';
      out += k_media_marker;
      continue;
    }
    if (*type != "text")
      return bad_request(pname + ".type",
                         fmt::format("content parts of type {} are not supported; this model takes text{}",
                                     excerpt(*type), ctx.images ? " and image_url" : ""));
    auto t = part.find("text");
    if (t == part.end() || !t->is_string())
      return bad_request(pname + ".text", "a text part needs 'text' to be a string");
    if (!out.empty()) out += '\n';
    out += t->get<std::string>();
    text_piece piece{t->get<std::string>(), kv, pname};
    PAGODA_API_TRY(read_kv_object(part, pname, piece.kv));
    pieces.push_back(std::move(piece));
  }
  return {};
}

// kv_policy_by_role: {"system": "none", "user": "snapkv:budget=0.25", ...}.
maybe_error read_policies_by_role(const json& body, std::map<std::string, std::string>& out) {
  const json* m = field(body, "kv_policy_by_role");
  if (!m) return {};
  if (!m->is_object()) return type_error("kv_policy_by_role", "an object of role -> KV policy", *m);
  for (const auto& [role, value] : m->items()) {
    const std::string name = "kv_policy_by_role." + role;
    if (role != "system" && role != "developer" && role != "user" && role != "assistant")
      return bad_request(name, fmt::format("role '{}' is not one of system, developer, user, assistant", role));
    if (!value.is_string()) return type_error(name, "a string", value);
    auto spec = parse_kv_policy_spec(value.get<std::string>());
    if (!spec.ok()) return bad_request(name, spec.error().message());
    if (status st = check_kv_policy(*spec); !st.ok()) return bad_request(name, st.message());
    out[role == "developer" ? "system" : role] = value.get<std::string>();
  }
  return {};
}

maybe_error parse_messages(const json& body, const api_context& ctx, std::vector<chat_message>& out,
                           std::vector<text_piece>& pieces, std::vector<pending_image>& images) {
  std::map<std::string, std::string> by_role;
  PAGODA_API_TRY(read_policies_by_role(body, by_role));
  const json* m = field(body, "messages");
  if (!m) return bad_request("messages", "'messages' is required");
  if (!m->is_array()) return type_error("messages", "an array", *m);
  if (m->empty()) return bad_request("messages", "'messages' must hold at least one message");
  const std::size_t max_bytes = static_cast<std::size_t>(ctx.limits.max_prompt_tokens) * 64 + 4096;
  std::size_t total_bytes = 0;
  for (std::size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string name = fmt::format("messages[{}]", i);
    if (!msg.is_object()) return type_error(name, "an object", msg);
    auto role = msg.find("role");
    if (role == msg.end() || !role->is_string()) return bad_request(name + ".role", "each message needs a 'role' string");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      return bad_request(name + ".role",
                         fmt::format("role {} is not supported (system, developer, user, assistant, tool)", excerpt(*role)));
    if (r == "tool" && !chat_format_has_tools(ctx.chat))
      return bad_request(name + ".role", fmt::format("this model's chat template ({}) has no tool format, so no "
                                                     "tool messages (--chat-template chatml, qwen3, llama3 or mistral)",
                                                     chat_format_name(ctx.chat)));
    chat_message cm{r, {}, {}, {}};
    kv_choice kv{by_role.contains(r) ? by_role[r] : std::string(), ""};
    PAGODA_API_TRY(read_kv_object(msg, name, kv));
    auto content = msg.find("content");
    if (content != msg.end() && !content->is_null())
      PAGODA_API_TRY(parse_content(*content, name + ".content", cm.content, kv, pieces, ctx, images));
    else if (r != "assistant") return bad_request(name + ".content", "'content' is required");
    PAGODA_API_TRY(read_message_tools(msg, name, ctx.chat, cm));
    total_bytes += cm.content.size();
    for (const chat_tool_call& c : cm.tool_calls) total_bytes += c.arguments.size() + c.name.size();
    if (total_bytes > max_bytes) return bad_request("messages", "the messages are too long", "context_length_exceeded");
    out.push_back(std::move(cm));
  }
  return {};
}

// tool_choice required or named: the calls' grammar constrains the output.
maybe_error force_tool_calls(const tool_request& tools, request& base) {
  if (!tools.forced()) return {};
  if (!base.sampling.grammar.empty())
    return bad_request("tool_choice", "'tool_choice' forces a tool call, and a structured-output field (response_format, "
                                      "guided_*, grammar, json_schema) constrains the output too; give one of them");
  std::string field = "tools";
  auto g = tool_call_grammar(tools, &field);
  if (!g.ok()) return bad_request(field, g.error().message());
  base.sampling.grammar = std::move(*g);
  return {};
}

}  // namespace

bool has_image_parts(const json& body) {
  const json* m = body.is_object() ? field(body, "messages") : nullptr;
  if (!m || !m->is_array()) return false;
  for (const json& msg : *m) {
    if (!msg.is_object()) continue;
    const auto c = msg.find("content");
    if (c == msg.end() || !c->is_array()) continue;
    for (const json& part : *c)
      if (part.is_object() && part.contains("type") && part["type"] == "image_url") return true;
  }
  return false;
}

api_result<api_call> parse_request(api_kind kind, const json& body, const api_context& ctx, const std::string& tenant) {
  if (!body.is_object()) return bad_request("", "the request body must be a JSON object");
  api_call call;
  call.kind = kind;
  request base;
  PAGODA_API_TRY(parse_common(body, ctx, kind, tenant, call, base));
  PAGODA_API_TRY(read_scoring(body, ctx, kind, call, base));
  std::vector<std::vector<token_id>> prompts;
  if (kind == api_kind::completion) {
    PAGODA_API_TRY(parse_prompts(body, ctx, prompts, base));
  } else {
    std::vector<chat_message> messages;
    std::vector<text_piece> pieces;
    std::vector<pending_image> images;
    auto tools = std::make_shared<tool_request>();
    PAGODA_API_TRY(read_tools(body, ctx.chat, *tools));
    PAGODA_API_TRY(parse_messages(body, ctx, messages, pieces, images));
    bool add_generation_prompt = true;  // vLLM's extension
    PAGODA_API_TRY(read_bool(body, "add_generation_prompt", add_generation_prompt));
    PAGODA_API_TRY(force_tool_calls(*tools, base));
    if (tools->active()) call.tools = tools;
    auto text = render_chat(ctx.chat, messages, ctx.chat_tokens, add_generation_prompt, prompt_tools(*tools));
    if (!text.ok()) return from_status(text.error(), "messages");
    if (images.empty()) {
      prompts.push_back(encode_text(ctx, *text));
      PAGODA_API_TRY(segments_of(ctx, *text, prompts.back(), pieces, base));
    } else {
      PAGODA_API_TRY(image_prompt(ctx, *text, pieces, images, prompts.emplace_back(), base));
    }
  }
  PAGODA_API_TRY(finish_requests(body, ctx, kind, std::move(prompts), base, call));
  if (call.echo) call.echo_texts = echo_texts(body, ctx, call.requests);
  return call;
}

}  // namespace pagoda::server
