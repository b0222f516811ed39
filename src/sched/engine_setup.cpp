#include "sched/engine_setup.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>

#include <unistd.h>

#include <fmt/format.h>

#include "core/hash.h"
#include "model/kv_share.h"
#include "policy/kv_policy.h"
#include "policy/policy_params_internal.h"
#include "sched/seq_policy.h"
#include "quant/kv_format_spec.h"
#include "quant/kv_scales.h"

namespace pagoda {

int context_length(const engine_config& opts, const llama_hparams& hp) {
  return opts.n_ctx > 0 ? opts.n_ctx : hp.n_ctx_train;
}

result<kv_share_spec> parse_kv_share_spec(std::string_view text) {
  PAGODA_ASSIGN_OR_RETURN(const kv_policy_spec spec, parse_kv_policy_spec(text));
  kv_share_spec out;
  if (spec.is_none()) {
    if (!spec.params.empty()) return error(errc::invalid_argument, "--kv-share none: takes no parameters");
    return out;
  }
  if (spec.name != "reuse" && spec.name != "minicache")
    return error(errc::invalid_argument, "--kv-share: unknown sharing '{}'; known: reuse, minicache (or none)", spec.name);
  out.name = spec.name;
  policy_detail::param_reader r(spec);
  PAGODA_ASSIGN_OR_RETURN(out.from, r.integer("from", -1, 0, 1 << 20));
  if (out.name == "minicache") {
    PAGODA_ASSIGN_OR_RETURN(const double t, r.number("t", out.t, 0.0, 1.0));
    PAGODA_ASSIGN_OR_RETURN(out.retain, r.number("retain", out.retain, 0.0, 1.0));
    out.t = static_cast<float>(t);
  }
  PAGODA_RETURN_IF_ERROR(r.finish().with_context("--kv-share"));
  if (out.from < 0)
    return error(errc::invalid_argument, "--kv-share {}: from=L is required (the first layer that shares)", spec.name);
  return out;
}

result<kv_share_plan> plan_kv_sharing(const llama_hparams& hp, std::string_view spec_text, int block_size) {
  PAGODA_ASSIGN_OR_RETURN(const kv_share_spec want, parse_kv_share_spec(spec_text));
  const int from = want.from;
  kv_share_plan plan;
  if (!hp.kv_source.empty()) {
    if (from >= 0)
      return error(errc::invalid_argument,
                   "--kv-share {}: this model declares its own KV sharing ({}); it takes no other",
                   spec_text, k_kv_source_key);
    plan.name = "declared";
    plan.source = hp.kv_source;
    return plan;
  }
  if (from < 0) return plan;
  if (from > hp.n_layer)
    return error(errc::invalid_argument, "--kv-share {}: from={}: this model has {} layers (from={} shares nothing)",
                 spec_text, from, hp.n_layer, hp.n_layer);
  plan.source.resize(static_cast<std::size_t>(hp.n_layer));
  bool any = false;
  for (int l = 0; l < hp.n_layer; ++l) {
    const bool reader = l >= from && (l - from) % 2 == 1;
    plan.source[static_cast<std::size_t>(l)] = reader ? l - 1 : l;
    if (reader && want.name == "minicache") plan.merge_readers.push_back(l);
    any = any || reader;
  }
  PAGODA_RETURN_IF_ERROR(check_kv_sources(hp, plan.source, "--kv-share"));
  if (!any) {
    plan.source.clear();  // nothing shared: the unshared layout, bit for bit
    return plan;
  }
  if (want.name == "minicache") {
    plan.merge_t = want.t;
    plan.merge_retain = static_cast<int>(std::lround(want.retain * block_size));
    // The name keys stored blocks (the layout fingerprint): every parameter that changes their bytes is in it.
    plan.name = fmt::format("minicache:from={},t={},retain={}", from, plan.merge_t, plan.merge_retain);
    return plan;
  }
  plan.name = fmt::format("reuse:from={}", from);
  return plan;
}

result<kv_layout> with_declared_kv_sharing(const llama_hparams& hp, kv_layout layout) {
  if (hp.kv_source.empty()) return layout;
  return share_kv_layers(layout, hp.kv_source, "declared");
}

result<kv_layout> make_kv_layout(const llama_model& model, const engine_config& opts) {
  // "auto" follows the weights, as vLLM's "auto" does: an f32 model keeps an f32
  // cache (bitwise reproducible); anything else gets f16 (vLLM's and llama.cpp's default).
  const kv_type auto_type = model.layers().front().wq.type == gguf::tensor_type::f32 ? kv_type::f32 : kv_type::f16;
  return make_kv_layout(model.hparams(), auto_type, opts);
}

result<kv_layout> make_kv_layout(const llama_hparams& hp, kv_type auto_type, const engine_config& opts) {
  auto spec_of = [&](const std::string& text, const char* what) -> result<kv_format_spec> {
    if (text == "auto") return kv_format_spec{auto_type, std::nullopt, 0};
    auto s = parse_kv_format_spec(text);
    if (!s.ok()) return s.error().with_context(what);
    return s;
  };
  kv_pair_spec base;
  if (opts.kv_cache_dtype == "auto") {
    base.k = base.v = kv_format_spec{auto_type, std::nullopt, 0};
  } else {
    auto p = parse_kv_pair_spec(opts.kv_cache_dtype);
    if (!p.ok()) return p.error().with_context("--kv-cache-dtype");
    base = *p;
  }
  if (!opts.cache_type_k.empty()) {
    PAGODA_ASSIGN_OR_RETURN(base.k, spec_of(opts.cache_type_k, "--cache-type-k"));
  }
  if (!opts.cache_type_v.empty()) {
    PAGODA_ASSIGN_OR_RETURN(base.v, spec_of(opts.cache_type_v, "--cache-type-v"));
  }
  std::vector<kv_pair_spec> per_layer(hp.n_layer, base);
  if (!opts.kv_layer_types.empty()) {
    PAGODA_ASSIGN_OR_RETURN(std::vector<kv_layer_rule> rules, parse_kv_layer_rules(opts.kv_layer_types));
    // Each layer is named by at most one rule: an overlap is a typo more
    // often than a wish, and silently letting one rule win hides it.
    std::vector<int> rule_of(hp.n_layer, -1);
    for (std::size_t i = 0; i < rules.size(); ++i) {
      const kv_layer_rule& r = rules[i];
      int last = r.last < 0 ? hp.n_layer - 1 : r.last;
      if (r.first >= hp.n_layer || last >= hp.n_layer)
        return error(errc::invalid_argument, "--kv-layer-types: layer range {}-{} is past the model's {} layers",
                     r.first, last, hp.n_layer);
      for (int l = r.first; l <= last; ++l) {
        if (rule_of[l] >= 0)
          return error(errc::invalid_argument,
                       "--kv-layer-types: rules {} and {} both set layer {}; give each layer one rule", rule_of[l] + 1,
                       i + 1, l);
        rule_of[l] = static_cast<int>(i);
        per_layer[l] = r.spec;
      }
    }
  }
  kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, opts.block_size, kv_type::f32, kv_type::f32);
  if (!opts.kv_scales_path.empty()) {
    PAGODA_ASSIGN_OR_RETURN(kv_scales scales, load_kv_scales(opts.kv_scales_path));
    PAGODA_RETURN_IF_ERROR(scales.check_shape(hp.n_layer, hp.n_head_kv, hp.head_dim).with_context(opts.kv_scales_path));
    layout.scales = std::make_shared<const kv_scales>(std::move(scales));
  }
  for (int l = 0; l < hp.n_layer; ++l) {
    layout.k_formats[l] = per_layer[l].k.resolve(kv_role::key, layout.scales != nullptr);
    layout.v_formats[l] = per_layer[l].v.resolve(kv_role::value, layout.scales != nullptr);
  }
  PAGODA_RETURN_IF_ERROR(layout.check());
  PAGODA_ASSIGN_OR_RETURN(const kv_share_plan share, plan_kv_sharing(hp, opts.kv_share, layout.block_size));
  if (!share.shares()) return layout;
  auto shared = share_kv_layers(layout, share.source, share.name);
  if (!shared.ok()) return shared.error().with_context("--kv-layer-types with KV sharing");
  if (share.merge_readers.empty()) return shared;
  auto merged = merge_kv_layers(std::move(*shared), share.merge_readers, share.merge_t, share.merge_retain);
  if (!merged.ok()) return merged.error().with_context("--kv-share");
  return merged;
}

