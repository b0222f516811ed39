// pagoda perplexity: mean negative log-likelihood of a text, one document per
// separator, each BOS-prefixed and truncated at the context length. Documents
// are scored several at a time in one batched forward step.
//
// --kl-divergence scores every step twice in the same run, with an exact (f32)
// KV cache and with the configured one (same steps, same block tables), and
// reports the mean KL(exact || configured) of the next-token distributions,
// how often their top-1 tokens agree, and the perplexity change.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/simple_kv.h"
#include "core/clock.h"

namespace pagoda::cli {
namespace {

struct ppl_options {
  model_options model;
  kv_options kv;
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

int perplexity(const ppl_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(std::vector<std::string> texts, read_documents(o.file, o.separator));

  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.model));
  const llama_hparams& hp = model->hparams();
  const int n_ctx = context_length(o.model, hp);
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

  const int budget = std::max(o.batch_tokens, 1);
  PAGODA_ASSIGN_OR_RETURN_CLI(kv_layout layout, make_kv_layout(*model, o.kv));
  // Enough blocks for every document in flight, each up to the context.
  const std::int64_t max_live = std::min<std::int64_t>(o.max_seqs, static_cast<std::int64_t>(docs.size()));
  PAGODA_ASSIGN_OR_RETURN_CLI(std::int64_t n_blocks,
                              pool_blocks(layout, o.kv, max_live * (n_ctx + layout.block_size), max_live));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto storage, kv_storage::create(layout, n_blocks, max_live));
  simple_kv kv(*storage);
  llama_context ctx(*model, *storage, o.model.threads);
  // --kl-divergence: an exact twin of the cache with the same block ids.
  std::unique_ptr<kv_storage> exact_storage;
  std::unique_ptr<llama_context> exact_ctx;
  if (o.kl_divergence) {
    kv_layout exact = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, layout.block_size, kv_type::f32, kv_type::f32);
    PAGODA_ASSIGN_OR_RETURN_CLI(exact_storage, kv_storage::create(exact, n_blocks));
    exact_ctx = std::make_unique<llama_context>(*model, *exact_storage, o.model.threads);
  }
  kl_stats kl;
  std::vector<float> exact_logits;

  struct live_doc {
    int doc;
    int pos;  // tokens already scored into the KV
  };
  std::vector<live_doc> live;
  std::size_t next_doc = 0;
  double total_nll = 0;
  std::int64_t n_predicted = 0, n_done_docs = 0, n_tokens_total = 0;
  for (const auto& d : docs) n_tokens_total += static_cast<std::int64_t>(d.size());
  std::vector<float> logits;
  std::vector<forward_seq> step;
  progress_bar bar("perplexity", static_cast<std::int64_t>(docs.size()));
  std::int64_t t0 = now_us();

  while (next_doc < docs.size() || !live.empty()) {
    // Admit documents while the step has room and the pool has blocks.
    int planned = 0;
    for (const live_doc& l : live) planned += std::min<int>(budget, static_cast<int>(docs[l.doc].size()) - l.pos);
    while (next_doc < docs.size() && planned < budget && static_cast<int>(live.size()) < o.max_seqs &&
           kv.reserve(static_cast<int>(next_doc), static_cast<int>(docs[next_doc].size()))) {
      live.push_back({static_cast<int>(next_doc), 0});
      planned += std::min<int>(budget, static_cast<int>(docs[next_doc].size()));
      ++next_doc;
    }
    if (live.empty())
      return fail(error(errc::resource_exhausted, "a document of {} tokens does not fit the KV pool of {} blocks",
                        docs[next_doc].size(), n_blocks));
    step.clear();
    std::vector<int> step_docs;
    int left = budget;
    for (live_doc& l : live) {
      if (left <= 0) break;
      const auto& ids = docs[l.doc];
      int n = std::min(left, static_cast<int>(ids.size()) - l.pos);
      step.push_back({std::span(ids).subspan(l.pos, n), l.pos, kv.table(l.doc), true});
      step_docs.push_back(l.doc);
      left -= n;
    }
    if (auto st = ctx.forward(step, logits); !st.ok()) return fail(st);
    if (exact_ctx)
      if (auto st = exact_ctx->forward(step, exact_logits); !st.ok()) return fail(st);
    std::size_t row = 0;
    for (std::size_t i = 0; i < step.size(); ++i) {
      live_doc& l = live[i];
      const auto& ids = docs[l.doc];
      for (std::size_t j = 0; j < step[i].tokens.size(); ++j, ++row) {
        std::size_t target = l.pos + j + 1;
        if (target >= ids.size()) continue;
        total_nll += nll(&logits[row * hp.n_vocab], hp.n_vocab, ids[target]);
        if (exact_ctx) kl.add(&exact_logits[row * hp.n_vocab], &logits[row * hp.n_vocab], hp.n_vocab, ids[target]);
        ++n_predicted;
      }
      l.pos += static_cast<int>(step[i].tokens.size());
    }
    for (auto it = live.begin(); it != live.end();) {
      if (it->pos >= static_cast<int>(docs[it->doc].size())) {
        kv.release(it->doc);
        ++n_done_docs;
        it = live.erase(it);
      } else {
        ++it;
      }
    }
    bar.update(n_done_docs);
  }
  bar.finish();
  const double secs = (now_us() - t0) * 1e-6;
  const double mean = total_nll / std::max<std::int64_t>(n_predicted, 1);
  const kv_staging_stats staging = storage->staging();
  const double kl_mean = kl.sum_kl / std::max<std::int64_t>(kl.n, 1);
  const double top1 = static_cast<double>(kl.top1_agree) / std::max<std::int64_t>(kl.n, 1);
  const double ppl_exact = std::exp(kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1));
  const double ppl_change = (std::exp(mean) / ppl_exact - 1.0) * 100.0;
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
                                {"bytes_total", storage->total_bytes()},
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
  add_model_options(cmd, opts->model);
  add_kv_options(cmd, opts->kv);
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
