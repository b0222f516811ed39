#include "server/prometheus.h"

#include <cmath>

#include <fmt/format.h>

namespace pagoda::server {

std::string escape_label(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

namespace {

// Accumulates families: each metric's HELP and TYPE once, then its samples.
class writer {
 public:
  explicit writer(const std::string& model_name) : model_label_("model_name=\"" + escape_label(model_name) + "\"") {}

  void family(const char* name, const char* type, const char* help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  // `labels` is extra "k=\"v\"" pairs, comma-separated, or "".
  void sample(std::string_view name, const std::string& labels, double v) {
    out_ += fmt::format("{}{{{}{}{}}} {}\n", name, model_label_, labels.empty() ? "" : ",", labels, number(v));
  }
  void metric(const char* name, const char* type, const char* help, double v) {  // counts fit a double exactly
    family(name, type, help);
    sample(name, "", v);
  }
  void histogram(const char* name, const char* help, const histogram_snapshot& h) {
    family(name, "histogram", help);
    histogram_series(name, "", h);
  }
  // One labelled series of a histogram family (family() written by the caller).
  void histogram_series(const char* name, const std::string& labels, const histogram_snapshot& h) {
    const std::string lp = labels.empty() ? "" : labels + ",";
    for (std::size_t i = 0; i < h.bounds.size(); ++i)
      sample(fmt::format("{}_bucket", name), fmt::format("{}le=\"{}\"", lp, number(h.bounds[i])),
             static_cast<double>(h.cumulative_counts[i]));
    sample(fmt::format("{}_bucket", name), lp + "le=\"+Inf\"", static_cast<double>(h.count));
    sample(fmt::format("{}_sum", name), labels, h.sum);
    sample(fmt::format("{}_count", name), labels, static_cast<double>(h.count));
  }
  std::string take() { return std::move(out_); }

 private:
  static std::string number(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<std::int64_t>(v));
    return fmt::format("{}", v);
  }

  std::string model_label_;
  std::string out_;
};

}  // namespace

std::string render_metrics(const engine_snapshot& s, const http_counts& http, const std::string& model_name) {
  writer w(model_name);
  const kv_metrics& kv = s.kv;
  w.metric("pagoda:num_requests_running", "gauge", "Number of requests in model execution batches.", s.n_running);
  w.metric("pagoda:num_requests_running_peak", "gauge", "Most requests in model execution batches at once since start.",
           s.peak_running);
  w.metric("pagoda:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s.n_waiting);
  w.metric("pagoda:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage (used blocks / total).",
           kv.usage());
  w.metric("pagoda:kv_cache_fragmentation_ratio", "gauge",
           "Internal fragmentation of used KV blocks: 1 - stored tokens / token slots.", kv.fragmentation());
  w.family("pagoda:kv_cache_blocks", "gauge", "KV blocks by state; used + cached + free = the pool.");
  w.sample("pagoda:kv_cache_blocks", "state=\"used\"", kv.n_blocks_used);
  w.sample("pagoda:kv_cache_blocks", "state=\"cached\"", kv.n_blocks_cached);
  w.sample("pagoda:kv_cache_blocks", "state=\"free\"", kv.n_blocks_free);
  w.metric("pagoda:kv_cache_num_blocks", "gauge", "KV blocks in the pool.", kv.n_blocks_total);
  w.metric("pagoda:kv_cache_block_size_tokens", "gauge", "Tokens per KV block.", kv.block_size_tokens);
  w.metric("pagoda:kv_cache_blocks_used_peak", "gauge", "Most KV blocks in use at once since start.",
           kv.n_blocks_used_peak);
  w.metric("pagoda:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", kv.n_prefix_query_tokens);
  w.metric("pagoda:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", kv.n_prefix_hit_tokens);
  w.metric("pagoda:num_preemptions_total", "counter", "Cumulative number of preemptions.", kv.n_preemptions);
  w.metric("pagoda:kv_cache_evictions_total", "counter", "Cached KV blocks evicted (every reason).", kv.n_evictions);
  w.family("pagoda:prefix_cache_evictions_total", "counter",
           "Cached KV blocks evicted, by reason: capacity (an allocation needed the block), quota (a tenant at its "
           "quota paid with its own cache), admin (a prefix cache reset or a tenant's KV erased).");
  for (std::size_t r = 0; r < k_n_eviction_reasons; ++r)
    w.sample("pagoda:prefix_cache_evictions_total",
             fmt::format("reason=\"{}\"", eviction_reason_name(static_cast<eviction_reason>(r))),
             static_cast<double>(kv.n_evictions_by_reason[r]));
  w.metric("pagoda:kv_cache_cow_copies_total", "counter", "KV blocks copied on write (n > 1 forks).", kv.n_cow_copies);
  if (kv.groups.size() > 1) {
    // KV groups (layers kept differently, e.g. sliding-window layers beside
    // full ones): every group's blocks by state; group 0 is the totals above.
    w.family("pagoda:kv_group_blocks", "gauge",
             "KV blocks of each KV group (group=\"N\", kind=\"full|sliding_window\") by state.");
    for (std::size_t g = 0; g < kv.groups.size(); ++g) {
      const kv_group_usage& u = kv.groups[g];
      for (const auto& [state, n] : {std::pair{"used", u.n_used}, std::pair{"cached", u.n_cached}, std::pair{"free", u.n_free}})
        w.sample("pagoda:kv_group_blocks", fmt::format("group=\"{}\",kind=\"{}\",state=\"{}\"", g, u.kind, state), n);
    }
    w.family("pagoda:kv_window_freed_blocks_total", "counter",
             "Blocks sliding-window groups let go as windows moved past them (cached while their pool allows).");
    for (std::size_t g = 0; g < kv.groups.size(); ++g)
      if (kv.groups[g].kind == "sliding_window")
        w.sample("pagoda:kv_window_freed_blocks_total", fmt::format("group=\"{}\"", g), kv.groups[g].n_freed_out_of_window);
  }
  if (!kv.classes.empty()) {
    // Blocks of each KV class (--kv-segment-dtype): the default type and the segments' types.
    w.family("pagoda:kv_class_blocks", "gauge",
             "KV blocks by class (type=\"...\": the default type, then each --kv-segment-dtype) and state.");
    for (std::size_t c = 0; c < kv.classes.size(); ++c) {
      const kv_class_usage& u = kv.classes[c];
      const std::string tl = fmt::format(
          "type=\"{}\"", escape_label(c < s.kv_class_types.size() ? s.kv_class_types[c] : fmt::format("class{}", c)));
      w.sample("pagoda:kv_class_blocks", tl + ",state=\"used\"", u.n_used);
      w.sample("pagoda:kv_class_blocks", tl + ",state=\"cached\"", u.n_cached);
      w.sample("pagoda:kv_class_blocks", tl + ",state=\"free\"", u.n_free);
    }
  }

  w.family("pagoda:tenant_kv_blocks", "gauge", "KV blocks per tenant and state (tenant=\"\" is the global cache).");
  for (const tenant_kv_usage& t : kv.tenants) {
    const std::string tl = fmt::format("tenant=\"{}\"", escape_label(t.name));
    w.sample("pagoda:tenant_kv_blocks", tl + ",state=\"used\"", t.n_used_blocks);
    w.sample("pagoda:tenant_kv_blocks", tl + ",state=\"cached\"", t.n_cached_blocks);
    w.sample("pagoda:tenant_kv_blocks", tl + ",state=\"side\"", t.n_side_blocks);
  }
  w.family("pagoda:tenant_kv_quota_blocks", "gauge", "Per-tenant KV block quota (tenants with one).");
  for (const tenant_kv_usage& t : kv.tenants)
    if (t.quota_blocks) w.sample("pagoda:tenant_kv_quota_blocks", fmt::format("tenant=\"{}\"", escape_label(t.name)), *t.quota_blocks);

  w.metric("pagoda:prompt_tokens_total", "counter", "Number of prefill tokens processed (admitted prompt tokens).",
           s.n_prompt_tokens);
  w.metric("pagoda:prompt_tokens_computed_total", "counter",
           "Prompt tokens run through the model (prefix-cache misses and recomputation).", s.n_computed_prompt_tokens);
  w.metric("pagoda:generation_tokens_total", "counter", "Number of generation tokens processed.", s.n_generated_tokens);
  // Speculative decoding under vLLM's spec_decode names, one series per drafter.
  auto per_drafter = [&](const char* name, const char* help, auto value) {
    w.family(name, "counter", help);
    for (const auto& [drafter, d] : s.spec_decode)
      w.sample(name, fmt::format("drafter=\"{}\"", drafter), static_cast<double>(value(d)));
  };
  per_drafter("pagoda:spec_decode_num_drafts_total", "Verification steps that carried draft tokens.",
              [](const spec_decode_stats& d) { return d.n_drafts; });
  per_drafter("pagoda:spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
              [](const spec_decode_stats& d) { return d.n_draft_tokens; });
  per_drafter("pagoda:spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted.",
              [](const spec_decode_stats& d) { return d.n_accepted_tokens; });
  w.family("pagoda:spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted, by position in the draft (0: the first).");
  for (const auto& [name, d] : s.spec_decode)
    for (std::size_t i = 0; i < d.accepted_per_pos.size() && d.accepted_per_pos[i] > 0; ++i)
      w.sample("pagoda:spec_decode_num_accepted_tokens_per_pos_total",
               fmt::format("drafter=\"{}\",position=\"{}\"", name, i), static_cast<double>(d.accepted_per_pos[i]));
  per_drafter("pagoda:spec_decode_draft_seconds_total",
              "Seconds of model drafters' draft passes (a step's shared among its drafters by draft tokens).",
              [](const spec_decode_stats& d) { return d.draft_seconds; });
  per_drafter("pagoda:spec_decode_verify_seconds_total",
              "Seconds of the forward passes that verified drafts (the whole batched pass, shared as above).",
              [](const spec_decode_stats& d) { return d.verify_seconds; });
  w.metric("pagoda:kv_policy_compactions_total", "counter",
           "KV policy decisions applied: a sequence's kept tokens compacted, emptied blocks freed.",
           s.n_policy_compactions);
  w.metric("pagoda:kv_policy_evicted_slots_total", "counter", "KV slots freed by KV policies (evicted or merged tokens).",
           s.n_policy_evicted_slots);
  // Sparse reads: what attention read against what it could see (kv_selector.h,
  // kv_read_counts); 1 - read / visible is what a policy saved.
  auto per_policy = [&](const char* name, const char* help, auto value) {
    w.family(name, "counter", help);
    for (const auto& [policy, r] : s.kv_reads)
      for (const auto& [phase, c] : {std::pair{"prompt", &r.prompt}, std::pair{"decode", &r.decode}})
        w.sample(name, fmt::format("policy=\"{}\",phase=\"{}\"", escape_label(policy), phase),
                 static_cast<double>(value(*c)));
  };
  per_policy("pagoda:kv_attention_rows_total",
             "Query rows attention ran (one per token, layer and KV head), by KV policy and phase (prompt or decode).",
             [](const kv_read_counts& r) { return r.rows; });
  per_policy("pagoda:kv_visible_tokens_total", "KV tokens those rows could see, by KV policy and phase.",
             [](const kv_read_counts& r) { return r.tokens_visible; });
  per_policy("pagoda:kv_read_tokens_total",
             "KV tokens those rows read (a sparse read: fewer than visible), by KV policy and phase.",
             [](const kv_read_counts& r) { return r.tokens_read; });
  per_policy("pagoda:kv_visible_blocks_total", "KV blocks holding the tokens those rows could see, by KV policy and phase.",
             [](const kv_read_counts& r) { return r.blocks_visible; });
  per_policy("pagoda:kv_read_blocks_total", "KV blocks holding the tokens those rows read, by KV policy and phase.",
             [](const kv_read_counts& r) { return r.blocks_read; });
  // Retrieval's indexes: every Nth search is checked against the exact top-k
  // (retrieval:recall_every); recall = found / wanted.
  auto per_index = [&](const char* name, const char* help, auto value) {
    w.family(name, "counter", help);
    for (const auto& [index, r] : s.recall_by_index)
      w.sample(name, fmt::format("index=\"{}\"", escape_label(index)), static_cast<double>(value(r)));
  };
  per_index("pagoda:kv_index_searches_total", "Searches of sparse-read indexes (retrieval), by index kind.",
            [](const index_recall& r) { return r.searches; });
  per_index("pagoda:kv_index_recall_wanted_total",
            "Slots of the exact top-k in the sampled searches (the recall check's denominator), by index kind.",
            [](const index_recall& r) { return r.wanted; });
  per_index("pagoda:kv_index_recall_found_total",
            "Of those, slots the index's search returned: recall = found / wanted, by index kind.",
            [](const index_recall& r) { return r.found; });
  w.metric("pagoda:kv_selector_memory_bytes", "gauge",
           "Memory held by running sequences' sparse-read selectors (Quest's key bounds, retrieval's ANN indexes).",
           s.selector_bytes);
  w.metric("pagoda:kv_selector_memory_bytes_peak", "gauge",
           "Most memory the running sequences' sparse-read selectors held at once since start.", s.peak_selector_bytes);
  // Side memory (kv_manager.h, "Side blocks"): paid in pool blocks, which kv_cache_blocks{state="used"} includes.
  w.metric("pagoda:kv_side_blocks", "gauge",
           "KV pool blocks held for side memory (retrieval indexes, policy statistics); part of the used blocks.",
           kv.n_side_blocks);
  w.metric("pagoda:kv_side_blocks_peak", "gauge", "Most KV pool blocks held for side memory at once since start.",
           s.peak_side_blocks);
  w.metric("pagoda:kv_side_memory_bytes", "gauge",
           "Side memory the running sequences' structures report holding (retrieval indexes, key bounds).",
           kv.side_measured_bytes);
  w.metric("pagoda:kv_side_charged_bytes", "gauge",
           "Side memory charged against the KV pool: side blocks times the bytes of a block.",
           static_cast<double>(kv.n_side_blocks) * static_cast<double>(kv.side_block_bytes));
  w.metric("pagoda:engine_steps_total", "counter", "Engine steps (one batched forward pass each).", s.n_steps);
  w.family("pagoda:request_success_total", "counter", "Count of finished requests, by finish reason.");
  for (const char* reason : {"stop", "length", "abort", "grammar"}) {
    auto it = s.n_finished_by_reason.find(reason);
    w.sample("pagoda:request_success_total", fmt::format("finished_reason=\"{}\"", reason),
             it == s.n_finished_by_reason.end() ? 0.0 : static_cast<double>(it->second));
  }
  w.histogram("pagoda:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft_seconds);
  w.histogram("pagoda:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s.itl_seconds);
  w.histogram("pagoda:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", s.e2e_seconds);

  w.family("pagoda:http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [key, count] : http)
    w.sample("pagoda:http_requests_total", fmt::format("endpoint=\"{}\",code=\"{}\"", escape_label(key.first), key.second), count);
  return w.take();
}

std::string render_store_metrics(const store_metrics& m, const std::string& model_name) {
  writer w(model_name);
  const auto per_tier = [&](const char* name, const char* type, const char* help, auto field) {
    w.family(name, type, help);
    for (const store_metrics::tier& t : m.tiers)
      if (const double v = field(t); v >= 0) w.sample(name, fmt::format("tier=\"{}\"", escape_label(t.name)), v);
  };
  const auto d = [](std::int64_t v) { return static_cast<double>(v); };
  per_tier("pagoda:kv_store_hits_total", "counter", "KV blocks found in a tier (memory: the prefix cache).",
           [&](const auto& t) { return d(t.hits); });
  per_tier("pagoda:kv_store_misses_total", "counter", "KV blocks looked for in a tier and not found there.",
           [&](const auto& t) { return d(t.misses); });
  per_tier("pagoda:kv_store_loads_total", "counter", "KV blocks loaded from a store tier into the pool, verified.",
           [&](const auto& t) { return d(t.loads); });
  per_tier("pagoda:kv_store_entries", "gauge", "KV blocks held by a tier (absent: unknown, a shared tier).",
           [&](const auto& t) { return d(t.entries); });
  per_tier("pagoda:kv_store_bytes", "gauge", "Bytes of KV blocks held by a tier (absent: unknown).",
           [&](const auto& t) { return d(t.bytes); });
  per_tier("pagoda:kv_store_capacity_bytes", "gauge", "A tier's size cap (absent: none of its own).",
           [&](const auto& t) { return t.capacity_bytes > 0 ? d(t.capacity_bytes) : -1.0; });
  per_tier("pagoda:kv_store_errors_total", "counter", "Calls a store tier failed (down, I/O error, full).",
           [&](const auto& t) { return d(t.errors); });
  per_tier("pagoda:kv_store_writes_total", "counter", "KV blocks written to a store tier.",
           [&](const auto& t) { return d(t.writes); });
  per_tier("pagoda:kv_store_evictions_total", "counter", "KV blocks a tier dropped for its size cap or TTL.",
           [&](const auto& t) { return d(t.evictions); });
  per_tier("pagoda:kv_store_quarantined_total", "counter",
           "Damaged store files moved aside at open (the tier started empty); see docs/kv-store.md.",
           [&](const auto& t) { return d(t.quarantined); });
  per_tier("pagoda:kv_store_compactions_total", "counter", "Rewrites of a tier's file (after a tenant erase).",
           [&](const auto& t) { return d(t.compactions); });
  w.family("pagoda:kv_store_load_seconds", "histogram", "Seconds to fetch and verify one KV block from a store tier.");
  for (const store_metrics::tier& t : m.tiers)
    if (t.load_seconds) w.histogram_series("pagoda:kv_store_load_seconds", fmt::format("tier=\"{}\"", escape_label(t.name)), *t.load_seconds);
  w.metric("pagoda:kv_store_write_queue_blocks", "gauge", "KV blocks waiting for write-back.", d(m.queue_blocks));
  w.metric("pagoda:kv_store_write_dropped_total", "counter", "KV blocks not written back: the queue was full.", d(m.dropped));
  w.metric("pagoda:kv_store_write_errors_total", "counter", "Write-backs a tier refused.", d(m.write_errors));
  w.metric("pagoda:kv_store_corrupt_total", "counter", "Stored KV blocks that failed verification (never served).", d(m.corrupt));
  w.metric("pagoda:kv_store_forged_total", "counter", "Stored KV blocks that failed their MAC (never served).", d(m.forged));
  w.metric("pagoda:kv_store_load_misses_total", "counter",
           "KV blocks announced by a tier but not delivered (gone, corrupt, tier failed): computed instead.", d(m.load_misses));
  return w.take();
}

std::string render_image_metrics(const image_counters& c, const std::string& model_name) {
  writer w(model_name);
  const auto d = [](std::int64_t v) { return static_cast<double>(v); };
  w.metric("pagoda:images_encoded_total", "counter", "Images encoded by the vision tower (--mmproj).", d(c.n_encoded));
  w.metric("pagoda:image_encode_cache_hits_total", "counter",
           "Images whose encoder output was kept from an earlier request with the same bytes (--image-cache-mb): not "
           "encoded again.",
           d(c.n_cache_hits));
  w.metric("pagoda:images_refused_total", "counter",
           "Image parts refused: not a data: URL, bad base64, not PNG or JPEG, corrupt, over a limit, too many.",
           d(c.n_refused));
  w.metric("pagoda:image_encode_seconds_total", "counter",
           "Seconds spent turning images into embeddings (decoding, preprocessing, the vision tower).", c.encode_seconds);
  w.metric("pagoda:image_prompt_tokens_total", "counter", "Prompt tokens that were images' rows, in answered requests.",
           d(c.n_image_tokens));
  w.metric("pagoda:image_prompt_tokens_cached_total", "counter",
           "Of those, tokens served from the prefix cache (the same image seen before).", d(c.n_cached_image_tokens));
  return w.take();
}

}  // namespace pagoda::server
