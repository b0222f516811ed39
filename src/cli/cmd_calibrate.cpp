// pagoda calibrate: per-layer, per-head, per-channel ranges of K and V on a
// calibration text, for static KV scales (--kv-scales). The text is split and
// truncated as pagoda perplexity does; each document runs through the model
// with an exact (f32) KV cache, and the stored keys (after RoPE, as the cache
// holds them) and values are read back and folded into the ranges.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "quant/kv_scales.h"

namespace pagoda::cli {
namespace {

struct calibrate_options {
  engine_config model;
  std::string file;
  std::string output;
  std::string separator = "<|endoftext|>";
  std::string clip = "max";
  std::int64_t max_tokens = 0;  // 0: every token of the text
};

// "max" -> 100; "p99.9" or "99.9" -> 99.9.
result<double> parse_clip(const std::string& clip) {
  if (clip == "max") return 100.0;
  std::string num = clip.starts_with("p") ? clip.substr(1) : clip;
  char* end = nullptr;
  double p = std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || !(p > 50 && p <= 100))
    return error(errc::invalid_argument, "--clip '{}': expected max or a percentile pNN.N in (50, 100]", clip);
  return p;
}

int calibrate(const calibrate_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(double percentile, parse_clip(o.clip));
  PAGODA_ASSIGN_OR_RETURN_CLI(std::vector<std::string> texts, read_documents(o.file, o.separator));

  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.model));
  const llama_hparams& hp = model->hparams();
  const int n_ctx = context_length(o.model, hp);
  std::vector<std::vector<token_id>> docs;
  std::int64_t n_tokens = 0;
  for (const std::string& t : texts) {
    if (o.max_tokens > 0 && n_tokens >= o.max_tokens) break;
    std::vector<token_id> ids = model->vocab().encode(t, /*add_bos=*/true);
    if (static_cast<int>(ids.size()) > n_ctx) ids.resize(n_ctx);
    if (ids.empty()) continue;
    n_tokens += static_cast<std::int64_t>(ids.size());
    docs.push_back(std::move(ids));
  }

  const int block_size = 16;
  PAGODA_ASSIGN_OR_RETURN_CLI(
      const kv_layout layout,
      with_declared_kv_sharing(hp, kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, block_size, kv_type::f32,
                                                      kv_type::f32)));
  const int n_blocks = (n_ctx + block_size - 1) / block_size;
  PAGODA_ASSIGN_OR_RETURN_CLI(auto storage, kv_storage::create(layout, n_blocks));
  llama_context ctx(*model, *storage, o.model.n_threads);
  std::vector<block_id> table;
  for (int b = 0; b < n_blocks; ++b) table.push_back(block_id(b));

  kv_range_calibrator cal(hp.n_layer, hp.n_head_kv, hp.head_dim, percentile, n_tokens);
  std::vector<float> logits, x;
  progress_bar bar("calibrate", static_cast<std::int64_t>(docs.size()));
  std::int64_t done = 0;
  for (const auto& ids : docs) {
    const int n = static_cast<int>(ids.size());
    for (int pos = 0; pos < n; pos += 2048) {
      forward_seq s;
      s.tokens = std::span(ids).subspan(pos, std::min(2048, n - pos));
      s.n_stored = pos;
      s.blocks = table;
      if (auto st = ctx.forward({&s, 1}, logits); !st.ok()) return fail(st);
    }
    // Read the exact cache back: x[n][n_kv_heads][head_dim] per layer, K and V.
    x.resize(static_cast<std::size_t>(n) * hp.kv_dim());
    for (int l = 0; l < hp.n_layer; ++l)
      for (kv_role role : {kv_role::key, kv_role::value}) {
        // A layer that reads a shared KV layer gets its ranges (the scales keep the producers' rows).
        const int j = layout.kv_layer_of(l);
        paged_kv_view v = role == kv_role::key ? storage->k_view(j, table, n) : storage->v_view(j, table, n);
        std::vector<float> row(hp.head_dim);
        for (int p = 0; p < n; ++p)
          for (int h = 0; h < hp.n_head_kv; ++h) {
            v.codec->decode(v.format, v.shape, nullptr, v.tile(p / block_size, h), p % block_size, 1, row.data());
            std::copy(row.begin(), row.end(), x.begin() + (static_cast<std::ptrdiff_t>(p) * hp.n_head_kv + h) * hp.head_dim);
          }
        cal.add(l, role, x.data(), n);
      }
    bar.update(++done);
  }
  bar.finish();
  kv_scales scales = cal.finish();
  scales.model = hp.name.empty() ? o.model.model_path : hp.name;
  if (auto st = save_kv_scales(scales, o.output); !st.ok()) return fail(st);
  std::fprintf(stderr, "pagoda: calibrated K/V ranges of %d layers x %d heads x %d channels on %lld tokens "
               "(%zu documents, clip %s) -> %s\n", hp.n_layer, hp.n_head_kv, hp.head_dim,
               static_cast<long long>(scales.n_tokens), docs.size(), scales.clip.c_str(), o.output.c_str());
  return 0;
}

}  // namespace

void register_calibrate(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<calibrate_options>();
  CLI::App* cmd = app.add_subcommand("calibrate", "measure K/V ranges on a text for static KV scales (--kv-scales)");
  add_model_options(cmd, opts->model);
  cmd->add_option("-f,--file", opts->file, "calibration text")->required();
  cmd->add_option("-o,--output", opts->output, "scales file to write (JSON)")->required();
  cmd->add_option("--separator", opts->separator, "document separator (default <|endoftext|>)");
  cmd->add_option("--clip", opts->clip,
                  "range per channel: max (every value fits) or pNN.N (clip to the NN.N percentile at both ends)");
  cmd->add_option("--max-tokens", opts->max_tokens, "stop after this many tokens (0: all)")->check(CLI::NonNegativeNumber);
  cmd->callback([opts, &action] { action = [opts] { return calibrate(*opts); }; });
}

}  // namespace pagoda::cli
