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
    for (std::size_t i = 0; i < h.bounds.size(); ++i)
      sample(fmt::format("{}_bucket", name), fmt::format("le=\"{}\"", number(h.bounds[i])),
             static_cast<double>(h.cumulative_counts[i]));
    sample(fmt::format("{}_bucket", name), "le=\"+Inf\"", static_cast<double>(h.count));
    sample(fmt::format("{}_sum", name), "", h.sum);
    sample(fmt::format("{}_count", name), "", static_cast<double>(h.count));
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
  w.metric("pagoda:kv_cache_evictions_total", "counter", "Cached KV blocks evicted to make room.", kv.n_evictions);
  w.metric("pagoda:kv_cache_cow_copies_total", "counter", "KV blocks copied on write (n > 1 forks).", kv.n_cow_copies);

  w.family("pagoda:tenant_kv_blocks", "gauge", "KV blocks per tenant and state (tenant=\"\" is the global cache).");
  for (const tenant_kv_usage& t : kv.tenants) {
    const std::string tl = fmt::format("tenant=\"{}\"", escape_label(t.name));
    w.sample("pagoda:tenant_kv_blocks", tl + ",state=\"used\"", t.n_used_blocks);
    w.sample("pagoda:tenant_kv_blocks", tl + ",state=\"cached\"", t.n_cached_blocks);
  }
  w.family("pagoda:tenant_kv_quota_blocks", "gauge", "Per-tenant KV block quota (tenants with one).");
  for (const tenant_kv_usage& t : kv.tenants)
    if (t.quota_blocks) w.sample("pagoda:tenant_kv_quota_blocks", fmt::format("tenant=\"{}\"", escape_label(t.name)), *t.quota_blocks);

  w.metric("pagoda:prompt_tokens_total", "counter", "Number of prefill tokens processed (admitted prompt tokens).",
           s.n_prompt_tokens);
  w.metric("pagoda:prompt_tokens_computed_total", "counter",
           "Prompt tokens run through the model (prefix-cache misses and recomputation).", s.n_computed_prompt_tokens);
  w.metric("pagoda:generation_tokens_total", "counter", "Number of generation tokens processed.", s.n_generated_tokens);
  w.metric("pagoda:engine_steps_total", "counter", "Engine steps (one batched forward pass each).", s.n_steps);
  w.family("pagoda:request_success_total", "counter", "Count of finished requests, by finish reason.");
  for (const char* reason : {"stop", "length", "abort"}) {
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

}  // namespace pagoda::server
