#include "sched/engine_core.h"

#include <exception>

#include "policy/kv_policy.h"

namespace pagoda {

scheduler_config scheduler_config_of(const engine_core_config& c) {
  scheduler_config s;
  s.max_model_len = c.max_model_len;
  s.max_num_seqs = c.max_num_seqs;
  s.max_num_batched_tokens = c.max_num_batched_tokens;
  s.enable_prefix_caching = c.enable_prefix_caching;
  s.block_size = c.kv.block_size;
  s.n_blocks = c.n_blocks;
  s.tenant_quota_blocks = c.tenant_quota_blocks;
  s.max_waiting = c.max_waiting;
  s.attention_stats_window = c.attention_stats_window;
  s.kv_policy = c.kv_policy;
  s.policy_shape = {c.kv.n_layers, c.kv.n_kv_heads, c.kv.head_dim, c.kv.block_size};
  s.key_summaries = c.kv.key_summaries;
  return s;
}

result<std::unique_ptr<engine_core>> engine_core::create(const llama_model& model, const engine_core_config& config) {
  const llama_hparams& hp = model.hparams();
  if (config.kv.n_layers != hp.n_layer || config.kv.n_kv_heads != hp.n_head_kv || config.kv.head_dim != hp.head_dim)
    return error(errc::invalid_argument, "KV layout ({} layers, {} KV heads, head_dim {}) does not match the model",
                 config.kv.n_layers, config.kv.n_kv_heads, config.kv.head_dim);
  if (config.n_blocks < 1 || config.n_blocks > (1ll << 30))
    return error(errc::invalid_argument, "KV pool of {} blocks is out of range", config.n_blocks);
  if (config.max_num_seqs < 1) return error(errc::invalid_argument, "--max-num-seqs must be at least 1");
  engine_core_config c = config;
  if (c.max_model_len <= 0) c.max_model_len = hp.n_ctx_train;
  {
    // The default policy must be valid, and what it needs of the KV layout is kept.
    auto spec = parse_kv_policy_spec(c.kv_policy);
    if (!spec.ok()) return spec.error().with_context("--kv-policy");
    auto policy = make_kv_policy(*spec);
    if (!policy.ok()) return policy.error().with_context("--kv-policy");
    if ((*policy)->needs().key_summaries) c.kv.key_summaries = true;
  }
  // Staging slots for every sequence that can hold open blocks (kv_storage.h).
  PAGODA_ASSIGN_OR_RETURN(auto storage,
                          kv_storage::create(c.kv, c.n_blocks, k_staging_slots_per_sequence * c.max_num_seqs));
  std::unique_ptr<engine_core> e(new engine_core(model, c, std::move(storage)));
  PAGODA_RETURN_IF_ERROR(e->sched_.check());
  return e;
}

engine_core::engine_core(const llama_model& model, const engine_core_config& config, std::unique_ptr<kv_storage> storage)
    : model_(model), config_(config), storage_(std::move(storage)), sched_(scheduler_config_of(config), model.vocab()) {
  auto cpu = std::make_unique<cpu_runner>(model, *storage_, config.n_threads);
  cpu_ = cpu.get();
  runner_ = std::move(cpu);
}

engine_core::~engine_core() = default;

bool engine_core::step(std::vector<engine_event>& events) {
  step_plan plan = sched_.schedule();
  if (plan.empty()) {
    sched_.take_events(events);
    return false;
  }
  step_output out;
  try {
    runner_->execute(plan, out);
  } catch (const std::exception& e) {
    out.result = error(errc::internal, "{}", e.what());
  }
  sched_.update(plan, out, events);
  return !plan.seqs.empty() || !plan.loads.empty();
}

void engine_core::flush(std::vector<engine_event>& events) {
  // Bounded: an ops-only step plans no sequence, so it cannot make new ops
  // unless a request arrived in between (then has_work() is true again).
  for (int i = 0; i < 4 && !has_work() && has_pending_ops(); ++i) step(events);
}

}  // namespace pagoda
