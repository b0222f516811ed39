#include "sched/engine_core.h"

#include <exception>

#include <fmt/format.h>

#include "policy/kv_policy.h"
#include "quant/kv_format_spec.h"

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
  s.sliding_window_all = c.sliding_window_all;
  if (!c.kv_classes.empty()) {
    s.kv_class_blocks.push_back(static_cast<std::int32_t>(c.n_blocks));
    s.kv_class_keys.push_back("");
    for (const kv_segment_class& k : c.kv_classes) {
      s.kv_class_blocks.push_back(static_cast<std::int32_t>(k.n_blocks));
      s.kv_class_keys.push_back(k.layout.describe());
    }
    s.n_blocks = 0;
    for (std::int32_t n : s.kv_class_blocks) s.n_blocks += n;
  }
  // With one type too: a part may name the default type, and a type the
  // engine lacks gets the flag that would add it.
  s.kv_class_of = [c](const std::string& type) { return find_kv_class(c, type); };
  if (c.windows.any()) {
    s.window_slot_tokens = c.window_tokens;
    s.n_window_slots = c.windows.n_slots;
  }
  return s;
}

kv_window_layout plan_window_slots(const llama_hparams& hp, const engine_core_config& c, std::int64_t n_blocks) {
  kv_window_layout w;
  const int n_swa = hp.n_swa_layers();
  if (n_swa == 0 || n_swa == hp.n_layer || hp.sliding_window <= 0) return w;
  const std::int64_t bs = c.kv.block_size;
  const std::int64_t step_tokens = std::min<std::int64_t>(c.max_num_batched_tokens, std::max(c.max_model_len, 1));
  // Claimed at once by one sequence: the blocks its window reaches into, its
  // open block and one step's new blocks; the step's tokens are shared by all.
  const std::int64_t per_seq = (hp.sliding_window + bs - 1) / bs + 3;
  const std::int64_t n_slots = c.max_num_seqs * per_seq + (step_tokens + bs - 1) / bs;
  if (n_slots >= n_blocks) return w;
  w.n_slots = n_slots;
  w.layers.resize(static_cast<std::size_t>(hp.n_layer));
  for (int l = 0; l < hp.n_layer; ++l) w.layers[static_cast<std::size_t>(l)] = hp.is_swa(l) ? 1 : 0;
  return w;
}

result<std::uint8_t> find_kv_class(const engine_core_config& config, const std::string& kv_type) {
  auto spec = parse_kv_pair_spec(kv_type);
  if (!spec.ok()) return spec.error().with_context(fmt::format("KV type '{}'", kv_type));
  auto same = [&](const kv_layout& l) {
    for (int i = 0; i < l.n_layers; ++i)
      if (l.k_formats[i] != spec->k.resolve(kv_role::key, l.scales != nullptr) ||
          l.v_formats[i] != spec->v.resolve(kv_role::value, l.scales != nullptr))
        return false;
    return true;
  };
  if (same(config.kv)) return std::uint8_t{0};
  std::string kept = fmt::format("{} (the default)", config.kv.describe());
  for (std::size_t i = 0; i < config.kv_classes.size(); ++i) {
    if (same(config.kv_classes[i].layout)) return static_cast<std::uint8_t>(i + 1);
    kept += ", " + config.kv_classes[i].name;
  }
  return error(errc::invalid_argument,
               "KV type '{}' is not one this engine keeps ({}); start it with --kv-segment-dtype {} to give parts "
               "that type",
               kv_type, kept, kv_type);
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
  c.sliding_window_all = c.free_out_of_window ? hp.sliding_window : 0;
  for (int l = 0; l < hp.n_layer; ++l)
    if (!hp.is_swa(l)) c.sliding_window_all = 0;  // a global layer still reads every position
  {
    // The default policy must be valid, and what it needs of the KV layout is kept.
    auto spec = parse_kv_policy_spec(c.kv_policy);
    if (!spec.ok()) return spec.error().with_context("--kv-policy");
    auto policy = make_kv_policy(*spec);
    if (!policy.ok()) return policy.error().with_context("--kv-policy");
    if ((*policy)->needs().key_summaries) {
      c.kv.key_summaries = true;
      for (kv_segment_class& k : c.kv_classes) k.layout.key_summaries = true;  // every class has class 0's shape
    }
  }
  c.windows = {};
  c.window_tokens = 0;
  if (c.free_out_of_window && c.sliding_window_all == 0 && parse_kv_policy_spec(c.kv_policy)->is_none()) {
    c.windows = plan_window_slots(hp, c, c.n_blocks);
    if (c.windows.any()) c.window_tokens = hp.sliding_window;
  }
  // Staging slots for every sequence that can hold open blocks (kv_storage.h).
  std::vector<kv_class_spec> classes;
  for (const kv_segment_class& k : c.kv_classes) {
    if (k.n_blocks < 1) return error(errc::invalid_argument, "KV class {} has no block", k.name);
    classes.push_back(kv_class_spec{k.layout, k.n_blocks});
  }
  PAGODA_ASSIGN_OR_RETURN(auto storage, kv_storage::create(c.kv, c.n_blocks, k_staging_slots_per_sequence * c.max_num_seqs,
                                                           c.windows, classes));
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