result<std::int64_t> pool_blocks(const kv_layout& layout, const engine_config& opts, std::int64_t default_tokens,
                                 std::int64_t n_slots) {
  std::int64_t blocks;
  if (opts.kv_cache_size_mib > 0) {
    double bytes = opts.kv_cache_size_mib * 1024.0 * 1024.0 -
                   static_cast<double>(layout.staging_bytes_per_slot()) * std::max<std::int64_t>(n_slots, 1) -
                   static_cast<double>(layout.static_bytes());
    blocks = static_cast<std::int64_t>(std::max(bytes, 0.0) / static_cast<double>(layout.bytes_per_block()));
    if (blocks < 1) {
      const std::size_t fixed = layout.staging_bytes_per_slot() * static_cast<std::size_t>(std::max<std::int64_t>(n_slots, 1)) +
                                layout.static_bytes();
      return error(errc::invalid_argument,
                   "--kv-cache-size {} MiB holds no KV block: one block takes {} bytes, and {} bytes go to {} f16 "
                   "staging slots and static scales first; raise --kv-cache-size or lower --max-num-seqs",
                   opts.kv_cache_size_mib, layout.bytes_per_block(), fixed,
                   layout.staging_bytes_per_slot() > 0 ? n_slots : 0);
    }
  } else {
    std::int64_t tokens = opts.max_kv_tokens > 0 ? opts.max_kv_tokens : default_tokens;
    blocks = (tokens + layout.block_size - 1) / layout.block_size;
  }
  // The pool is mapped lazily: one larger than the machine would start and
  // then die of memory once it filled. Refuse it now.
  const double pool_bytes = static_cast<double>(blocks) * static_cast<double>(layout.bytes_per_block());
  if (const double machine = static_cast<double>(machine_memory_bytes()); machine > 0 && pool_bytes > machine)
    return error(errc::invalid_argument,
                 "the KV pool ({:.1f} GiB: {} blocks of {} bytes) exceeds this machine's memory ({:.1f} GiB); lower "
                 "{}",
                 pool_bytes / (1 << 30), blocks, layout.bytes_per_block(), machine / (1 << 30),
                 opts.kv_cache_size_mib > 0 ? "--kv-cache-size" : opts.max_kv_tokens > 0 ? "--max-kv-tokens" : "--ctx");
  return blocks;
}

