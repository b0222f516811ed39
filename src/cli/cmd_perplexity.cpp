// pagoda perplexity: mean negative log-likelihood of a text, one document per
// separator, each BOS-prefixed and truncated at the context length. Each
// document is one request to the engine (max_tokens 0, prompt logits), so
// documents are scored several at a time in batched steps, with the engine's
// KV pool, scheduling and chunked prefill.
//
// --kl-divergence runs a second engine in the same process with an exact (f32)
// KV cache over the same requests, and reports the mean KL(exact ||
// configured) of the next-token distributions, how often their top-1 tokens
// agree, and the perplexity change.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include <map>

#include "sched/engine_core.h"
#include "core/clock.h"

namespace pagoda::cli {
namespace {

struct ppl_options {
  engine_config config;
  std::string file;
  std::string separator = "<|endoftext|>";
  int batch_tokens = 2048;  // tokens per forward step, across documents
  int max_seqs = 16;        // documents in flight at once
  bool json = false;
  bool kl_divergence = false;
};

// log softmax(logits) in double.
void log_softmax(const float* logits, int n_vocab, std::vector<double>& out) {
  float mx = logits[0];
  for (int i = 1; i < n_vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double log_sum = std::log(sum);
  out.resize(n_vocab);
  for (int i = 0; i < n_vocab; ++i) out[i] = static_cast<double>(logits[i]) - mx - log_sum;
}

// -log softmax(logits)[target], in double.
double nll(const float* logits, int n_vocab, token_id target) {
  float mx = logits[0];
  for (int i = 1; i < n_vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  return std::log(sum) - (static_cast<double>(logits[target]) - mx);
}

// The exact-vs-configured comparison of --kl-divergence, accumulated per predicted token.
struct kl_stats {
  double sum_kl = 0;
  double sum_nll_exact = 0;
  std::int64_t top1_agree = 0;
  std::int64_t n = 0;
  std::vector<double> lp, lq;

  void add(const float* exact, const float* quant, int n_vocab, token_id target) {
    log_softmax(exact, n_vocab, lp);
    log_softmax(quant, n_vocab, lq);
    double kl = 0;
    int top_p = 0, top_q = 0;
    for (int i = 0; i < n_vocab; ++i) {
      kl += std::exp(lp[i]) * (lp[i] - lq[i]);
      if (lp[i] > lp[top_p]) top_p = i;
      if (lq[i] > lq[top_q]) top_q = i;
    }
    sum_kl += std::max(kl, 0.0);
    sum_nll_exact -= lp[target];
    top1_agree += top_p == top_q;
    ++n;
  }
};

// The rows one engine produced, per (document, position), until both sides have them.
using row_map = std::map<std::pair<int, int>, std::vector<float>>;

int perplexity(const ppl_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(std::vector<std::string> texts, read_documents(o.file, o.separator));

  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.config));
  const llama_hparams& hp = model->hparams();
  const int n_ctx = context_length(o.config, hp);
  std::vector<std::vector<token_id>> docs;
  std::size_t n_cut = 0;
  for (const std::string& t : texts) {
    std::vector<token_id> ids = model->vocab().encode(t, /*add_bos=*/true);
    if (static_cast<int>(ids.size()) > n_ctx) {
      ids.resize(n_ctx);
      ++n_cut;
    }
    if (ids.size() >= 2) docs.push_back(std::move(ids));
  }

  engine_config cfg = o.config;
  cfg.max_num_seqs = o.max_seqs;
  cfg.max_num_batched_tokens = std::max(o.batch_tokens, 1);
  cfg.enable_prefix_caching = false;  // every position is scored, so every position is computed
  const std::int64_t max_live = std::min<std::int64_t>(o.max_seqs, static_cast<std::int64_t>(docs.size()));
  if (cfg.kv_cache_size_mib <= 0 && cfg.max_kv_tokens <= 0) cfg.max_kv_tokens = max_live * (n_ctx + cfg.block_size);
  PAGODA_ASSIGN_OR_RETURN_CLI(engine_core_config core_cfg, make_engine_core_config(*model, cfg));
  core_cfg.max_model_len = n_ctx;
  const kv_layout& layout = core_cfg.kv;
  PAGODA_ASSIGN_OR_RETURN_CLI(auto eng, engine_core::create(*model, core_cfg));
  // --kl-divergence: an exact twin with the same pool and limits, so it schedules the same steps.
  std::unique_ptr<engine_core> exact;
  if (o.kl_divergence) {
    engine_core_config exact_cfg = core_cfg;
    exact_cfg.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, layout.block_size, kv_type::f32, kv_type::f32);
    PAGODA_ASSIGN_OR_RETURN_CLI(exact, engine_core::create(*model, exact_cfg));
  }
  for (std::size_t d = 0; d < docs.size(); ++d)
    for (engine_core* e : {eng.get(), exact.get()}) {
      if (!e) continue;
      request r;
      r.id = std::to_string(d);
      r.prompt = docs[d];
      r.max_tokens = 0;
      r.prompt_logits = true;
      if (auto st = e->add_request(std::move(r)); !st.ok()) return fail(st.with_context(fmt::format("document {}", d)));
    }

