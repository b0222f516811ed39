#include "server/openai_response.h"

#include "store/warehouse.h"

namespace pagoda::server {

using nlohmann::json;

response_builder::response_builder(const api_call& call, std::string id, std::string model, std::int64_t created_unix_s,
                                   const tokenizer& vocab)
    : kind_(call.kind),
      n_(call.n),
      include_usage_(call.include_usage),
      want_logprobs_(call.logprobs >= 0),
      tokens_as_ids_(call.tokens_as_ids),
      echo_(call.echo),
      logprobs_(call.logprobs),
      prompt_logprobs_(call.prompt_logprobs),
      echo_texts_(call.echo_texts),
      prompts_(call.requests.size()),
      id_(std::move(id)),
      model_(std::move(model)),
      tools_(call.tools),
      created_(created_unix_s),
      vocab_(vocab),
      choices_(call.requests.size() * static_cast<std::size_t>(call.n)) {
  echo_texts_.resize(call.requests.size());
  // Only prompts whose tokens are scored keep them (prompt_scores::complete).
  if ((echo_ && logprobs_ >= 0) || prompt_logprobs_ >= 0)
    for (std::size_t i = 0; i < call.requests.size(); ++i) prompts_[i].tokens = call.requests[i].prompt;
}

std::string response_builder::piece(token_id t) const {
  if (tokens_as_ids_) return fmt::format("token_id:{}", t);
  return vocab_.token_to_piece(t, /*render_special=*/true);
}

void response_builder::add(int prompt_index, const engine_event& e) {
  const std::size_t c = static_cast<std::size_t>(prompt_index) * n_ + e.index;
  if (c >= choices_.size()) return;
  choice& ch = choices_[c];
  if (!e.prompt_logprobs.empty()) {
    // Completion 0 scores the prompt for its n choices; the engine sends each token once, in order.
    std::vector<token_logprob>& scores = prompts_[static_cast<std::size_t>(prompt_index)].scores;
    if (static_cast<std::size_t>(e.first_prompt_logprob) == scores.size() + 1)
      scores.insert(scores.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
  }
  ch.text += e.text;
  ch.logprobs.insert(ch.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
  if (!e.finish_reason.empty()) ch.finish_reason = e.finish_reason;
  if (e.request_finished) {
    usage_.prompt_tokens += e.usage.prompt_tokens;
    usage_.completion_tokens += e.usage.completion_tokens;
    usage_.cached_tokens += e.usage.cached_tokens;
    usage_.reused_chunk_tokens += e.usage.reused_chunk_tokens;
    usage_.image_tokens += e.usage.image_tokens;
    usage_.cached_image_tokens += e.usage.cached_image_tokens;
    usage_.kv_tokens_seen += e.usage.kv_tokens_seen;
    usage_.kv_tokens_kept += e.usage.kv_tokens_kept;
    usage_.kv_prompt_tokens_visible += e.usage.kv_prompt_tokens_visible;
    usage_.kv_prompt_tokens_read += e.usage.kv_prompt_tokens_read;
    usage_.kv_decode_tokens_visible += e.usage.kv_decode_tokens_visible;
    usage_.kv_decode_tokens_read += e.usage.kv_decode_tokens_read;
    std::vector<int>& by_tier = usage_.loaded_tokens_by_tier;
    if (by_tier.size() < e.usage.loaded_tokens_by_tier.size()) by_tier.resize(e.usage.loaded_tokens_by_tier.size(), 0);
    for (std::size_t t = 0; t < e.usage.loaded_tokens_by_tier.size(); ++t) by_tier[t] += e.usage.loaded_tokens_by_tier[t];
  }
}

json response_builder::usage_json() const {
  json u = {{"prompt_tokens", usage_.prompt_tokens},
            {"completion_tokens", usage_.completion_tokens},
            {"total_tokens", usage_.prompt_tokens + usage_.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", usage_.cached_tokens}}}};
  // Pagoda's: prompt tokens whose KV came from reused chunks (apart from the prefix cache's).
  if (usage_.reused_chunk_tokens > 0) u["prompt_tokens_details"]["reused_chunk_tokens"] = usage_.reused_chunk_tokens;
  // Pagoda's, with images: the prompt tokens that are images' rows (part of
  // prompt_tokens) and of them those served from the prefix cache (part of cached_tokens).
  if (usage_.image_tokens > 0) {
    u["prompt_tokens_details"]["image_tokens"] = usage_.image_tokens;
    u["prompt_tokens_details"]["cached_image_tokens"] = usage_.cached_image_tokens;
  }
  // Pagoda's, with an evicting KV policy: the tokens the completions computed
  // and how many of them their KV keeps (docs/policies.md, "Exact budgets").
  if (usage_.kv_tokens_seen > 0) {
    u["kv_tokens_seen"] = usage_.kv_tokens_seen;
    u["kv_tokens_kept"] = usage_.kv_tokens_kept;
  }
  // Pagoda's, with a sparse-read KV policy (quest, retrieval): the fraction of
  // the KV its attention could see that it read, per phase (docs/policies.md).
  if (usage_.kv_prompt_tokens_read < usage_.kv_prompt_tokens_visible ||
      usage_.kv_decode_tokens_read < usage_.kv_decode_tokens_visible) {
    const auto fraction = [](std::int64_t read, std::int64_t visible) {
      return visible > 0 ? static_cast<double>(read) / static_cast<double>(visible) : 1.0;
    };
    u["kv_read"] = {{"prompt_fraction", fraction(usage_.kv_prompt_tokens_read, usage_.kv_prompt_tokens_visible)},
                    {"decode_fraction", fraction(usage_.kv_decode_tokens_read, usage_.kv_decode_tokens_visible)}};
  }
  if (!store_tiers_.empty()) {
    // An extension field (OpenAI clients ignore it): where the cached tokens came from.
    json by_tier = json::object();
    for (const auto& [tier, n] : cached_tokens_by_tier(usage_, store_tiers_)) by_tier[tier] = n;
    u["prompt_tokens_details"]["cached_tokens_by_tier"] = by_tier;
  }
  return u;
}

json response_builder::logprobs_json(const std::vector<token_logprob>& lps, std::size_t& offset) const {
  if (kind_ == api_kind::completion) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
    for (const token_logprob& lp : lps) {
      std::string p = piece(lp.token);
      tokens.push_back(p);
      token_logprobs.push_back(lp.logprob);
      json alts = json::object();
      for (const auto& [t, l] : lp.top) alts[piece(t)] = l;
      top.push_back(std::move(alts));
      offsets.push_back(offset);
      // The offset counts the text's bytes, whatever names the token.
      offset += tokens_as_ids_ ? vocab_.token_to_piece(lp.token, /*render_special=*/true).size() : p.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
  }
  auto entry = [&](token_id t, float l) {
    std::string p = piece(t);
    json bytes = json::array();
    for (unsigned char b : p) bytes.push_back(b);
    return json{{"token", p}, {"logprob", l}, {"bytes", bytes}};
  };
  json content = json::array();
  for (const token_logprob& lp : lps) {
    json e = entry(lp.token, lp.logprob);
    json alts = json::array();
    for (const auto& [t, l] : lp.top) alts.push_back(entry(t, l));
    e["top_logprobs"] = std::move(alts);
    content.push_back(std::move(e));
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json response_builder::echo_logprobs_json(int prompt_index, std::size_t& offset) const {
  const prompt_scores& p = prompts_[static_cast<std::size_t>(prompt_index)];
  std::vector<token_logprob> lps;
  for (std::size_t i = 1; i < p.tokens.size(); ++i) {
    token_logprob lp = i <= p.scores.size() ? p.scores[i - 1] : token_logprob{p.tokens[i], 0.0f, {}};
    if (lp.top.size() > static_cast<std::size_t>(logprobs_)) lp.top.resize(static_cast<std::size_t>(logprobs_));
    lps.push_back(std::move(lp));
  }
  if (p.tokens.empty()) return logprobs_json({}, offset);
  // The first prompt token has no logprob (nothing before it): null, as vLLM sends it.
  json j = logprobs_json({token_logprob{p.tokens[0], 0.0f, {}}}, offset);
  j["token_logprobs"][0] = nullptr;
  j["top_logprobs"][0] = nullptr;
  const json rest = logprobs_json(lps, offset);
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const json& v : rest[key]) j[key].push_back(v);
  // An entry the engine never sent (the request failed part way) is null too.
  for (std::size_t i = p.scores.size() + 1; i < p.tokens.size(); ++i) {
    j["token_logprobs"][i] = nullptr;
    j["top_logprobs"][i] = nullptr;
  }
  return j;
}

json response_builder::prompt_logprobs_json(int prompt_index) const {
  const prompt_scores& p = prompts_[static_cast<std::size_t>(prompt_index)];
  json out = json::array({nullptr});
  for (const token_logprob& lp : p.scores) {
    // The prompt's token with its rank, then the k most likely (ranks 1 .. k).
    json e = json::object();
    e[std::to_string(lp.token)] = {{"logprob", lp.logprob}, {"rank", lp.rank}, {"decoded_token", piece(lp.token)}};
    const std::size_t k = std::min(lp.top.size(), static_cast<std::size_t>(prompt_logprobs_));
    for (std::size_t r = 0; r < k; ++r) {
      const std::string id = std::to_string(lp.top[r].first);
      if (!e.contains(id))
        e[id] = {{"logprob", lp.top[r].second}, {"rank", r + 1}, {"decoded_token", piece(lp.top[r].first)}};
    }
    out.push_back(std::move(e));
  }
  return out;
}

json response_builder::body() const {
  json choices = json::array();
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    const choice& ch = choices_[i];
    std::size_t offset = 0;
    json reason = ch.finish_reason.empty() ? json(nullptr) : json(ch.finish_reason);
    if (kind_ == api_kind::completion) {
      const int p = static_cast<int>(i / static_cast<std::size_t>(n_));
      json lp = nullptr;
      if (want_logprobs_) {
        lp = echo_ ? echo_logprobs_json(p, offset) : logprobs_json({}, offset);
        const json gen = logprobs_json(ch.logprobs, offset);
        for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
          for (const json& v : gen[key]) lp[key].push_back(v);
      }
      const std::string& echoed = echo_ ? echo_texts_[static_cast<std::size_t>(p)] : std::string();
      json c = {{"index", i}, {"text", echoed + ch.text}, {"logprobs", lp}, {"finish_reason", reason}};
      if (prompt_logprobs_ >= 0) c["prompt_logprobs"] = prompt_logprobs_json(p);
      choices.push_back(std::move(c));
    } else {
      json lp = want_logprobs_ ? logprobs_json(ch.logprobs, offset) : json(nullptr);
      choices.push_back({{"index", i},
                         {"message", {{"role", "assistant"}, {"content", ch.text}}},
                         {"logprobs", lp},
                         {"finish_reason", reason}});
    }
  }
  if (tools_)
    for (std::size_t i = 0; i < choices_.size(); ++i) apply_tool_calls(i, choices_[i], choices[i]);
  return {{"id", id_},
          {"object", kind_ == api_kind::completion ? "text_completion" : "chat.completion"},
          {"created", created_},
          {"model", model_},
          {"choices", choices},
          {"system_fingerprint", nullptr},
          {"usage", usage_json()}};
}

void response_builder::apply_tool_calls(std::size_t i, const choice& ch, json& out) const {
  const parsed_tool_output p = parse_tool_output(*tools_, ch.text);
  if (!p.called) return;
  json calls = json::array();
  for (std::size_t k = 0; k < p.calls.size(); ++k)
    calls.push_back({{"id", tool_call_id(tools_->format, id_, i, k)},
                     {"type", "function"},
                     {"function", {{"name", p.calls[k].name}, {"arguments", p.calls[k].arguments}}}});
  out["message"]["content"] = p.content.empty() ? json(nullptr) : json(p.content);
  out["message"]["tool_calls"] = std::move(calls);
  out["finish_reason"] = tool_finish_reason(*tools_, true, ch.finish_reason);
}

void response_builder::tool_chunks(std::size_t c, const engine_event& e, json logprobs, std::vector<json>& out) {
  choice& ch = choices_[c];
  if (!ch.tool_stream) ch.tool_stream.emplace(tools_);
  std::vector<tool_delta> deltas;
  ch.tool_stream->feed(e.text, deltas);
  json reason = nullptr;
  if (!e.finish_reason.empty()) reason = tool_finish_reason(*tools_, ch.tool_stream->finish(deltas), e.finish_reason);
  std::vector<json> ds;
  for (const tool_delta& d : deltas) {
    if (!d.is_call) {
      ds.push_back({{"content", d.text}});
      continue;
    }
    json call = {{"index", d.index}};
    if (!d.name.empty()) {
      call["id"] = tool_call_id(tools_->format, id_, c, d.index);
      call["type"] = "function";
      call["function"] = {{"name", d.name}, {"arguments", d.text}};
    } else {
      call["function"] = {{"arguments", d.text}};
    }
    ds.push_back({{"tool_calls", json::array({std::move(call)})}});
  }
  if (ds.empty() && logprobs.is_null() && reason.is_null()) return;
  if (ds.empty()) ds.push_back(json::object());
  // Logprobs ride on the event's first chunk, the finish reason on its last.
  for (std::size_t k = 0; k < ds.size(); ++k) {
    json j = chunk_base();
    j["choices"] = json::array({{{"index", c},
                                 {"delta", std::move(ds[k])},
                                 {"logprobs", k == 0 ? logprobs : json(nullptr)},
                                 {"finish_reason", k + 1 == ds.size() ? reason : json(nullptr)}}});
    out.push_back(std::move(j));
  }
}

json response_builder::chunk_base() const {
  json j = {{"id", id_},
            {"object", kind_ == api_kind::completion ? "text_completion" : "chat.completion.chunk"},
            {"created", created_},
            {"model", model_},
            {"system_fingerprint", nullptr}};
  if (include_usage_) j["usage"] = nullptr;  // OpenAI: null on every chunk but the last
  return j;
}

std::vector<json> response_builder::opening_chunks() const {
  std::vector<json> out;
  if (kind_ != api_kind::chat) return out;
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    json j = chunk_base();
    j["choices"] = json::array(
        {{{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
    out.push_back(std::move(j));
  }
  return out;
}

void response_builder::echo_chunk(std::size_t c, std::vector<json>& out) {
  const std::size_t p = c / static_cast<std::size_t>(n_);
  choices_[c].echoed = true;
  json lp = want_logprobs_ && echo_ ? echo_logprobs_json(static_cast<int>(p), choices_[c].logprob_text_offset)
                                    : json(nullptr);
  json ch = {{"index", c}, {"text", echo_ ? echo_texts_[p] : std::string()}, {"logprobs", lp}, {"finish_reason", nullptr}};
  if (prompt_logprobs_ >= 0) ch["prompt_logprobs"] = prompt_logprobs_json(static_cast<int>(p));
  json j = chunk_base();
  j["choices"] = json::array({std::move(ch)});
  out.push_back(std::move(j));
}

void response_builder::chunks_for(int prompt_index, const engine_event& e, std::vector<json>& out) {
  const std::size_t c = static_cast<std::size_t>(prompt_index) * n_ + e.index;
  if (c >= choices_.size()) return;
  // Echo, prompt_logprobs: the prompt's chunk first, once its scores are in
  // (they are before the first token is: the prompt's last row samples it).
  if (kind_ == api_kind::completion && (echo_ || prompt_logprobs_ >= 0) && !choices_[c].echoed) {
    if (!prompts_[static_cast<std::size_t>(prompt_index)].complete() && e.finish_reason.empty()) return;
    echo_chunk(c, out);
  }
  const bool has_lp = want_logprobs_ && !e.logprobs.empty();
  if (e.text.empty() && !has_lp && e.finish_reason.empty()) return;
  json lp = has_lp ? logprobs_json(e.logprobs, choices_[c].logprob_text_offset) : json(nullptr);
  json reason = e.finish_reason.empty() ? json(nullptr) : json(e.finish_reason);
  json j = chunk_base();
  if (kind_ == api_kind::completion) {
    j["choices"] = json::array({{{"index", c}, {"text", e.text}, {"logprobs", lp}, {"finish_reason", reason}}});
  } else if (tools_) {
    return tool_chunks(c, e, std::move(lp), out);
  } else {
    json delta = e.text.empty() && !has_lp ? json::object() : json{{"content", e.text}};
    j["choices"] = json::array({{{"index", c}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", reason}}});
  }
  out.push_back(std::move(j));
}

json response_builder::usage_chunk() const {
  json j = chunk_base();
  j["choices"] = json::array();
  j["usage"] = usage_json();
  return j;
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

}  // namespace pagoda::server