std::int64_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : 0;
}

status add_tenant_quota(engine_config& config, const std::string& q) {
  const std::size_t eq = q.rfind('=');
  std::int32_t blocks = 0;
  const char* end = q.data() + q.size();
  if (eq == std::string::npos || eq == 0) return error(errc::invalid_argument, "--tenant-quota '{}': expected NAME=BLOCKS", q);
  const auto [ptr, ec] = std::from_chars(q.data() + eq + 1, end, blocks);
  if (ec != std::errc() || ptr != end || blocks < 0)
    return error(errc::invalid_argument, "--tenant-quota '{}': expected NAME=BLOCKS with BLOCKS a whole number >= 0", q);
  config.tenant_quota_blocks[q.substr(0, eq)] = blocks;
  return {};
}

std::uint64_t model_fingerprint(const llama_model& model) { return model_fingerprint(model.gguf()); }

std::uint64_t model_fingerprint(const gguf::file& f) {
  hasher h(0xf1a9e7);
  for (const gguf::metadata_entry& e : f.metadata()) {
    h.update(e.key.data(), e.key.size());
    h.update_pod(e.val.u).update_pod(e.val.i).update_pod(e.val.f).update_pod(e.val.array_size);
    h.update(e.val.str.data(), e.val.str.size());
    for (const std::string_view s : e.val.array_strings) h.update(s.data(), s.size());
    if (e.val.array_data) h.update(e.val.array_data, e.val.array_size * gguf::value_type_size(e.val.array_type));
  }
  constexpr std::uint64_t k_span = 4096, k_samples = 8;
  for (const gguf::tensor_info& t : f.tensors()) {
    h.update(t.name.data(), t.name.size());
    h.update_pod(t.type).update(t.ne, sizeof(t.ne)).update_pod(t.size_bytes);
    if (t.size_bytes <= k_span * k_samples) {
      h.update(t.data, t.size_bytes);
      continue;
    }
    for (std::uint64_t i = 0; i < k_samples; ++i) h.update(t.data + (t.size_bytes - k_span) / (k_samples - 1) * i, k_span);
  }
  return h.digest();
}

