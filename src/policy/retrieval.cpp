#include "policy/retrieval.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <string>
#include <string_view>

#include "policy/retrieval_build.h"

namespace pagoda {
namespace {

constexpr const char* k_known_params =
    "index, auto_min, exact_max, k, sinks, recent, max_tokens, background, recall_every, m, ef_construction, ef_search, nlist, "
    "pq_m, nbits, nprobe, train";

result<int> parse_int(std::string_view key, std::string_view v, int lo, int hi) {
  int x = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < lo || x > hi)
    return error(errc::invalid_argument, "retrieval: {}={}: expected an integer in [{}, {}]", key, v, lo, hi);
  return x;
}

// k: a count ("128"), a fraction ("0.01") or a percentage ("1%").
status parse_k(std::string_view v, retrieval_params& p) {
  const bool percent = !v.empty() && v.back() == '%';
  const std::string_view num = percent ? v.substr(0, v.size() - 1) : v;
  const bool integral = !percent && num.find_first_not_of("0123456789") == std::string_view::npos;
  if (integral) {
    auto r = parse_int("k", v, 1, 1 << 24);
    if (!r.ok()) return r.error();
    p.k_tokens = *r;
    p.k_fraction = 0;
    return {};
  }
  double x = 0;
  auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), x);
  if (percent) x /= 100.0;
  if (num.empty() || ec != std::errc() || end != num.data() + num.size() || !(x > 0.0 && x <= 1.0))
    return error(errc::invalid_argument, "retrieval: k={}: expected a count (128), a fraction in (0, 1] or a percentage (1%)", v);
  p.k_tokens = 0;
  p.k_fraction = x;
  return {};
}

status parse_index_kind(std::string_view v, retrieval_params& p) {
  if (v == "auto") p.index = retrieval_index_kind::auto_;
  else if (v == "hnsw") p.index = retrieval_index_kind::hnsw;
  else if (v == "ivfpq") p.index = retrieval_index_kind::ivfpq;
  else if (v == "exact") p.index = retrieval_index_kind::exact;
  else return error(errc::invalid_argument, "retrieval: index={}: expected auto, exact, ivfpq or hnsw", v);
  return {};
}

// The int field a key names, with its bounds and the index it applies to
// (nullptr: any index; "ivfpq" also accepts auto, which builds IVF-PQ).
struct int_param {
  const char* key;
  int retrieval_params::*field = nullptr;
  int hnsw_params::*hnsw_field = nullptr;
  int ivfpq_params::*ivfpq_field = nullptr;
  int lo, hi;
};

constexpr int_param k_int_params[] = {
    {"sinks", &retrieval_params::sinks, nullptr, nullptr, 0, 1 << 20},
    {"recent", &retrieval_params::recent, nullptr, nullptr, 1, 1 << 20},
    {"max_tokens", &retrieval_params::max_tokens, nullptr, nullptr, 1, 1 << 16},
    {"recall_every", &retrieval_params::recall_every, nullptr, nullptr, 0, 1 << 30},
    {"exact_max", &retrieval_params::exact_max, nullptr, nullptr, 0, 1 << 30},
    {"m", nullptr, &hnsw_params::m, nullptr, 2, 256},
    {"ef_construction", nullptr, &hnsw_params::ef_construction, nullptr, 1, 4096},
    {"ef_search", nullptr, &hnsw_params::ef_search, nullptr, 1, 65536},
    {"nlist", nullptr, nullptr, &ivfpq_params::nlist, 1, 65536},
    {"pq_m", nullptr, nullptr, &ivfpq_params::m, 1, 4096},
    {"nbits", nullptr, nullptr, &ivfpq_params::nbits, 1, 12},
    {"nprobe", nullptr, nullptr, &ivfpq_params::nprobe, 1, 65536},
    {"train", nullptr, nullptr, &ivfpq_params::n_train, 0, 1 << 22},
};

// Parses one key=value into p; names the index a key needs in *needs.
status parse_param(std::string_view key, std::string_view value, retrieval_params& p, const char** needs) {
  if (key == "index") return parse_index_kind(value, p);
  if (key == "k") return parse_k(value, p);
  if (key == "auto_min") {
    auto r = parse_int(key, value, 0, 1 << 30);
    if (!r.ok()) return r.error();
    p.auto_min = *r;
    *needs = "auto";
    return {};
  }
  if (key == "background") {
    if (value != "0" && value != "1") return error(errc::invalid_argument, "retrieval: background={}: expected 0 or 1", value);
    p.background = value == "1";
    return {};
  }
  for (const int_param& ip : k_int_params) {
    if (key != ip.key) continue;
    auto r = parse_int(key, value, ip.lo, ip.hi);
    if (!r.ok()) return r.error();
    if (ip.field) p.*ip.field = *r;
    if (ip.hnsw_field) {
      p.hnsw.*ip.hnsw_field = *r;
      *needs = "hnsw";
    }
    if (ip.ivfpq_field) {
      p.ivfpq.*ip.ivfpq_field = *r;
      *needs = "ivfpq";
    }
    return {};
  }
  return error(errc::invalid_argument, "retrieval: unknown parameter '{}'; known: {}", key, k_known_params);
}

const char* index_kind_name(retrieval_index_kind k) {
  switch (k) {
    case retrieval_index_kind::auto_: return "auto";
    case retrieval_index_kind::hnsw: return "hnsw";
    case retrieval_index_kind::ivfpq: return "ivfpq";
    case retrieval_index_kind::exact: return "exact";
  }
  return "?";
}

