#include "server/server_log.h"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace pagoda::server {

spdlog::logger& server_logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::get("pagoda");
    if (!l) l = spdlog::stderr_logger_mt("pagoda");
    l->set_pattern("%Y-%m-%d %H:%M:%S.%e %l %v");
    l->flush_on(spdlog::level::info);
    return l;
  }();
  return *logger;
}

std::string access_error_code(std::string_view body) {
  for (std::string_view field : {std::string_view(R"("code":")"), std::string_view(R"("type":")")}) {
    const std::size_t at = body.find(field);
    if (at == std::string_view::npos) continue;
    const std::size_t start = at + field.size(), end = body.find('"', start);
    if (end != std::string_view::npos && end - start <= 64) return std::string(body.substr(start, end - start));
  }
  return {};
}

std::string format_access(const access_entry& e) {
  // The target as sent, cut and with control bytes escaped: a log line is one line.
  std::string target;
  for (char c : std::string_view(e.target).substr(0, 200)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f || c == '"') target += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else target += c;
  }
  std::string line = fmt::format("{} \"{} {} HTTP/1.{}\" {}", e.remote.empty() ? "-" : e.remote,
                                 e.method.empty() ? "-" : e.method.substr(0, 16), target.empty() ? "-" : target,
                                 e.version == 10 ? 0 : 1, e.status);
  if (!e.tenant.empty()) line += fmt::format(" tenant={}", e.tenant);
  if (e.prompt_tokens >= 0)
    line += fmt::format(" prompt={} cached={} completion={}", e.prompt_tokens, std::max(e.cached_tokens, 0),
                        std::max(e.completion_tokens, 0));
  if (!e.kv_type.empty()) line += fmt::format(" kv={}", e.kv_type);
  if (!e.kv_policy.empty()) line += fmt::format(" policy={}", e.kv_policy);
  if (e.ttft_ms >= 0) line += fmt::format(" ttft={:.1f}ms", e.ttft_ms);
  if (!e.error.empty()) line += fmt::format(" error={}", e.error.substr(0, 64));
  line += fmt::format(" {:.1f}ms", e.duration_ms);
  return line;
}

std::string stats_reporter::next(const engine_snapshot& s, std::chrono::steady_clock::time_point now) {
  const std::int64_t queries = s.kv.n_prefix_query_tokens, hits = s.kv.n_prefix_hit_tokens;
  std::string line;
  if (primed_) {
    const double dt = std::chrono::duration<double>(now - last_time_).count();
    const std::int64_t d_prompt = s.n_prompt_tokens - last_prompt_, d_gen = s.n_generated_tokens - last_generated_;
    const std::int64_t d_queries = queries - last_queries_, d_hits = hits - last_hits_;
    if (dt > 0 && (d_prompt > 0 || d_gen > 0 || s.n_running > 0 || s.n_waiting > 0))
      line = fmt::format("engine: prompt {:.1f} tok/s, generation {:.1f} tok/s, running {}, waiting {}, KV {:.1f}% used, "
                         "prefix hits {:.1f}% (interval), {:.1f}% (all)",
                         static_cast<double>(d_prompt) / dt, static_cast<double>(d_gen) / dt, s.n_running, s.n_waiting,
                         100.0 * s.kv.usage(),
                         d_queries > 0 ? 100.0 * static_cast<double>(d_hits) / static_cast<double>(d_queries) : 0.0,
                         100.0 * s.kv.prefix_hit_ratio());
  }
  primed_ = true;
  last_time_ = now;
  last_prompt_ = s.n_prompt_tokens;
  last_generated_ = s.n_generated_tokens;
  last_queries_ = queries;
  last_hits_ = hits;
  return line;
}

}  // namespace pagoda::server
