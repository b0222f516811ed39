#include "cli/common.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "quant/kv_format_spec.h"
#include "quant/kv_scales.h"

namespace pagoda::cli {

void add_model_options(CLI::App* app, model_options& opts) {
  app->add_option("-m,--model", opts.path, "GGUF model file")->required();
  app->add_option("-t,--threads", opts.threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app->add_option("-c,--ctx", opts.ctx, "context length in tokens (default: the model's)")->check(CLI::Range(0, 1 << 24));
}

void add_kv_options(CLI::App* app, kv_options& opts) {
  app->add_option("--kv-cache-dtype", opts.dtype,
                  "KV cache type for K and V: auto (the model's float type), f32, f16, bf16, fp8 (fp8_e4m3), "
                  "fp8_e5m2, int8, int4, int2, q8_0, q4_0; TYPE/MODE picks the scale granularity (token, "
                  "channel, gN, static, none); pairs: k8v4 or int8+int4/token");
  app->add_option("--cache-type-k", opts.type_k, "KV cache type for keys (also -ctk)");
  app->add_option("--cache-type-v", opts.type_v, "KV cache type for values (also -ctv)");
  app->add_option("--kv-layer-types", opts.layer_types,
                  "per-layer KV types, later rules win: e.g. \"0-1:f16,2-:int4\" or \"0:k8v8,1-:k4v2\"");
  app->add_option("--kv-scales", opts.scales_path,
                  "calibrated KV ranges (pagoda calibrate); quantized types without a mode use them");
  app->add_option("--block-size", opts.block_size, "tokens per KV block")->check(CLI::Range(1, 1024));
  app->add_option("--kv-cache-size", opts.cache_size_mib, "KV pool size in MiB")->check(CLI::PositiveNumber);
  app->add_option("--max-kv-tokens", opts.max_kv_tokens, "KV pool size in tokens")->check(CLI::PositiveNumber);
}

result<std::unique_ptr<llama_model>> load_model(const model_options& opts) { return llama_model::load(opts.path); }

int context_length(const model_options& opts, const llama_hparams& hp) {
  return opts.ctx > 0 ? opts.ctx : hp.n_ctx_train;
}

result<kv_layout> make_kv_layout(const llama_model& model, const kv_options& opts) {
  const llama_hparams& hp = model.hparams();
  // "auto" follows the weights, as vLLM's "auto" does: an f32 model keeps an f32
  // cache (bitwise reproducible); anything else gets f16 (vLLM's and llama.cpp's default).
  const kv_type auto_type = model.layers().front().wq.type == gguf::tensor_type::f32 ? kv_type::f32 : kv_type::f16;
  auto spec_of = [&](const std::string& text, const char* what) -> result<kv_format_spec> {
    if (text == "auto") return kv_format_spec{auto_type, std::nullopt, 0};
    auto s = parse_kv_format_spec(text);
    if (!s.ok()) return s.error().with_context(what);
    return s;
  };
  kv_pair_spec base;
  if (opts.dtype == "auto") {
    base.k = base.v = kv_format_spec{auto_type, std::nullopt, 0};
  } else {
    auto p = parse_kv_pair_spec(opts.dtype);
    if (!p.ok()) return p.error().with_context("--kv-cache-dtype");
    base = *p;
  }
  if (!opts.type_k.empty()) {
    PAGODA_ASSIGN_OR_RETURN(base.k, spec_of(opts.type_k, "--cache-type-k"));
  }
  if (!opts.type_v.empty()) {
    PAGODA_ASSIGN_OR_RETURN(base.v, spec_of(opts.type_v, "--cache-type-v"));
  }
  std::vector<kv_pair_spec> per_layer(hp.n_layer, base);
  if (!opts.layer_types.empty()) {
    PAGODA_ASSIGN_OR_RETURN(std::vector<kv_layer_rule> rules, parse_kv_layer_rules(opts.layer_types));
    for (const kv_layer_rule& r : rules) {
      int last = r.last < 0 ? hp.n_layer - 1 : r.last;
      if (r.first >= hp.n_layer || last >= hp.n_layer)
        return error(errc::invalid_argument, "--kv-layer-types: layer range {}-{} is past the model's {} layers",
                     r.first, last, hp.n_layer);
      for (int l = r.first; l <= last; ++l) per_layer[l] = r.spec;
    }
  }
  kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, opts.block_size, kv_type::f32, kv_type::f32);
  if (!opts.scales_path.empty()) {
    PAGODA_ASSIGN_OR_RETURN(kv_scales scales, load_kv_scales(opts.scales_path));
    PAGODA_RETURN_IF_ERROR(scales.check_shape(hp.n_layer, hp.n_head_kv, hp.head_dim).with_context(opts.scales_path));
    layout.scales = std::make_shared<const kv_scales>(std::move(scales));
  }
  for (int l = 0; l < hp.n_layer; ++l) {
    layout.k_formats[l] = per_layer[l].k.resolve(kv_role::key, layout.scales != nullptr);
    layout.v_formats[l] = per_layer[l].v.resolve(kv_role::value, layout.scales != nullptr);
  }
  PAGODA_RETURN_IF_ERROR(layout.check());
  return layout;
}

result<std::int64_t> pool_blocks(const kv_layout& layout, const kv_options& opts, std::int64_t default_tokens,
                                 std::int64_t n_seqs) {
  std::int64_t blocks;
  if (opts.cache_size_mib > 0) {
    double bytes = opts.cache_size_mib * 1024.0 * 1024.0 -
                   static_cast<double>(layout.staging_bytes_per_slot()) * std::max<std::int64_t>(n_seqs, 1) -
                   static_cast<double>(layout.static_bytes());
    blocks = static_cast<std::int64_t>(std::max(bytes, 0.0) / static_cast<double>(layout.bytes_per_block()));
    if (blocks < 1)
      return error(errc::invalid_argument, "--kv-cache-size {} MiB is smaller than one KV block ({})",
                   opts.cache_size_mib, human_bytes(static_cast<double>(layout.bytes_per_block())));
  } else {
    std::int64_t tokens = opts.max_kv_tokens > 0 ? opts.max_kv_tokens : default_tokens;
    blocks = (tokens + layout.block_size - 1) / layout.block_size;
  }
  return blocks;
}

std::vector<std::string> split_documents(const std::string& text, const std::string& sep) {
  std::vector<std::string> docs;
  auto trim = [](std::string s) {
    std::size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t at = sep.empty() ? std::string::npos : text.find(sep, start);
    std::string doc = trim(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (!doc.empty()) docs.push_back(std::move(doc));
    if (at == std::string::npos) break;
    start = at + sep.size();
  }
  return docs;
}

result<std::vector<std::string>> read_documents(const std::string& path, const std::string& sep) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(errc::not_found, "cannot open {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<std::string> docs = split_documents(ss.str(), sep);
  if (docs.empty()) return error(errc::invalid_argument, "{} holds no documents", path);
  return docs;
}

void normalize_args(int& argc, char**& argv) {
  static std::vector<std::string> storage;
  static std::vector<char*> ptrs;
  storage.assign(argv, argv + argc);
  for (std::string& a : storage) {
    if (a == "-ctk") a = "--cache-type-k";
    else if (a == "-ctv") a = "--cache-type-v";
  }
  ptrs.clear();
  for (std::string& a : storage) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  argv = ptrs.data();
}

progress_bar::progress_bar(std::string label, std::int64_t total)
    : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1 && total > 0) {}

void progress_bar::update(std::int64_t done) {
  if (!enabled_) return;
  int pct = static_cast<int>(100 * done / total_);
  if (pct == last_percent_) return;
  last_percent_ = pct;
  constexpr int k_width = 40;
  int filled = pct * k_width / 100;
  std::fprintf(stderr, "\r%s [%.*s%*s] %3d%% (%lld/%lld)", label_.c_str(), filled,
               "########################################", k_width - filled, "", pct,
               static_cast<long long>(done), static_cast<long long>(total_));
  std::fflush(stderr);
}

void progress_bar::finish() {
  if (!enabled_) return;
  std::fprintf(stderr, "\r%*s\r", 80 + static_cast<int>(label_.size()), "");
  std::fflush(stderr);
}

int fail(const status& st) {
  std::fprintf(stderr, "pagoda: error: %s\n", st.message().c_str());
  return 1;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", bytes, units[u]) : fmt::format("{:.2f} {}", bytes, units[u]);
}

}  // namespace pagoda::cli