class retrieval_policy final : public kv_policy {
 public:
  retrieval_policy(kv_policy_spec spec, retrieval_params p) : spec_(std::move(spec)), params_(p) {}
  const kv_policy_spec& spec() const override { return spec_; }
  std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) override {
    return std::make_unique<retrieval_selector>(params_, n_layers, n_kv_heads, head_dim);
  }
  side_charge side_memory(int n_layers, int n_kv_heads, int head_dim) const override {
    return retrieval_side_memory(params_, n_layers, n_kv_heads, head_dim);
  }

 private:
  kv_policy_spec spec_;
  retrieval_params params_;
};

}  // namespace

int divisor_at_most(int n, int m) {
  for (int d = std::min(n, m); d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

int retrieval_params::index_from() const {
  switch (index) {
    case retrieval_index_kind::auto_: return std::max(auto_min, ivfpq.resolved_n_train());
    case retrieval_index_kind::ivfpq: return ivfpq.resolved_n_train();
    case retrieval_index_kind::hnsw: return 0;
    case retrieval_index_kind::exact: break;
  }
  return INT_MAX;
}

side_charge retrieval_side_memory(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim) {
  const std::int64_t hd = head_dim;
  const std::int64_t rows = static_cast<std::int64_t>(n_layers) * n_kv_heads;
  // The key copy: whole chunks of 256 f16 rows, and their pointers.
  std::int64_t fixed = 256 * hd * 2 + 256, per_token = hd * 2 + 1;
  // Outside the rows: the liveness of each slot per layer (doubled), and the
  // builder's keys of one (layer, KV head) job (its first job holds every
  // sealed key of the head as f32, doubled).
  std::int64_t fixed_all = std::int64_t{1} << 16, per_token_all = 2 * static_cast<std::int64_t>(n_layers);
  if (p.index != retrieval_index_kind::exact) per_token_all += 2 * (hd * 4 + 4);
  switch (p.index) {
    case retrieval_index_kind::hnsw: {
      const std::int64_t m = p.hnsw.m;
      // hnswlib's per-element record (level-0 links, the f16 point and its
      // extra f32, the label), link-list pointer, level, lock and visited mark.
      const std::int64_t element = (2 * m * 4 + 4) + (hd * 2 + 4) + 8 + 8 + 4 + 40 + 2;
      const std::int64_t upper_links = (m * 4 + 4) * 2 / std::max<std::int64_t>(m - 1, 1) + 1;
      const std::int64_t label = 28 + 2 * 8;  // a map node, and up to two buckets
      fixed += 1024 * element + 64 * (m * 4 + 4) + 4096;
      per_token += 2 * element + upper_links + label;
      break;
    }
    case retrieval_index_kind::auto_:
    case retrieval_index_kind::ivfpq: {
      const ivfpq_params& q = p.ivfpq;
      const std::int64_t pq_m = divisor_at_most(head_dim, q.m);
      fixed += static_cast<std::int64_t>(q.nlist) * (hd * 4 + 64)  // coarse centroids, list headers
               + (std::int64_t{1} << q.nbits) * hd * 4 + 4096;      // the PQ codebooks
      per_token += 2 * (pq_m * q.nbits / 8 + 1 + 8);                 // codes and ids at doubling capacities
      fixed_all += static_cast<std::int64_t>(q.resolved_n_train()) * hd * 4;  // the builder's training sample
      break;
    }
    case retrieval_index_kind::exact: break;
  }
  return side_charge{rows * fixed + fixed_all, rows * per_token + per_token_all};
}

int retrieval_params::resolve_k(int n_kv) const {
  if (k_tokens > 0) return k_tokens;
  return std::max(1, static_cast<int>(std::ceil(k_fraction * n_kv)));
}

result<retrieval_params> parse_retrieval_params(const kv_policy_spec& spec) {
  retrieval_params p;
  std::vector<std::pair<std::string, const char*>> index_specific;  // key, the index it needs
  for (const auto& [key, value] : spec.params) {
    const char* needs = nullptr;
    if (status s = parse_param(key, value, p, &needs); !s.ok()) return s;
    if (needs) index_specific.emplace_back(key, needs);
  }
  for (const auto& [key, needs] : index_specific)
    if (std::string_view(needs) != index_kind_name(p.index) &&
        !(std::string_view(needs) == "ivfpq" && p.index == retrieval_index_kind::auto_))
      return error(errc::invalid_argument, "retrieval: {} applies to index={}, not index={}", key, needs,
                   index_kind_name(p.index));
  if (p.index == retrieval_index_kind::hnsw)
    if (status s = check_hnsw_params(p.hnsw); !s.ok()) return s;
  if (p.index == retrieval_index_kind::ivfpq || p.index == retrieval_index_kind::auto_)
    if (status s = check_ivfpq_params(p.ivfpq, 0); !s.ok()) return s;
  return p;
}

result<std::unique_ptr<kv_policy>> make_retrieval_policy(const kv_policy_spec& spec) {
  auto p = parse_retrieval_params(spec);
  if (!p.ok()) return p.error();
  return std::unique_ptr<kv_policy>(std::make_unique<retrieval_policy>(spec, *p));
}

}  // namespace pagoda