result<std::unique_ptr<kv_warehouse>> make_warehouse(const engine_config& config, const llama_model& model,
                                                     const clock_source& clock) {
  std::shared_ptr<const record_secret> secret;
  if (!config.kv_store_secret_file.empty()) {
    if (config.kv_store_path.empty() && config.kv_store_remote.empty())
      return error(errc::invalid_argument, "--kv-store-secret-file: there is no KV store to protect (no --kv-store "
                                           "or --kv-store-remote)");
    auto s = record_secret::from_file(config.kv_store_secret_file);
    if (!s.ok()) return s.error().with_context("--kv-store-secret-file");
    secret = std::make_shared<const record_secret>(std::move(*s));
  }
  std::vector<std::unique_ptr<block_store>> tiers;
  if (!config.kv_store_path.empty()) {
    if (!(config.kv_store_size_gib > 0) || config.kv_store_size_gib > (1 << 20))
      return error(errc::invalid_argument, "--kv-store size {} GiB: expected a size above 0", config.kv_store_size_gib);
    disk_store_options d;
    d.path = config.kv_store_path;
    d.capacity_bytes = static_cast<std::int64_t>(config.kv_store_size_gib * (1 << 30));
    d.ttl_seconds = config.kv_store_ttl_s;
    PAGODA_ASSIGN_OR_RETURN(auto disk, make_disk_store(d, clock));
    tiers.push_back(std::move(disk));
  }
  if (!config.kv_store_remote.empty()) {
    auto parsed = parse_redis_url(config.kv_store_remote);
    if (!parsed.ok()) return parsed.error().with_context("--kv-store-remote");
    redis_store_options r = std::move(*parsed);
    r.ttl_seconds = config.kv_store_ttl_s;
    // A server that is down now is not fatal: the tier counts errors and
    // reconnects later, and serving goes on from the pool and the disk. One
    // that refuses us (password, certificate) is: that does not heal.
    auto redis = make_redis_store(r, /*require_connection=*/false, clock);
    if (!redis.ok()) return redis.error().with_context("--kv-store-remote");
    tiers.push_back(std::move(*redis));
  }
  if (tiers.empty()) return std::unique_ptr<kv_warehouse>();
  warehouse_options o;
  o.model = model_fingerprint(model);
  o.secret = std::move(secret);
  o.clock = &clock;
  return std::make_unique<kv_warehouse>(std::move(tiers), o);
}

void attach_warehouse(engine_core& core, kv_warehouse& w) {
  core.set_kv_source(&w);
  core.set_commit_hook([&w](const cached_block& b) { w.write(b); });
}

std::vector<stored_block_ref> prompt_refs(engine_core& core, std::span<const token_id> prompt,
                                          const sequence_options& options) {
  const std::vector<block_key> keys = core.kv().prompt_keys(prompt, options);
  const std::vector<std::int32_t> classes = core.kv().prompt_block_classes(prompt, options);
  return group_block_refs(core.block_layouts(), core.kv().n_groups(), keys, classes, 0, static_cast<int>(keys.size()));
}

