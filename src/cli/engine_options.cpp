#include "cli/engine_options.h"

#include <charconv>

namespace pagoda::cli {

void add_engine_options(CLI::App* app, engine_options& opts) {
  add_model_options(app, opts.model);
  add_kv_options(app, opts.kv);
  app->add_option("--max-num-seqs", opts.max_num_seqs, "sequences running at once")->check(CLI::Range(1, 65536));
  app->add_option("--max-num-batched-tokens", opts.max_num_batched_tokens, "tokens per engine step")
      ->check(CLI::Range(1, 1 << 20));
  app->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", opts.enable_prefix_caching,
                "reuse cached KV blocks of shared prompt prefixes (default on)");
  app->add_option("--tenant-quota", opts.tenant_quotas, "NAME=BLOCKS: cap a tenant's KV blocks (repeatable)");
}

result<engine_config> make_engine_config(const llama_model& model, const engine_options& opts) {
  engine_config cfg;
  cfg.n_threads = opts.model.threads;
  cfg.max_model_len = context_length(opts.model, model.hparams());
  cfg.max_num_seqs = opts.max_num_seqs;
  cfg.max_num_batched_tokens = opts.max_num_batched_tokens;
  cfg.enable_prefix_caching = opts.enable_prefix_caching;
  PAGODA_ASSIGN_OR_RETURN(cfg.kv, make_kv_layout(model, opts.kv));
  const double k_default_cap_bytes = 4.0 * 1024 * 1024 * 1024;
  std::int64_t default_tokens = static_cast<std::int64_t>(opts.max_num_seqs) * cfg.max_model_len;
  default_tokens = std::min<std::int64_t>(default_tokens,
                                          static_cast<std::int64_t>(k_default_cap_bytes / cfg.kv.bytes_per_token()));
  PAGODA_ASSIGN_OR_RETURN(cfg.n_blocks, pool_blocks(cfg.kv, opts.kv, default_tokens));
  for (const std::string& q : opts.tenant_quotas) {
    std::size_t eq = q.rfind('=');
    std::int32_t blocks = 0;
    if (eq == std::string::npos || eq == 0 ||
        std::from_chars(q.data() + eq + 1, q.data() + q.size(), blocks).ec != std::errc() || blocks < 0)
      return error(errc::invalid_argument, "--tenant-quota '{}': expected NAME=BLOCKS", q);
    cfg.tenant_quota_blocks[q.substr(0, eq)] = blocks;
  }
  return cfg;
}

}  // namespace pagoda::cli
