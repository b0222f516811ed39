#include "kv/kv_metrics.h"

#include <fmt/format.h>

namespace pagoda {

namespace {
double ratio(double num, double den) { return den > 0 ? num / den : 0.0; }
}  // namespace

const char* eviction_reason_name(eviction_reason r) {
  switch (r) {
    case eviction_reason::capacity: return "capacity";
    case eviction_reason::quota: return "quota";
    case eviction_reason::admin: return "admin";
  }
  return "unknown";
}

double kv_metrics::usage() const { return ratio(n_blocks_used, n_blocks_total); }

double kv_metrics::fragmentation() const {
  const double slots = static_cast<double>(n_blocks_used) * static_cast<double>(block_size_tokens);
  return slots > 0 ? 1.0 - static_cast<double>(n_stored_tokens) / slots : 0.0;
}

double kv_metrics::prefix_hit_ratio() const {
  return ratio(static_cast<double>(n_prefix_hit_tokens), static_cast<double>(n_prefix_query_tokens));
}

std::string format_kv_metrics(const kv_metrics& m) {
  std::string out = fmt::format(
      "kv: {}/{} blocks used ({:.1f}%), {} cached, {} free, peak {}, frag {:.1f}%, prefix hits {}/{} tokens "
      "({:.1f}%), {} evictions ({} capacity, {} quota, {} admin), {} preemptions, {} cow copies",
      m.n_blocks_used, m.n_blocks_total, 100.0 * m.usage(), m.n_blocks_cached, m.n_blocks_free,
      m.n_blocks_used_peak, 100.0 * m.fragmentation(), m.n_prefix_hit_tokens, m.n_prefix_query_tokens,
      100.0 * m.prefix_hit_ratio(), m.n_evictions, m.n_evictions_by_reason[0], m.n_evictions_by_reason[1],
      m.n_evictions_by_reason[2], m.n_preemptions, m.n_cow_copies);
  if (m.groups.size() > 1) {
    for (std::size_t g = 1; g < m.groups.size(); ++g) {
      const kv_group_usage& k = m.groups[g];
      out += fmt::format("; group {} ({}", g, k.kind);
      if (k.window_tokens > 0) out += fmt::format(" {}", k.window_tokens);
      out += fmt::format(") {}/{} used {} cached", k.n_used, k.n_blocks, k.n_cached);
    }
  }
  if (m.classes.size() > 1) {
    for (std::size_t c = 0; c < m.classes.size(); ++c) {
      const kv_class_usage& k = m.classes[c];
      out += fmt::format("; class {} {}/{} used {} cached", c, k.n_used, k.n_blocks, k.n_cached);
    }
  }
  for (const tenant_kv_usage& t : m.tenants) {
    if (t.name.empty() && t.n_used_blocks == 0 && t.n_cached_blocks == 0) continue;
    out += fmt::format("; tenant '{}' {} used {} cached", t.name, t.n_used_blocks, t.n_cached_blocks);
    if (t.quota_blocks) out += fmt::format(" of quota {}", *t.quota_blocks);
  }
  return out;
}

}  // namespace pagoda