status parse_kv_store_option(engine_config& config, const std::string& spec) {
  const std::size_t comma = spec.find(',');
  config.kv_store_path = spec.substr(0, comma);
  if (config.kv_store_path.empty()) return error(errc::invalid_argument, "--kv-store '{}': no directory", spec);
  if (comma == std::string::npos) return {};
  const std::string opt = spec.substr(comma + 1);
  constexpr std::string_view k_size = "size=";
  if (opt.rfind(k_size, 0) != 0)
    return error(errc::invalid_argument, "--kv-store '{}': expected PATH or PATH,size=GiB", spec);
  const std::string v = opt.substr(k_size.size());
  double gib = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), gib);
  if (ec != std::errc() || p != v.data() + v.size() || !(gib > 0) || !std::isfinite(gib))
    return error(errc::invalid_argument, "--kv-store '{}': size must be a positive number of GiB", spec);
  config.kv_store_size_gib = gib;
  return {};
}

namespace {

// --kv-segment-dtype: the extra KV classes, and the pool's bytes shared out
// between them and the default type.
status add_kv_segment_classes(const llama_model& model, const engine_config& opts, engine_core_config& cfg) {
  // --kv-image-type names a class too: one of the flag's fraction unless
  // --kv-segment-dtype lists it or it is the default type.
  std::vector<std::string> dtypes = opts.kv_segment_dtypes;
  if (!opts.kv_image_type.empty() && !find_kv_class(cfg, opts.kv_image_type).ok()) {
    const auto listed = std::find_if(dtypes.begin(), dtypes.end(), [&](const std::string& t) {
      return t.substr(0, t.rfind(':')) == opts.kv_image_type;
    });
    if (listed == dtypes.end()) dtypes.push_back(opts.kv_image_type);
  }
  if (dtypes.empty()) return {};
  if (dtypes.size() > 8)
    return error(errc::invalid_argument, "--kv-segment-dtype: at most 8 KV classes, got {}", dtypes.size());
  std::vector<double> shares;
  double total_share = 0;
  for (const std::string& text : dtypes) {
    const std::size_t colon = text.rfind(':');
    const std::string type = text.substr(0, colon);
    double share = 0.25;
    if (colon != std::string::npos) {
      const std::string v = text.substr(colon + 1);
      const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), share);
      if (ec != std::errc() || p != v.data() + v.size() || !(share > 0) || !(share < 1))
        return error(errc::invalid_argument, "--kv-segment-dtype '{}': FRACTION must be a number in (0, 1)", text);
    }
    engine_config one = opts;
    one.kv_cache_dtype = type;
    one.cache_type_k.clear();
    one.cache_type_v.clear();
    one.kv_layer_types.clear();
    auto layout = make_kv_layout(model, one);
    if (!layout.ok()) return layout.error().with_context(fmt::format("--kv-segment-dtype '{}'", text));
    layout->key_summaries = cfg.kv.key_summaries;
    auto known = find_kv_class(cfg, type);  // the default, or a class given before
    if (known.ok())
      return error(errc::invalid_argument, "--kv-segment-dtype '{}': the engine already keeps that type ({})", text,
                   *known == 0 ? "it is the default" : "given twice");
    cfg.kv_classes.push_back(kv_segment_class{type, std::move(*layout), 0});
    shares.push_back(share);
    total_share += share;
  }
  if (!(total_share < 1))
    return error(errc::invalid_argument, "--kv-segment-dtype: the classes' fractions add up to {}, which leaves no "
                 "blocks of the default type; keep their sum below 1", total_share);
  // The default type's pool as sized so far is the bytes to share out. Under
  // a --kv-cache-size budget, less what the classes add besides blocks:
  // staging slots sized for the class that stages most (kv_storage.h) and
  // their static scales.
  // Group 0's blocks hold its layers only (the full ones, when sliding-window
  // layers have a group of their own; that group's blocks of each class come
  // out of a MiB budget first).
  const llama_hparams& hp = model.hparams();
  std::vector<int> main_layers, window_layers;
  split_kv_layers(hp, cfg.kv, main_layers, window_layers);
  if (!cfg.free_out_of_window) {
    main_layers.insert(main_layers.end(), window_layers.begin(), window_layers.end());
    std::sort(main_layers.begin(), main_layers.end());
    window_layers.clear();
  }
  if (main_layers.empty()) main_layers.swap(window_layers);  // every layer slides: one group
  const auto main_bytes = [&](const kv_layout& l) {
    return static_cast<double>(l.select_layers(main_layers).bytes_per_block());
  };
  double bytes = static_cast<double>(cfg.n_blocks) * main_bytes(cfg.kv);
  if (opts.kv_cache_size_mib > 0) {
    std::size_t staging = cfg.kv.staging_bytes_per_slot(), statics = 0;
    double window = 0;
    for (const kv_segment_class& k : cfg.kv_classes) {
      staging = std::max(staging, k.layout.staging_bytes_per_slot());
      statics += k.layout.static_bytes();
      if (!window_layers.empty())
        window += static_cast<double>(k.layout.select_layers(window_layers).bytes_per_block()) *
                  static_cast<double>(window_group_blocks(hp, cfg));
    }
    bytes -= static_cast<double>(staging - cfg.kv.staging_bytes_per_slot()) *
                 static_cast<double>(k_staging_slots_per_sequence * opts.max_num_seqs) +
             static_cast<double>(statics) + window;
  }
  for (std::size_t i = 0; i < cfg.kv_classes.size(); ++i) {
    kv_segment_class& k = cfg.kv_classes[i];
    k.n_blocks = static_cast<std::int64_t>(bytes * shares[i] / main_bytes(k.layout));
    if (k.n_blocks < 1)
      return error(errc::invalid_argument, "--kv-segment-dtype '{}': {} of a {}-block pool holds no block of it; "
                   "raise the fraction or the pool", dtypes[i], shares[i], cfg.n_blocks);
  }
  cfg.n_blocks = static_cast<std::int64_t>(bytes * (1 - total_share) / main_bytes(cfg.kv));
  if (cfg.n_blocks < 1)
    return error(errc::invalid_argument, "--kv-segment-dtype: no block of the default type is left; lower the fractions");
  return {};
}

