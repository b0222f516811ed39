#include "cli/common.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace pagoda::cli {

void add_model_options(CLI::App* app, model_options& opts) {
  app->add_option("-m,--model", opts.path, "GGUF model file")->required();
  app->add_option("-t,--threads", opts.threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app->add_option("-c,--ctx", opts.ctx, "context length in tokens (default: the model's)")->check(CLI::Range(0, 1 << 24));
}

void add_kv_options(CLI::App* app, kv_options& opts) {
  app->add_option("--kv-cache-dtype", opts.dtype,
                  "KV cache element type for K and V (auto, f32, f16, ...; auto = the model's float type)");
  app->add_option("--cache-type-k", opts.type_k, "KV cache type for keys (also -ctk)");
  app->add_option("--cache-type-v", opts.type_v, "KV cache type for values (also -ctv)");
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
  kv_type auto_type = model.layers().front().wq.type == gguf::tensor_type::f32 ? kv_type::f32 : kv_type::f16;
  auto pick = [&](const std::string& override_name) -> result<kv_type> {
    std::string name = override_name.empty() ? opts.dtype : override_name;
    if (name == "auto") return auto_type;
    return parse_kv_type(name);
  };
  PAGODA_ASSIGN_OR_RETURN(kv_type k, pick(opts.type_k));
  PAGODA_ASSIGN_OR_RETURN(kv_type v, pick(opts.type_v));
  return kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, opts.block_size, k, v);
}

result<std::int64_t> pool_blocks(const kv_layout& layout, const kv_options& opts, std::int64_t default_tokens) {
  std::int64_t blocks;
  if (opts.cache_size_mib > 0) {
    double bytes = opts.cache_size_mib * 1024.0 * 1024.0;
    blocks = static_cast<std::int64_t>(bytes / static_cast<double>(layout.bytes_per_block()));
    if (blocks < 1)
      return error(errc::invalid_argument, "--kv-cache-size {} MiB is smaller than one KV block ({})",
                   opts.cache_size_mib, human_bytes(static_cast<double>(layout.bytes_per_block())));
  } else {
    std::int64_t tokens = opts.max_kv_tokens > 0 ? opts.max_kv_tokens : default_tokens;
    blocks = (tokens + layout.block_size - 1) / layout.block_size;
  }
  return blocks;
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
