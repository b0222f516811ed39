// llama.cpp's server endpoints in its JSON shapes (its tools/server README),
// for the tools and web UIs written against llama-server:
//
//   GET /props  {"default_generation_settings": {"id", "id_task", "n_ctx",
//                "is_processing", "params": {...}}, "total_slots",
//                "model_alias", "model_path", "chat_template", "bos_token",
//                "eos_token", "build_info", "modalities", "is_sleeping", ...}
//               params: what a request that sets nothing gets here (vLLM's
//               defaults: temperature 1, top_p 1, top_k and min_p off, a
//               fresh seed, shown as llama.cpp's 4294967295 "random").
//   GET /slots  one entry per sequence holding KV now (llama.cpp lists its
//               idle slots too; here a slot is a running sequence): "id" (the
//               sequence), "id_task" (the request id), "n_ctx",
//               "is_processing", "speculative", "n_prompt_tokens",
//               "n_prompt_tokens_processed", "n_prompt_tokens_cache",
//               "params", "next_token": {"has_next_token", "n_remain",
//               "n_decoded"}, and Pagoda's "kv": {"blocks", "tokens_cached",
//               "policy", "loading"}. No prompt text: another client's prompt
//               is not this one's to read.
//               ?fail_on_no_slot=1: 503 when every sequence slot is taken.
//
// Both need an API key when keys are configured; /slots shows a tenant's key
// its own tenant's sequences only (the admin key: all).
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "sched/engine_loop.h"
#include "server/openai_request.h"

namespace pagoda::server {

nlohmann::json props_json(const api_context& ctx, const engine_snapshot& snap, const std::string& version);

// tenant: only that tenant's sequences; nullopt: all.
nlohmann::json slots_json(const api_context& ctx, const engine_snapshot& snap, const std::optional<std::string>& tenant);

}  // namespace pagoda::server
