#include "server/llama_api.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

// llama.cpp's seed meaning "a fresh one each request".
constexpr std::uint64_t k_random_seed = 4294967295u;

json params_json(const sampling_params& p, int max_tokens, bool ignore_eos, std::uint64_t seed) {
  return {{"n_predict", max_tokens},
          {"max_tokens", max_tokens},
          {"seed", seed},
          {"temperature", p.temperature},
          {"top_k", p.top_k},
          {"top_p", p.top_p},
          {"min_p", p.min_p},
          {"repeat_penalty", p.repetition_penalty},
          {"presence_penalty", p.presence_penalty},
          {"frequency_penalty", p.frequency_penalty},
          {"ignore_eos", ignore_eos},
          {"n_probs", 0},
          {"samplers", {"penalties", "top_k", "top_p", "min_p", "temperature"}}};
}

}  // namespace

json props_json(const api_context& ctx, const engine_snapshot& snap, const std::string& version) {
  sampling_params defaults;  // as parse_request fills a request that sets nothing
  defaults.temperature = 1.0f;
  defaults.top_p = 1.0f;
  defaults.top_k = 0;
  defaults.min_p = 0.0f;
  json settings = {{"id", 0},
                   {"id_task", -1},
                   {"n_ctx", ctx.limits.max_model_len},
                   {"speculative", false},
                   {"is_processing", false},
                   {"params", params_json(defaults, -1, false, k_random_seed)}};
  return {{"default_generation_settings", std::move(settings)},
          {"total_slots", snap.max_num_seqs},
          {"model_alias", ctx.model_names.front()},
          {"model_path", ctx.model_path},
          {"chat_template", ctx.chat_template_source},
          {"chat_format", chat_format_name(ctx.chat)},
          {"bos_token", ctx.chat_tokens.bos},
          {"eos_token", ctx.chat_tokens.eos},
          {"modalities", {{"vision", false}, {"audio", false}}},
          {"endpoint_slots", true},
          {"endpoint_props", true},
          {"endpoint_metrics", true},
          {"build_info", "pagoda " + version},
          {"is_sleeping", false}};
}

json slots_json(const api_context& ctx, const engine_snapshot& snap, const std::optional<std::string>& tenant) {
  json out = json::array();
  for (const running_sequence& s : snap.sequences) {
    if (tenant && s.tenant != *tenant) continue;
    const int n_remain = std::max(0, s.max_tokens - s.n_generated);
    // As llama.cpp counts them: the prompt tokens found cached, and those computed here.
    const int n_cache = std::max(0, s.n_cached_prompt);
    const int n_processed = std::max(0, std::min(s.n_computed, s.n_prompt) - n_cache);
    out.push_back({{"id", s.seq},
                   {"id_task", s.request_id},
                   {"n_ctx", ctx.limits.max_model_len},
                   {"speculative", s.speculative},
                   {"is_processing", true},
                   {"n_prompt_tokens", s.n_prompt},
                   {"n_prompt_tokens_processed", n_processed},
                   {"n_prompt_tokens_cache", n_cache},
                   {"params", params_json(s.sampling, s.max_tokens, s.ignore_eos, s.sampling.seed)},
                   {"next_token", {{"has_next_token", n_remain > 0}, {"n_remain", n_remain}, {"n_decoded", s.n_generated}}},
                   {"kv",
                    {{"blocks", s.n_blocks},
                     {"tokens_cached", s.n_stored_tokens},
                     {"policy", s.kv_policy.empty() ? "default" : s.kv_policy},
                     {"loading", s.loading}}}});
  }
  return out;
}

}  // namespace pagoda::server
