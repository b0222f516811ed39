#include "server/api_setup.h"

#include "policy/streaming.h"

#include <filesystem>

namespace pagoda::server {

result<chat_format> choose_chat_format(const llama_model& model, const std::string& override_name, std::string* warning) {
  return choose_chat_format(model.gguf(), override_name, warning);
}

result<chat_format> choose_chat_format(const gguf::file& file, const std::string& override_name, std::string* warning) {
  if (!override_name.empty()) {
    if (auto f = chat_format_from_name(override_name)) return *f;
    std::string names;
    for (chat_format f : all_chat_formats()) names += std::string(names.empty() ? "" : ", ") + chat_format_name(f);
    return error(errc::invalid_argument, "--chat-template '{}': unknown; expected one of {}", override_name, names);
  }
  auto jinja = file.get_string("tokenizer.chat_template");
  if (!jinja.ok()) return chat_format::plain;
  if (auto f = detect_chat_format(*jinja)) return *f;
  if (warning)
    *warning = "the model's chat template matches no known family; chat messages are joined plainly "
               "(pass --chat-template NAME)";
  return chat_format::plain;
}

result<api_context> make_api_context(const llama_model& model, int max_model_len, const api_options& o,
                                     std::string* warning) {
  return make_api_context(model.gguf(), model.vocab(), max_model_len, o, warning);
}

result<api_context> make_api_context(const gguf::file& file, const tokenizer& vocab, int max_model_len,
                                     const api_options& o, std::string* warning) {
  if (max_model_len < 2) return error(errc::invalid_argument, "a context of {} tokens is too small to serve", max_model_len);
  api_context ctx;
  ctx.vocab = &vocab;
  PAGODA_ASSIGN_OR_RETURN(ctx.chat, choose_chat_format(file, o.chat_template, warning));
  if (vocab.bos() != k_no_token) ctx.chat_tokens.bos = std::string(vocab.token_text(vocab.bos()));
  if (vocab.eos() != k_no_token) ctx.chat_tokens.eos = std::string(vocab.token_text(vocab.eos()));
  const std::string stem = std::filesystem::path(o.model_path).stem().string();
  ctx.model_names = {o.served_model_name.empty() ? stem : o.served_model_name};
  for (const std::string& alias : {o.model_path, stem})
    if (!alias.empty() && alias != ctx.model_names.front()) ctx.model_names.push_back(alias);
  ctx.model_path = o.model_path;
  if (auto jinja = file.get_string("tokenizer.chat_template"); jinja.ok()) ctx.chat_template_source = std::string(*jinja);
  ctx.limits.max_model_len = max_model_len;
  ctx.limits.max_prompt_tokens = o.max_prompt_tokens > 0 ? std::min(o.max_prompt_tokens, max_model_len - 1) : max_model_len - 1;
  ctx.limits.max_tokens = o.max_tokens_limit > 0 ? std::min(o.max_tokens_limit, max_model_len - 1) : max_model_len - 1;
  ctx.limits.max_streaming_tokens = o.max_tokens_limit > 0 ? o.max_tokens_limit : k_max_streaming_tokens;
  ctx.default_kv_policy = o.default_kv_policy;
  ctx.limits.max_choices = o.max_n;
  ctx.limits.max_tokenize_tokens = o.max_tokenize_tokens > 0 ? o.max_tokenize_tokens : std::max(65536, max_model_len);
  for (token_id t = 0; t < vocab.n_vocab(); ++t) ctx.max_token_bytes = std::max(ctx.max_token_bytes, vocab.token_text(t).size());
  return ctx;
}

}  // namespace pagoda::server