  kl_stats kl;
  row_map rows_configured, rows_exact;
  double total_nll = 0;
  std::int64_t n_predicted = 0, n_done_docs = 0, n_tokens_total = 0;
  for (const auto& d : docs) n_tokens_total += static_cast<std::int64_t>(d.size());
  progress_bar bar("perplexity", static_cast<std::int64_t>(docs.size()));
  const std::int64_t t0 = now_us();
  const std::size_t V = static_cast<std::size_t>(hp.n_vocab);
  // Appends each scored row of `events` to `rows`; false on an engine error.
  auto collect = [&](std::vector<engine_event>& events, row_map* rows, bool count) -> status {
    for (engine_event& e : events) {
      if (e.finish_reason == "error") return error(errc::internal, "document {}: {}", e.request_id, e.error);
      const int doc = std::stoi(e.request_id);
      const auto& ids = docs[static_cast<std::size_t>(doc)];
      const std::size_t n_rows = e.prompt_logits.size() / V;
      for (std::size_t j = 0; j < n_rows; ++j) {
        const int pos = e.first_prompt_position + static_cast<int>(j);
        if (static_cast<std::size_t>(pos) + 1 >= ids.size()) continue;  // the last token predicts nothing here
        const float* row = &e.prompt_logits[j * V];
        if (count) {
          total_nll += nll(row, hp.n_vocab, ids[static_cast<std::size_t>(pos) + 1]);
          ++n_predicted;
        }
        if (rows) (*rows)[{doc, pos}].assign(row, row + V);
      }
      if (count && e.request_finished) bar.update(++n_done_docs);
    }
    return {};
  };
  std::vector<engine_event> events, exact_events;
  while (eng->has_work() || (exact && exact->has_work())) {
    events.clear();
    exact_events.clear();
    eng->step(events);
    if (auto st = collect(events, exact ? &rows_configured : nullptr, true); !st.ok()) return fail(st);
    if (!exact) continue;
    exact->step(exact_events);
    if (auto st = collect(exact_events, &rows_exact, false); !st.ok()) return fail(st);
    for (auto it = rows_configured.begin(); it != rows_configured.end();) {
      auto other = rows_exact.find(it->first);
      if (other == rows_exact.end()) {
        ++it;
        continue;
      }
      const auto& ids = docs[static_cast<std::size_t>(it->first.first)];
      kl.add(other->second.data(), it->second.data(), hp.n_vocab, ids[static_cast<std::size_t>(it->first.second) + 1]);
      rows_exact.erase(other);
      it = rows_configured.erase(it);
    }
  }
  if (exact && (!rows_configured.empty() || !rows_exact.empty()))
    return fail(error(errc::internal, "--kl-divergence: {} positions were scored by only one of the two caches",
                      rows_configured.size() + rows_exact.size()));
  bar.finish();
  const double secs = (now_us() - t0) * 1e-6;
  const double mean = total_nll / std::max<std::int64_t>(n_predicted, 1);
  const kv_staging_stats staging = eng->storage().staging();
  const double kl_mean = kl.sum_kl / std::max<std::int64_t>(kl.n, 1);
  const double top1 = static_cast<double>(kl.top1_agree) / std::max<std::int64_t>(kl.n, 1);
  const double ppl_exact = std::exp(kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1));
  const double ppl_change = (std::exp(mean) / ppl_exact - 1.0) * 100.0;
  const bool exact_ctx = exact != nullptr;
  if (o.json) {
    nlohmann::json j = {{"documents", docs.size()},
                        {"documents_truncated", n_cut},
                        {"context", n_ctx},
                        {"predicted_tokens", n_predicted},
                        {"mean_nll", mean},
                        {"perplexity", std::exp(mean)},
                        {"seconds", secs},
                        {"tokens_per_s", n_tokens_total / std::max(secs, 1e-9)},
                        {"kv_type_k", kv_type_name(layout.k_formats[0].type)},
                        {"kv_type_v", kv_type_name(layout.v_formats[0].type)},
                        {"kv", {{"layout", layout.describe()},
                                {"block_size", layout.block_size},
                                {"bits_per_element", layout.bits_per_element()},
                                {"bytes_per_token", layout.bytes_per_token()},
                                {"staging_bytes_per_sequence", layout.staging_bytes_per_slot()},
                                {"bytes_per_token_at_context", layout.bytes_per_token_at(n_ctx)},
                                {"bytes_total", eng->storage().total_bytes()},
                                {"staging_slots_peak", staging.peak_slots_in_use}}}};
    if (exact_ctx)
      j["kl_divergence"] = {{"mean_kl", kl_mean},
                            {"top1_agreement", top1},
                            {"exact_mean_nll", kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1)},
                            {"exact_perplexity", ppl_exact},
                            {"perplexity_change_percent", ppl_change}};
    std::printf("%s\n", j.dump(1).c_str());
  } else {
    std::printf("documents:        %zu (%zu cut at %d tokens)\n", docs.size(), n_cut, n_ctx);
    std::printf("predicted tokens: %lld\n", static_cast<long long>(n_predicted));
    std::printf("KV cache:         %s, %.2f bits/element, %s/token\n", layout.describe().c_str(),
                layout.bits_per_element(), human_bytes(layout.bytes_per_token()).c_str());
    std::printf("mean NLL:         %.6f nats/token\n", mean);
    std::printf("perplexity:       %.4f\n", std::exp(mean));
    if (exact_ctx) {
      std::printf("exact (f32 KV):   perplexity %.4f, mean NLL %.6f\n", ppl_exact,
                  kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1));
      std::printf("perplexity change: %+.4f%%\n", ppl_change);
      std::printf("mean KL divergence: %.6g nats/token (exact || configured)\n", kl_mean);
      std::printf("top-1 agreement:  %.4f%%\n", top1 * 100.0);
    }
    std::printf("speed:            %.1f tokens/s (%.2f s)\n", n_tokens_total / std::max(secs, 1e-9), secs);
  }
  return 0;
}

}  // namespace

void register_perplexity(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<ppl_options>();
  CLI::App* cmd = app.add_subcommand("perplexity", "score a text file: mean NLL and perplexity");
  add_model_options(cmd, opts->config);
  add_kv_options(cmd, opts->config);
  cmd->add_option("-f,--file", opts->file, "text file")->required();
  cmd->add_option("--separator", opts->separator, "document separator (default <|endoftext|>)");
  cmd->add_option("--batch-tokens", opts->batch_tokens, "tokens per forward step")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-num-seqs", opts->max_seqs, "documents scored at once")->check(CLI::Range(1, 4096));
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->add_flag("--kl-divergence", opts->kl_divergence,
                "also score with an exact f32 KV cache in the same run: mean KL divergence, top-1 agreement and "
                "the perplexity change of the configured KV cache");
  cmd->callback([opts, &action] { action = [opts] { return perplexity(*opts); }; });
}

}  // namespace pagoda::cli