// Tokens' worth of blocks the engine's --kv-policy's side memory (retrieval
// indexes, statistics: docs/architecture.md, "Side memory") takes for
// max_num_seqs sequences of max_model_len, which a default-sized pool adds so
// that what it was sized for still runs. 0 for no policy or a bad spec (the
// engine reports the spec's error itself).
std::int64_t side_tokens(const engine_core_config& cfg, const kv_layout& l) {
  auto spec = parse_kv_policy_spec(cfg.kv_policy);
  if (!spec.ok() || spec->is_none()) return 0;
  auto policy = make_kv_policy(*spec);
  if (!policy.ok()) return 0;
  const seq_policy_shape shape{cfg.kv.n_layers, cfg.kv.n_kv_heads, cfg.kv.head_dim, cfg.kv.block_size};
  const side_charge side = seq_policy::side_memory_of(policy->get(), shape, cfg.attention_stats_window);
  const auto block_bytes = static_cast<std::int64_t>(l.bytes_per_block());
  const std::int64_t blocks = (side.bytes_for(cfg.max_model_len) + block_bytes - 1) / block_bytes;
  return blocks * l.block_size * cfg.max_num_seqs;
}

}  // namespace

result<engine_core_config> make_engine_core_config(const llama_model& model, const engine_config& opts) {
  engine_core_config cfg;
  cfg.n_threads = opts.n_threads;
  cfg.max_model_len = context_length(opts, model.hparams());
  cfg.max_num_seqs = opts.max_num_seqs;
  cfg.max_num_batched_tokens = opts.max_num_batched_tokens;
  cfg.enable_prefix_caching = opts.enable_prefix_caching;
  const std::optional<cache_eviction> eviction = parse_cache_eviction(opts.prefix_cache_eviction);
  if (!eviction)
    return error(errc::invalid_argument, "--prefix-cache-eviction {}: expected lfu or lru", opts.prefix_cache_eviction);
  cfg.prefix_cache_eviction = *eviction;
  cfg.tenant_quota_blocks = opts.tenant_quota_blocks;
  cfg.max_waiting = opts.max_waiting;
  if (opts.scheduling_policy != "fcfs" && opts.scheduling_policy != "cache-aware")
    return error(errc::invalid_argument, "--scheduling-policy {}: expected fcfs or cache-aware", opts.scheduling_policy);
  cfg.scheduling = opts.scheduling_policy == "cache-aware" ? scheduling_policy::cache_aware : scheduling_policy::fcfs;
  if (opts.max_passed_steps < 0)
    return error(errc::invalid_argument, "--max-passed-steps {}: must be at least 0", opts.max_passed_steps);
  cfg.max_passed_steps = opts.max_passed_steps;
  cfg.kv_policy = opts.kv_policy.empty() ? "none" : opts.kv_policy;
  cfg.kv_image_type = opts.kv_image_type;
  cfg.kv_image_policy = opts.kv_image_policy;
  cfg.speculative = opts.speculative.empty() ? "none" : opts.speculative;
  if (!opts.draft_model_path.empty() && cfg.speculative == "none") cfg.speculative = "draft";
  PAGODA_ASSIGN_OR_RETURN(cfg.kv, make_kv_layout(model, opts));
  if (opts.kv_key_summaries) cfg.kv.key_summaries = true;
  cfg.free_out_of_window = !opts.swa_full;
  cfg.kv_huge_pages = opts.kv_huge_pages;
  // Sliding-window layers beside full ones keep only their window in a group
  // of their own (engine_core.h, plan_kv_groups): the pool's blocks then pay
  // only for the full layers, and a MiB budget pays for the window group first.
  const llama_hparams& hp = model.hparams();
  std::vector<int> full_layers, window_layers;
  split_kv_layers(hp, cfg.kv, full_layers, window_layers);
  const bool mixed = cfg.free_out_of_window && !window_layers.empty() && !full_layers.empty();
  const kv_layout main_layout = mixed ? cfg.kv.select_layers(full_layers) : cfg.kv;
  const double k_default_cap_bytes = 4.0 * 1024 * 1024 * 1024;
  const std::int64_t staging_slots = k_staging_slots_per_sequence * opts.max_num_seqs;
  const auto default_tokens = [&](const kv_layout& l) {
    return std::min<std::int64_t>(static_cast<std::int64_t>(opts.max_num_seqs) * cfg.max_model_len + side_tokens(cfg, l),
                                  static_cast<std::int64_t>(k_default_cap_bytes / l.bytes_per_token()));
  };
  bool windows_fit = mixed;
  if (mixed) {
    engine_config sized = opts;
    if (opts.kv_cache_size_mib > 0) {
      // The window group first (its blocks and staging), then the full layers' blocks.
      const kv_layout window_layout = cfg.kv.select_layers(window_layers);
      const double window_bytes =
          static_cast<double>(window_layout.bytes_per_block()) * static_cast<double>(window_group_blocks(hp, cfg)) +
          static_cast<double>(window_layout.staging_bytes_per_slot()) * static_cast<double>(staging_slots) +
          static_cast<double>(window_layout.static_bytes());
      sized.kv_cache_size_mib = opts.kv_cache_size_mib - window_bytes / (1024.0 * 1024.0);
      windows_fit = sized.kv_cache_size_mib > 0;
    }
    if (windows_fit) {
      auto blocks = pool_blocks(main_layout, sized, default_tokens(main_layout), staging_slots);
      windows_fit = blocks.ok();
      if (blocks.ok()) cfg.n_blocks = *blocks;
    }
    // Too small a pool for the window group to save anything: every position stays.
    if (windows_fit) {
      engine_core_config probe = cfg;
      windows_fit = plan_kv_groups(hp, probe).size() == 2;
    }
  }
  if (!windows_fit) {
    if (mixed) cfg.free_out_of_window = false;
    PAGODA_ASSIGN_OR_RETURN(cfg.n_blocks, pool_blocks(cfg.kv, opts, default_tokens(cfg.kv), staging_slots));
  }
  PAGODA_RETURN_IF_ERROR(add_kv_segment_classes(model, opts, cfg));
  return cfg;
}

result<std::unique_ptr<llama_model>> load_draft_model(const engine_config& config) {
  if (config.draft_model_path.empty()) return std::unique_ptr<llama_model>();
  auto m = llama_model::load(config.draft_model_path, {config.use_mmap});
  if (!m.ok()) return m.error().with_context("--draft-model " + config.draft_model_path);
  return std::move(*m);
}

}  // namespace pagoda
