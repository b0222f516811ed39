#include "cli/engine_options.h"

namespace pagoda::cli {

void add_engine_options(CLI::App* app, engine_options& opts) {
  add_model_options(app, opts.config);
  add_kv_options(app, opts.config);
  app->add_option("--max-num-seqs", opts.config.max_num_seqs, "sequences running at once")->check(CLI::Range(1, 65536));
  app->add_option("--max-num-batched-tokens", opts.config.max_num_batched_tokens, "tokens per engine step")
      ->check(CLI::Range(1, 1 << 20));
  app->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", opts.config.enable_prefix_caching,
                "reuse cached KV blocks of shared prompt prefixes (default on)");
  app->add_option("--tenant-quota", opts.tenant_quotas, "NAME=BLOCKS: cap a tenant's KV blocks (repeatable)");
}

result<engine_core_config> make_engine_config(const llama_model& model, engine_options opts) {
  for (const std::string& q : opts.tenant_quotas) PAGODA_RETURN_IF_ERROR(add_tenant_quota(opts.config, q));
  return make_engine_core_config(model, opts.config);
}

}  // namespace pagoda::cli
