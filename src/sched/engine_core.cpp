#include "sched/engine_core.h"

#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include "core/assert.h"
#include "policy/kv_policy.h"
#include "quant/kv_format_spec.h"
#include "spec/draft_model.h"
#include "store/store_key.h"

namespace pagoda {

scheduler_config scheduler_config_of(const engine_core_config& c) {
  scheduler_config s;
  s.max_model_len = c.max_model_len;
  s.max_num_seqs = c.max_num_seqs;
  s.max_num_batched_tokens = c.max_num_batched_tokens;
  s.enable_prefix_caching = c.enable_prefix_caching;
  s.prefix_cache_eviction = c.prefix_cache_eviction;
  s.block_size = c.kv.block_size;
  s.n_blocks = c.n_blocks;
  s.tenant_quota_blocks = c.tenant_quota_blocks;
  s.max_waiting = c.max_waiting;
  s.scheduling = c.scheduling;
  s.max_passed_steps = c.max_passed_steps;
  s.attention_stats_window = c.attention_stats_window;
  s.kv_policy = c.kv_policy;
  s.kv_image_type = c.kv_image_type;
  s.kv_image_policy = c.kv_image_policy;
  s.n_embd = c.n_embd;
  s.speculative = c.speculative;
  s.draft_model = c.draft_model != nullptr;
  for (const engine_kv_group& g : c.groups)
    if (!g.mirror.empty()) s.kv_mirror = g.mirror;
  s.policy_shape = {c.kv.n_layers, c.kv.n_kv_heads, c.kv.head_dim, c.kv.block_size};  // KV layers
  s.n_model_layers = c.kv.n_model_layers();
  s.key_summaries = c.kv.key_summaries;
  bool merged = false;
  for (int j = 0; j < c.kv.n_layers; ++j) merged = merged || c.kv.merged(j);
  if (merged) {
    s.chunk_reuse_refusal = fmt::format("chunk reuse moves KV slots into place, which merged KV layers ({}) do not "
                                        "follow yet; start the engine without --kv-share minicache", c.kv.sharing);
    // A merged pair's lower layer reads its own rows of a step's earlier
    // tokens unmerged, and a rollback cannot give back a token a draft
    // displaced from the retained ones: verification would not give plain
    // decoding's tokens.
    s.speculation_refusal = fmt::format("speculative decoding verifies drafts in one step, which with merged KV layers "
                                        "({}) would not give plain decoding's tokens; run without speculation or "
                                        "without --kv-share minicache", c.kv.sharing);
  }
  if (c.kv.has_sealed())
    s.chunk_reuse_refusal = fmt::format("chunk reuse rewrites single KV slots, which the KV layout {} cannot (a sealed "
                                        "format encodes whole blocks); start the engine with a per-token KV type "
                                        "(f16, bf16, fp8, int8, int4/token)", c.kv.describe());
  // Side memory is paid in group-0 blocks of the default type: each stands for its K/V bytes.
  s.side_block_bytes = static_cast<std::int64_t>(
      c.groups.empty() ? c.kv.bytes_per_block() : c.kv.select_layers(c.groups.front().layers).bytes_per_block());
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
  for (const engine_kv_group& g : c.groups) {
    kv_group_config k;
    k.kind = g.kind;
    k.window_tokens = g.window_tokens;
    for (const std::int64_t n : g.class_blocks) k.class_blocks.push_back(static_cast<std::int32_t>(n));
    s.kv_groups.push_back(std::move(k));
  }
  // With one type too: a part may name the default type, and a type the
  // engine lacks gets the flag that would add it.
  s.kv_class_of = [c](const std::string& type) { return find_kv_class(c, type); };
  return s;
}

std::int64_t window_group_blocks(const llama_hparams& hp, const engine_core_config& c) {
  const std::int64_t bs = c.kv.block_size;
  const std::int64_t step_tokens = std::min<std::int64_t>(c.max_num_batched_tokens, std::max(c.max_model_len, 1));
  // Held at once by one sequence: the blocks its window reaches into, its
  // open block and one step's new blocks; the step's tokens are shared by all.
  // Speculation by default: a verification step adds up to k + 1 <= block
  // size slots, one block more than a plain step at most.
  const auto speculation = parse_spec_config(c.speculative);
  const std::int64_t per_seq = (hp.sliding_window + bs - 1) / bs + 3 + (speculation.ok() && speculation->enabled() ? 1 : 0);
  return c.max_num_seqs * per_seq + (step_tokens + bs - 1) / bs;
}

kv_layout draft_kv_layout(const kv_layout& target_class, const llama_hparams& draft) {
  kv_layout l;
  l.n_layers = draft.n_layer;
  l.n_kv_heads = draft.n_head_kv;
  l.head_dim = draft.head_dim;
  l.block_size = target_class.block_size;
  l.k_formats.assign(static_cast<std::size_t>(draft.n_layer), target_class.k_formats.front());
  l.v_formats.assign(static_cast<std::size_t>(draft.n_layer), target_class.v_formats.front());
  if (!l.check().ok())  // a static format without scales of this shape
    l = kv_layout::uniform(draft.n_layer, draft.n_head_kv, draft.head_dim, target_class.block_size, kv_type::f16, kv_type::f16);
  if (!draft.kv_source.empty()) {  // a draft that declares KV sharing (one type on every layer: it cannot fail)
    auto shared = share_kv_layers(l, draft.kv_source, "declared");
    PAGODA_ASSERT(shared.ok(), "draft KV sharing: {}", shared.error().message());
    l = std::move(*shared);
  }
  return l;
}

void split_kv_layers(const llama_hparams& hp, const kv_layout& kv, std::vector<int>& full, std::vector<int>& windowed) {
  full.clear();
  windowed.clear();
  for (int j = 0; j < kv.n_layers; ++j) (hp.is_swa(kv.kv_producer(j)) ? windowed : full).push_back(j);
}

result<kv_layout> mirror_kv_layout(const kv_layout& target_class, const std::string& type) {
  PAGODA_ASSIGN_OR_RETURN(const kv_pair_spec pair, parse_kv_pair_spec(type));
  kv_layout l = kv_layout::uniform(target_class.n_layers, target_class.n_kv_heads, target_class.head_dim,
                                   target_class.block_size, kv_type::f32, kv_type::f32);
  for (int i = 0; i < l.n_layers; ++i) {
    l.k_formats[static_cast<std::size_t>(i)] = pair.k.resolve(kv_role::key, false);
    l.v_formats[static_cast<std::size_t>(i)] = pair.v.resolve(kv_role::value, false);
  }
  // The target's layer map: its own forward pass reads the mirror.
  l.layer_map = target_class.layer_map;
  l.sharing = target_class.sharing;
  PAGODA_RETURN_IF_ERROR(l.check());
  return l;
}

std::vector<engine_kv_group> plan_kv_groups(const llama_hparams& hp, const engine_core_config& c) {
  // Groups of KV layers (shared ones once: kv_layout::layer_map), each of
  // the kind its producer's (and so every reader's) attention is.
  const int n_kv = c.kv.n_layers;
  std::vector<int> full, windowed;
  split_kv_layers(hp, c.kv, full, windowed);
  engine_kv_group main;
  main.class_blocks.push_back(c.n_blocks);
  for (const kv_segment_class& k : c.kv_classes) main.class_blocks.push_back(k.n_blocks);
  if (!c.free_out_of_window || windowed.empty()) {
    for (int j = 0; j < n_kv; ++j) main.layers.push_back(j);
    return {main};
  }
  if (full.empty()) {  // every layer slides: the one group is a window
    main.kind = kv_group_kind::sliding_window;
    main.window_tokens = hp.sliding_window;
    main.layers = windowed;
    return {main};
  }
  const std::int64_t n_window = c.window_blocks > 0 ? c.window_blocks : window_group_blocks(hp, c);
  if (n_window >= c.n_blocks) {  // nothing to save: every position stays
    for (int j = 0; j < n_kv; ++j) main.layers.push_back(j);
    return {main};
  }
  main.layers = full;
  engine_kv_group window;
  window.kind = kv_group_kind::sliding_window;
  window.window_tokens = hp.sliding_window;
  window.layers = windowed;
  // Every class gets the window's blocks: any running sequence may be inside a part of any type.
  window.class_blocks.assign(main.class_blocks.size(), n_window);
  return {main, window};
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

namespace {

// --kv-huge-pages: one line on stderr at start saying how much of the pool's
// tiles the kernel gave in huge pages and how long faulting them in took; a
// warning when that fell short (the pool works either way).
void report_huge_pages(const kv_storage& storage) {
  std::size_t bytes = 0, huge = 0;
  bool known = true, resident = true;
  double ms = 0;
  std::string problems;
  for (int g = 0; g < storage.n_groups(); ++g) {
    const anon_memory& m = storage.arena(g).tile_memory();
    bytes += m.size_bytes();
    known = known && m.huge().huge_bytes.has_value();
    huge += m.huge().huge_bytes.value_or(0);
    resident = resident && m.huge().resident;
    ms += m.huge().fault_in_ms;
    if (!m.huge().problem.empty() && problems.find(m.huge().problem) == std::string::npos)
      problems += "; " + m.huge().problem;
  }
  const double mib = 1024.0 * 1024.0;
  std::string line = resident ? fmt::format("KV pool faulted in at start in {:.0f} ms: ", ms) : "KV pool: ";
  if (known) line += fmt::format("{:.1f} of {:.1f} MiB in huge pages", static_cast<double>(huge) / mib, bytes / mib);
  else line += fmt::format("{:.1f} MiB, how much of it in huge pages unknown (no /proc/self/smaps)", bytes / mib);
  const bool short_of_huge = known && huge < bytes;
  if (short_of_huge) {
    const std::string mode = transparent_huge_page_mode();
    line += fmt::format(" (transparent_hugepage/enabled: {}; the rest in base pages)", mode.empty() ? "missing" : mode);
  }
  std::fprintf(stderr, "pagoda: %s--kv-huge-pages: %s%s\n", short_of_huge || !problems.empty() ? "warning: " : "",
               line.c_str(), problems.c_str());
}

}  // namespace

result<std::unique_ptr<engine_core>> engine_core::create(const llama_model& model, const engine_core_config& config) {
  const llama_hparams& hp = model.hparams();
  if (config.kv.n_model_layers() != hp.n_layer || config.kv.n_kv_heads != hp.n_head_kv ||
      config.kv.head_dim != hp.head_dim)
    return error(errc::invalid_argument, "KV layout ({} layers, {} KV heads, head_dim {}) does not match the model",
                 config.kv.n_model_layers(), config.kv.n_kv_heads, config.kv.head_dim);
  if (status st = config.kv.check(); !st.ok()) return st.with_context("KV layout");
  for (int l = 0; l < hp.n_layer; ++l)  // a model's declared sharing is not optional
    if (hp.reads_other_kv(l) && config.kv.kv_layer_of(l) != config.kv.kv_layer_of(hp.kv_source[static_cast<std::size_t>(l)]))
      return error(errc::invalid_argument, "KV layout: layer {} must read layer {}'s KV, as the model declares", l,
                   hp.kv_source[static_cast<std::size_t>(l)]);
  if (config.n_blocks < 1 || config.n_blocks > (1ll << 30))
    return error(errc::invalid_argument, "KV pool of {} blocks is out of range", config.n_blocks);
  if (config.max_num_seqs < 1) return error(errc::invalid_argument, "--max-num-seqs must be at least 1");
  engine_core_config c = config;
  if (c.max_model_len <= 0) c.max_model_len = hp.n_ctx_train;
  c.n_embd = hp.n_embd;
  if (!c.kv_image_type.empty())
    if (auto cls = find_kv_class(c, c.kv_image_type); !cls.ok()) return cls.error().with_context("--kv-image-type");
  if (!c.kv_image_policy.empty()) {
    auto spec = parse_kv_policy_spec(c.kv_image_policy);
    if (!spec.ok()) return spec.error().with_context("--kv-image-policy");
    // As the segment an image becomes (the default policy around it): a policy
    // that cannot be a segment's (one that reads sparsely) is refused here, not at each request.
    auto base = parse_kv_policy_spec(c.kv_policy);
    const kv_segment image{0, 1, *spec};
    if (base.ok())
      if (auto policy = make_segmented_policy(*base, {&image, 1}); !policy.ok())
        return policy.error().with_context("--kv-image-policy");
  }
  {
    // The default policy must be valid, and what it needs of the KV layout is kept.
    auto spec = parse_kv_policy_spec(c.kv_policy);
    if (!spec.ok()) return spec.error().with_context("--kv-policy");
    auto policy = make_kv_policy(*spec);
    if (!policy.ok()) return policy.error().with_context("--kv-policy");
    const scheduler_config sc = scheduler_config_of(c);
    // A self drafter reading Quest's pages needs them as much as a quest policy does.
    auto speculation = parse_spec_config(c.speculative);
    if (speculation.ok() && speculation->enabled() && !sc.speculation_refusal.empty())
      return error(errc::invalid_argument, "--speculative {}: {}", c.speculative, sc.speculation_refusal);
    const bool quest_drafts = speculation.ok() && speculation->model_drafter() && speculation->view == draft_view::quest;
    if ((*policy)->needs().key_summaries || quest_drafts) {
      c.kv.key_summaries = true;
      for (kv_segment_class& k : c.kv_classes) k.layout.key_summaries = true;  // every class has class 0's shape
    }
  }
  std::vector<kv_layout> class_layouts{c.kv};
  for (const kv_segment_class& k : c.kv_classes) {
    if (k.n_blocks < 1) return error(errc::invalid_argument, "KV class {} has no block", k.name);
    class_layouts.push_back(k.layout);
  }
  c.groups = plan_kv_groups(hp, c);
  if (c.draft_model) {
    // The draft's KV: one more group, as many blocks as group 0 (every
    // sequence holds the same slots in every group), of the draft's shape.
    if (status st = check_same_vocabulary(model, *c.draft_model); !st.ok()) return st.with_context("--draft-model");
    engine_kv_group d;
    d.draft = true;
    for (int l = 0; l < c.draft_model->hparams().n_layer; ++l) d.layers.push_back(l);
    d.class_blocks = c.groups.front().class_blocks;
    c.groups.push_back(std::move(d));
  }
  {
    // The default speculation must be valid and possible here.
    auto spec = parse_spec_config(c.speculative);
    if (!spec.ok()) return spec.error().with_context("--speculative");
    if (const char* type = spec->mirror()) {
      // A self drafter reading a cheaper copy of the KV: the copy is one
      // more group of every layer, as many blocks as group 0 (the same slots
      // per sequence), in that type (its blocks are pool memory: engine_core.h).
      engine_kv_group m;
      m.mirror = type;
      for (int j = 0; j < c.kv.n_layers; ++j) m.layers.push_back(j);  // KV layers
      m.class_blocks = c.groups.front().class_blocks;
      c.groups.push_back(std::move(m));
    }
    if (spec->enabled()) {
      if (spec->drafter == "draft" && !c.draft_model)
        return error(errc::invalid_argument, "--speculative draft: needs a draft model (--draft-model PATH)");
      if (spec->model_drafter() && spec->layers > hp.n_layer)
        return error(errc::invalid_argument, "--speculative {}: layers={}: this model has {} layers", spec->drafter,
                     spec->layers, hp.n_layer);
    }
  }
  std::vector<kv_group_blocks> groups;
  for (const engine_kv_group& g : c.groups) {
    groups.push_back(kv_group_blocks{g.layers, g.class_blocks, {}});
    if (g.draft)
      for (const kv_layout& l : class_layouts) groups.back().own_classes.push_back(draft_kv_layout(l, c.draft_model->hparams()));
    if (!g.mirror.empty())
      for (const kv_layout& l : class_layouts) {
        auto m = mirror_kv_layout(l, g.mirror);
        if (!m.ok()) return m.error().with_context("--speculative view=" + g.mirror);
        groups.back().own_classes.push_back(std::move(*m));
      }
  }
  // Staging slots for every sequence that can hold open blocks (kv_arena.h).
  PAGODA_ASSIGN_OR_RETURN(auto storage, kv_storage::create(class_layouts, groups,
                                                          k_staging_slots_per_sequence * c.max_num_seqs,
                                                          kv_pool_memory{.huge_pages = c.kv_huge_pages}));
  if (c.kv_huge_pages) report_huge_pages(*storage);
  std::unique_ptr<engine_core> e(new engine_core(model, c, std::move(storage)));
  PAGODA_RETURN_IF_ERROR(e->sched_.check());
  return e;
}

engine_core::engine_core(const llama_model& model, const engine_core_config& config, std::unique_ptr<kv_storage> storage)
    : model_(model),
      config_(config),
      storage_(std::move(storage)),
      sched_(scheduler_config_of(config), model.vocab()),
      output_(model.vocab(), sched_),
      runner_(std::make_unique<cpu_runner>(model, *storage_, config.n_threads)) {
  for (int g = 0; g < storage_->n_groups(); ++g) {
    const engine_kv_group& group = config.groups[static_cast<std::size_t>(g)];
    if (group.draft) {
      draft_kv_ = std::make_unique<kv_group_backend>(*storage_, g);
      static_cast<cpu_runner&>(*runner_).set_draft_model(*config.draft_model, *draft_kv_, g);
    }
    if (!group.mirror.empty()) {
      mirror_kv_ = std::make_unique<kv_group_backend>(*storage_, g);
      static_cast<cpu_runner&>(*runner_).set_kv_mirror(*mirror_kv_, g);
    }
  }
}

engine_core::~engine_core() = default;

std::vector<std::vector<std::uint64_t>> engine_core::block_layouts() const {
  std::vector<std::vector<std::uint64_t>> layouts(static_cast<std::size_t>(storage_->n_groups()));
  for (int g = 0; g < storage_->n_groups(); ++g)
    for (int c = 0; c < storage_->arena(g).n_classes(); ++c)
      layouts[static_cast<std::size_t>(g)].push_back(layout_fingerprint(storage_->arena(g).class_layout(c)));
  return layouts;
}

void engine_core::set_kv_source(kv_block_source* source) {
  sched_.set_kv_source(source, block_layouts());
  runner_->set_kv_source(source);
}

status engine_core::add_request(request req) {
  std::string id = req.id;
  std::vector<std::string> stop = req.stop;
  PAGODA_RETURN_IF_ERROR(sched_.add_request(std::move(req)));
  output_.add_request(std::move(id), std::move(stop));
  return {};
}

bool engine_core::abort_request(const std::string& id) {
  if (!sched_.abort_request(id)) return false;
  output_.abort_request(id);
  return true;
}

bool engine_core::step(std::vector<engine_event>& events) {
  const std::size_t first = events.size();
  step_plan plan = sched_.schedule();
  if (plan.empty()) {
    sched_.take_events(events);
    output_.process(events, first);
    return false;
  }
  step_output out;
  try {
    runner_->execute(plan, out);
  } catch (const std::exception& e) {
    out.result = error(errc::internal, "{}", e.what());
  }
  sched_.update(plan, out, events);
  output_.process(events, first);
  return !plan.seqs.empty() || !plan.loads.empty();
}

void engine_core::flush(std::vector<engine_event>& events) {
  // Bounded: an ops-only step plans no sequence, so it cannot make new ops
  // unless a request arrived in between (then has_work() is true again).
  for (int i = 0; i < 4 && !has_work() && has_pending_ops(); ++i) step(events);
}

}  // namespace pagoda
