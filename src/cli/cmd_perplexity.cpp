// pagoda perplexity: mean negative log-likelihood of a text.
//
// A text with separators is scored document by document, each BOS-prefixed:
// a document that fits the context is scored whole; a longer one in windows
// of the context's size, the first scored whole and each later one (BOS in
// place of its first token) on the tokens past the previous window, at least
// half a context in, as llama-perplexity scores its chunks (--truncate cuts
// it at the context instead, as the reference figures do).
//
// A text without separators is scored as llama-perplexity does: tokenized
// whole with BOS, cut into chunks of the context's size (the tail that fills
// no chunk is dropped), BOS in place of each chunk's first token, and only
// the second half of each chunk scored (the tokens at n_ctx/2 + 1 ..
// n_ctx - 1), so the figure compares with llama.cpp's at the same context.
// --chunks N scores the first N chunks, or the first N documents of a text
// with separators.
//
// Each piece (document, window or chunk) is one request to the engine
// (max_tokens 0, prompt logits), so pieces are scored several at a time in
// batched steps, with the engine's KV pool, scheduling and chunked prefill.
//
// --kl-divergence runs a second engine in the same process with an exact (f32)
// KV cache over the same requests, and reports the mean KL(exact ||
// configured) of the next-token distributions, how often their top-1 tokens
// agree, and the perplexity change.
//
// --segment-kv-type T gives the first --segment-fraction of each piece's
// tokens KV type T (a prompt segment's type: a KV class, kv_manager.h), the
// rest the configured type; with --kl-divergence the rows past the segment
// (the part that reads the compressed segment with its own KV exact) are also
// reported apart.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/plan.h"
#include <map>

#include "policy/kv_policy.h"
#include "sched/engine_core.h"
#include "sched/seq_policy.h"
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
  bool truncate = false;  // cut long documents at the context (no windows)
  int max_chunks = -1;    // llama-perplexity's --chunks: at most this many chunks; -1: all
  int policy_step = 16;   // with a KV policy: tokens fed per step, the policy acting between steps
  std::string segment_kv_type;   // "": no segment
  double segment_fraction = 0.75;  // of each piece's tokens, from its start
  bool tail_rows = false;  // report the rows past the first segment_fraction apart (set with a segment or the fraction)
  std::string profile_out;  // --profile-out: the quality profile `pagoda plan` reads (cli/plan.h)
};

// One request: row j of its prompt logits predicts tokens[j + 1]; rows from
// first_scored_row on are scored.
struct piece {
  std::vector<token_id> tokens;
  int first_scored_row = 0;
};

// How the text was cut into pieces, for the report.
struct plan {
  bool chunks = false;        // llama-perplexity's chunks (a text without separators)
  std::size_t n_documents = 0;
  std::size_t n_windowed = 0;  // documents longer than the context, scored in windows
  std::size_t n_truncated = 0; // documents cut at the context (--truncate)
  std::int64_t n_text_tokens = 0;
  std::vector<piece> pieces;
};

// Replaces a piece's first token with BOS, as llama-perplexity does.
void bos_first(std::vector<token_id>& t, const tokenizer& vocab) {
  if (vocab.add_bos_default() && vocab.bos() != k_no_token && !t.empty()) t[0] = vocab.bos();
}

// llama-perplexity's chunks of a whole text.
void plan_chunks(const std::vector<token_id>& ids, int n_ctx, int max_chunks, const tokenizer& vocab, plan& p) {
  p.chunks = true;
  std::int64_t n_chunks = static_cast<std::int64_t>(ids.size()) / n_ctx;
  if (max_chunks >= 0) n_chunks = std::min<std::int64_t>(n_chunks, max_chunks);
  for (std::int64_t c = 0; c < n_chunks; ++c) {
    piece pc;
    pc.tokens.assign(ids.begin() + c * n_ctx, ids.begin() + (c + 1) * n_ctx);
    bos_first(pc.tokens, vocab);
    pc.first_scored_row = n_ctx / 2;
    p.pieces.push_back(std::move(pc));
  }
}

// One document: whole when it fits, else cut (--truncate) or in windows.
void plan_document(std::vector<token_id> ids, int n_ctx, bool truncate, const tokenizer& vocab, plan& p) {
  const int n = static_cast<int>(ids.size());
  if (n < 2) return;
  ++p.n_documents;
  if (n <= n_ctx || truncate) {
    if (n > n_ctx) {
      ids.resize(n_ctx);
      ++p.n_truncated;
    }
    p.pieces.push_back({std::move(ids), 0});
    return;
  }
  ++p.n_windowed;
  p.pieces.push_back({std::vector<token_id>(ids.begin(), ids.begin() + n_ctx), 0});
  int last_target = n_ctx - 1;  // the last token scored so far
  while (last_target < n - 1) {
    // The next window scores from last_target + 1, with at least n_ctx / 2 + 1 tokens before it.
    const int start = std::min(last_target - n_ctx / 2, n - n_ctx);
    piece w{std::vector<token_id>(ids.begin() + start, ids.begin() + start + n_ctx), last_target - start};
    bos_first(w.tokens, vocab);
    p.pieces.push_back(std::move(w));
    last_target = start + n_ctx - 1;
  }
}

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
// The end of a piece's typed segment: the first `fraction` of its tokens.
std::int32_t segment_end(const piece& p, double fraction) {
  return static_cast<std::int32_t>(std::floor(fraction * static_cast<double>(p.tokens.size())));
}

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

// One line saying what was scored, so the figure can be compared.
std::string scoring_method(const plan& p, int n_ctx) {
  if (p.chunks)
    return fmt::format(
        "{} chunks of {} tokens as llama-perplexity cuts them (BOS first; the second half of each scored: tokens "
        "{}..{} of a chunk, counting from 0); {} of the text's {} tokens in no chunk",
        p.pieces.size(), n_ctx, n_ctx / 2 + 1, n_ctx - 1, p.n_text_tokens - static_cast<std::int64_t>(p.pieces.size()) * n_ctx,
        p.n_text_tokens);
  if (p.n_truncated > 0)
    return fmt::format("{} documents, BOS first, scored whole; {} cut at the context of {} tokens (--truncate)",
                       p.n_documents, p.n_truncated, n_ctx);
  return fmt::format(
      "{} documents, BOS first: {} within the context of {} tokens scored whole, {} longer ones in windows of {} "
      "(the first scored whole; each later one, BOS first, scores the tokens past the previous one, from its token "
      "{} on at the earliest, counting from 0, as llama-perplexity scores the second half of its chunks)",
      p.n_documents, p.n_documents - p.n_windowed, n_ctx, p.n_windowed, n_ctx, n_ctx / 2 + 1);
}

result<plan> make_plan(const ppl_options& o, const tokenizer& vocab, int n_ctx) {
  std::ifstream in(o.file, std::ios::binary);
  if (!in) return error(errc::not_found, "cannot open {}", o.file);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<std::string> texts = split_documents(text, o.separator);
  if (texts.empty()) return error(errc::invalid_argument, "{} holds no text", o.file);
  plan p;
  const bool separated = !o.separator.empty() && text.find(o.separator) != std::string::npos;
  if (!separated) {
    std::vector<token_id> ids = vocab.encode(texts[0], /*add_bos=*/true);
    p.n_text_tokens = static_cast<std::int64_t>(ids.size());
    if (static_cast<int>(ids.size()) >= n_ctx) {
      plan_chunks(ids, n_ctx, o.max_chunks, vocab, p);
      return p;
    }
    plan_document(std::move(ids), n_ctx, o.truncate, vocab, p);  // shorter than one chunk: scored whole
    return p;
  }
  // --chunks on documents: the first that many (a quick run over a sample, as on a whole text).
  if (o.max_chunks >= 0 && static_cast<std::size_t>(o.max_chunks) < texts.size()) texts.resize(o.max_chunks);
  for (const std::string& t : texts) {
    std::vector<token_id> ids = vocab.encode(t, /*add_bos=*/true);
    p.n_text_tokens += static_cast<std::int64_t>(ids.size());
    plan_document(std::move(ids), n_ctx, o.truncate, vocab, p);
  }
  return p;
}

// Tokens' worth of the pool's blocks that the engine's --kv-policy's side
// memory takes for one sequence of n_tokens (0 without a policy or with a bad
// spec, which the engine reports itself).
std::int64_t side_tokens_per_sequence(const engine_core_config& cfg, std::int64_t n_tokens) {
  auto spec = parse_kv_policy_spec(cfg.kv_policy);
  if (!spec.ok() || spec->is_none()) return 0;
  auto policy = make_kv_policy(*spec);
  if (!policy.ok()) return 0;
  const kv_layout& l = cfg.kv;
  const side_charge side =
      seq_policy::side_memory_of(policy->get(), {l.n_layers, l.n_kv_heads, l.head_dim, l.block_size}, cfg.attention_stats_window);
  const auto block_bytes = static_cast<std::int64_t>(l.bytes_per_block());
  return (side.bytes_for(n_tokens) + block_bytes - 1) / block_bytes * l.block_size;
}

int perplexity(const ppl_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.config));
  const llama_hparams& hp = model->hparams();
  const int n_ctx = context_length(o.config, hp);
  if (n_ctx < 4) return fail(error(errc::invalid_argument, "--ctx {} is too small to score text", n_ctx));
  PAGODA_ASSIGN_OR_RETURN_CLI(plan pl, make_plan(o, model->vocab(), n_ctx));
  if (pl.pieces.empty())
    return fail(error(errc::invalid_argument, "{} has nothing to score (no document of two tokens or more)", o.file));
  std::vector<piece>& docs = pl.pieces;

  engine_config cfg = o.config;
  cfg.max_num_seqs = o.max_seqs;
  cfg.max_num_batched_tokens = std::max(o.batch_tokens, 1);
  cfg.enable_prefix_caching = false;  // every position is scored, so every position is computed
  const std::int64_t max_live = std::min<std::int64_t>(o.max_seqs, static_cast<std::int64_t>(docs.size()));
  const bool sized_here = cfg.kv_cache_size_mib <= 0 && cfg.max_kv_tokens <= 0;
  if (sized_here) cfg.max_kv_tokens = max_live * (n_ctx + cfg.block_size);
  const bool segmented = !o.segment_kv_type.empty();
  if (segmented) {
    // The segment's type as a KV class with half the pool's bytes (unless
    // --kv-segment-dtype names it), on a pool twice as large: each half holds
    // every piece in flight whatever the fraction.
    const bool named = std::any_of(cfg.kv_segment_dtypes.begin(), cfg.kv_segment_dtypes.end(), [&](const std::string& t) {
      return t == o.segment_kv_type || t.rfind(o.segment_kv_type + ":", 0) == 0;
    });
    if (!named) cfg.kv_segment_dtypes.push_back(o.segment_kv_type + ":0.5");
    if (cfg.kv_cache_size_mib <= 0) cfg.max_kv_tokens *= 2;
  }
  PAGODA_ASSIGN_OR_RETURN_CLI(engine_core_config core_cfg, make_engine_core_config(*model, cfg));
  if (sized_here) {
    // The pool also pays for what the policy keeps beside each sequence's KV
    // (side memory: snapkv's statistics, retrieval's indexes); sized for the
    // KV alone, documents were refused or preempted, and the two caches of
    // --kl-divergence then scored different positions.
    if (const std::int64_t side = side_tokens_per_sequence(core_cfg, n_ctx); side > 0) {
      cfg.max_kv_tokens += max_live * side * (segmented ? 2 : 1);
      PAGODA_ASSIGN_OR_RETURN_CLI(core_cfg, make_engine_core_config(*model, cfg));
    }
  }
  core_cfg.max_model_len = n_ctx;
  const kv_layout& layout = core_cfg.kv;
  PAGODA_ASSIGN_OR_RETURN_CLI(auto eng, engine_core::create(*model, core_cfg));
  // --kl-divergence: an exact twin with the same pool and limits, so it schedules the same steps.
  std::unique_ptr<engine_core> exact;
  if (o.kl_divergence) {
    engine_core_config exact_cfg = core_cfg;
    // Unshared unless the model itself shares (--kv-share's KL is against no sharing).
    PAGODA_ASSIGN_OR_RETURN_CLI(
        exact_cfg.kv, with_declared_kv_sharing(hp, kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim,
                                                                      layout.block_size, kv_type::f32, kv_type::f32)));
    exact_cfg.kv_policy = "none";
    exact_cfg.kv_classes.clear();
    PAGODA_ASSIGN_OR_RETURN_CLI(exact, engine_core::create(*model, exact_cfg));
  }
  const bool with_policy = core_cfg.kv_policy != "none";
  for (std::size_t d = 0; d < docs.size(); ++d)
    for (engine_core* e : {eng.get(), exact.get()}) {
      if (!e) continue;
      request r;
      r.id = std::to_string(d);
      r.prompt = docs[d].tokens;
      r.max_tokens = 0;
      r.prompt_logits = true;
      // Decode-time setting: the document arrives policy_step tokens at a
      // time and the policy acts between steps, so every token is scored
      // with the cache as the policy left it.
      if (with_policy && e == eng.get()) r.prompt_chunk = o.policy_step;
      // A piece too short for the fraction to cover a token has no segment (an empty run is refused).
      if (const std::int32_t end = segment_end(docs[d], o.segment_fraction); segmented && e == eng.get() && end > 0)
        r.segments.push_back(prompt_segment{0, end, "", o.segment_kv_type});
      if (auto st = e->add_request(std::move(r)); !st.ok()) return fail(st.with_context(fmt::format("document {}", d)));
    }

  kl_stats kl, kl_tail;  // every scored row; with a segment, the rows past it
  row_map rows_configured, rows_exact;
  double kept_sum = 0, kept_frac_sum = 0;  // KV tokens kept after each step, x rows scored then
  std::int64_t kept_rows = 0;
  double total_nll = 0;
  std::int64_t n_predicted = 0, n_done_docs = 0, n_tokens_total = 0;
  for (const auto& d : docs) n_tokens_total += static_cast<std::int64_t>(d.tokens.size());
  progress_bar bar("perplexity", static_cast<std::int64_t>(docs.size()));
  const std::int64_t t0 = now_us();
  const std::size_t V = static_cast<std::size_t>(hp.n_vocab);
  // Appends each scored row of `events` to `rows`; false on an engine error.
  auto collect = [&](std::vector<engine_event>& events, row_map* rows, bool count) -> status {
    for (engine_event& e : events) {
      if (e.finish_reason == "error") return error(errc::internal, "document {}: {}", e.request_id, e.error);
      const int doc = std::stoi(e.request_id);
      const piece& pc = docs[static_cast<std::size_t>(doc)];
      const auto& ids = pc.tokens;
      const std::size_t n_rows = e.prompt_logits.size() / V;
      if (count && with_policy && n_rows > 0) {
        // What the cache holds after this step, against what the document has seen.
        if (const auto sq = eng->sched().find_sequence(e.request_id))
          if (const seq_policy* sp = eng->sched().policy_of(*sq)) {
            const double seen = e.first_prompt_position + static_cast<double>(n_rows);
            kept_sum += sp->mean_live_slots() * static_cast<double>(n_rows);
            kept_frac_sum += sp->mean_live_slots() / seen * static_cast<double>(n_rows);
            kept_rows += static_cast<std::int64_t>(n_rows);
          }
      }
      for (std::size_t j = 0; j < n_rows; ++j) {
        const int pos = e.first_prompt_position + static_cast<int>(j);
        if (static_cast<std::size_t>(pos) + 1 >= ids.size()) continue;  // the last token predicts nothing here
        if (pos < pc.first_scored_row) continue;                         // context only
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
      const auto& ids = docs[static_cast<std::size_t>(it->first.first)].tokens;
      const token_id next = ids[static_cast<std::size_t>(it->first.second) + 1];
      kl.add(other->second.data(), it->second.data(), hp.n_vocab, next);
      if (o.tail_rows && it->first.second >= segment_end(docs[static_cast<std::size_t>(it->first.first)], o.segment_fraction))
        kl_tail.add(other->second.data(), it->second.data(), hp.n_vocab, next);
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
  if (!o.profile_out.empty()) {
    // One measured configuration, keyed as plan keys its rows: the layout, the policy, the sharing.
    const nlohmann::json entry = {{"kv", layout.describe()},
                                  {"kv_policy", core_cfg.kv_policy == "none" ? "" : core_cfg.kv_policy},
                                  {"kv_share", cfg.kv_share == "none" ? "" : cfg.kv_share},
                                  {"bits_per_element", layout.bits_per_element()},
                                  {"bytes_per_token", layout.bytes_per_token()},
                                  {"mean_kl", kl.sum_kl / std::max<std::int64_t>(kl.n, 1)},
                                  {"perplexity_change_percent", (std::exp(mean) / ppl_exact - 1.0) * 100.0},
                                  {"top1_agreement", static_cast<double>(kl.top1_agree) / std::max<std::int64_t>(kl.n, 1)},
                                  {"predicted_tokens", n_predicted},
                                  {"context", n_ctx},
                                  {"text", o.file}};
    PAGODA_RETURN_IF_ERROR_CLI(write_quality_entry(o.profile_out, hp.name.empty() ? o.config.model_path : hp.name,
                                                   fingerprint_text(model_fingerprint(*model)), entry)
                                   .with_context("--profile-out"));
  }
  std::string method = scoring_method(pl, n_ctx);
  if (with_policy)
    method += fmt::format(
        "; KV policy {}: each piece fed {} tokens a step, the policy applied between steps, so every token is scored "
        "with the cache as the policy left it (the decode-time setting)",
        core_cfg.kv_policy, o.policy_step);
  const double kept_mean = kept_rows ? kept_sum / kept_rows : 0.0;
  const double kept_frac = kept_rows ? kept_frac_sum / kept_rows : 1.0;
  // What attention read of what it kept, beside what was kept: every piece is
  // a prompt fed policy_step tokens a step (the prompt phase's reads).
  kv_read_counts reads;
  for (const auto& [policy, r] : eng->stats().kv_reads) reads += r.prompt;
  const auto ratio = [](std::int64_t a, std::int64_t b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 1.0; };
  const double read_mean = reads.rows ? static_cast<double>(reads.tokens_read) / static_cast<double>(reads.rows) : 0.0;
  const double read_frac = ratio(reads.tokens_read, reads.tokens_visible);
  const double read_blocks_frac = ratio(reads.blocks_read, reads.blocks_visible);
  // The segment's layout (a class the engine was given above).
  const kv_layout& seg = segmented ? core_cfg.kv_classes.at(*find_kv_class(core_cfg, o.segment_kv_type) - 1u).layout : layout;
  if (o.json) {
    nlohmann::json j = {{"method", pl.chunks ? "chunks" : "documents"},
                        {"scoring", method},
                        {"documents", pl.n_documents},
                        {"documents_windowed", pl.n_windowed},
                        {"documents_truncated", pl.n_truncated},
                        {"chunks", pl.chunks ? docs.size() : 0},
                        {"pieces", docs.size()},
                        {"text_tokens", pl.n_text_tokens},
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
    if (segmented) {
      j["segment"] = {{"kv_type", o.segment_kv_type},
                      {"layout", seg.describe()},
                      {"fraction", o.segment_fraction},
                      {"bytes_per_token", seg.bytes_per_token()},
                      {"mean_bytes_per_token", o.segment_fraction * seg.bytes_per_token() +
                                                   (1 - o.segment_fraction) * layout.bytes_per_token()}};
    }
    if (o.tail_rows && exact_ctx)
      j["after_segment"] = {{"fraction", o.segment_fraction},
                            {"rows", kl_tail.n},
                            {"mean_kl", kl_tail.sum_kl / std::max<std::int64_t>(kl_tail.n, 1)},
                            {"top1_agreement", static_cast<double>(kl_tail.top1_agree) / std::max<std::int64_t>(kl_tail.n, 1)}};
    if (with_policy) {
      j["kv_policy"] = {{"policy", core_cfg.kv_policy},
                        {"step_tokens", o.policy_step},
                        {"mean_kept_tokens", kept_mean},
                        {"mean_kept_fraction", kept_frac},
                        {"read", {{"rows", reads.rows},
                                  {"mean_read_tokens", read_mean},
                                  {"read_fraction", read_frac},
                                  {"read_blocks_fraction", read_blocks_frac}}}};
    }
    if (exact_ctx)
      j["kl_divergence"] = {{"mean_kl", kl_mean},
                            {"top1_agreement", top1},
                            {"exact_mean_nll", kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1)},
                            {"exact_perplexity", ppl_exact},
                            {"perplexity_change_percent", ppl_change}};
    std::printf("%s\n", j.dump(1).c_str());
  } else {
    std::printf("scoring:          %s\n", method.c_str());
    std::printf("predicted tokens: %lld\n", static_cast<long long>(n_predicted));
    std::printf("KV cache:         %s, %.2f bits/element, %s/token\n", layout.describe().c_str(),
                layout.bits_per_element(), human_bytes(layout.bytes_per_token()).c_str());
    if (segmented) {
      std::printf("segment:          the first %.0f%% of each piece in %s (%s/token): %s/token on average\n",
                  o.segment_fraction * 100, seg.describe().c_str(), human_bytes(seg.bytes_per_token()).c_str(),
                  human_bytes(o.segment_fraction * seg.bytes_per_token() + (1 - o.segment_fraction) * layout.bytes_per_token()).c_str());
    }
    if (with_policy)
      std::printf("KV policy:        %s: kept %.1f tokens on average, %.2f%% of those seen\n", core_cfg.kv_policy.c_str(),
                  kept_mean, kept_frac * 100.0);
    if (with_policy)
      std::printf("KV read:          %.1f tokens per query row and layer head, %.2f%% of those visible (%.2f%% of their blocks)\n",
                  read_mean, read_frac * 100.0, read_blocks_frac * 100.0);
    std::printf("mean NLL:         %.6f nats/token\n", mean);
    std::printf("perplexity:       %.4f\n", std::exp(mean));
    if (exact_ctx) {
      std::printf("exact (f32 KV):   perplexity %.4f, mean NLL %.6f\n", ppl_exact,
                  kl.sum_nll_exact / std::max<std::int64_t>(kl.n, 1));
      std::printf("perplexity change: %+.4f%%\n", ppl_change);
      std::printf("mean KL divergence: %.6g nats/token (exact || configured)\n", kl_mean);
      std::printf("top-1 agreement:  %.4f%%\n", top1 * 100.0);
    }
    if (o.tail_rows && exact_ctx)
      std::printf("past the first %.0f%%: mean KL %.6g nats/token, top-1 agreement %.4f%% (%lld rows)\n",
                  o.segment_fraction * 100, kl_tail.sum_kl / std::max<std::int64_t>(kl_tail.n, 1),
                  100.0 * static_cast<double>(kl_tail.top1_agree) / std::max<std::int64_t>(kl_tail.n, 1),
                  static_cast<long long>(kl_tail.n));
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
  cmd->add_option("--separator", opts->separator,
                  "document separator; a text without it is scored in llama-perplexity's chunks");
  cmd->add_option("--batch-tokens", opts->batch_tokens, "tokens per forward step")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-num-seqs", opts->max_seqs, "documents scored at once")->check(CLI::Range(1, 4096));
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->add_flag("--truncate", opts->truncate,
                "cut documents longer than the context at it instead of scoring them in windows");
  cmd->add_option("--chunks", opts->max_chunks,
                  "score at most this many chunks of a text without separators, or the first this many documents "
                  "of one with them (-1: all; llama-perplexity's --chunks)")
      ->check(CLI::Range(-1, 1 << 30));
  cmd->add_flag("--kl-divergence", opts->kl_divergence,
                "also score with an exact f32 KV cache in the same run: mean KL divergence, top-1 agreement and "
                "the perplexity change of the configured KV cache");
  cmd->add_option("--policy-step", opts->policy_step,
                  "with --kv-policy: tokens fed per step; the policy acts between steps (decode-time setting)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--segment-kv-type", opts->segment_kv_type,
                  "give the first --segment-fraction of each piece's tokens this KV type (a prompt segment's type; "
                  "a KV class with half the pool unless --kv-segment-dtype names it)");
  CLI::Option* fraction =
      cmd->add_option("--segment-fraction", opts->segment_fraction,
                      "the typed part of each piece (default 0.75); with --kl-divergence the rows past it are "
                      "reported apart, with or without --segment-kv-type")
          ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--profile-out", opts->profile_out,
                  "with --kl-divergence: add this KV configuration's measured quality to a profile `pagoda plan` "
                  "reads (created, or the entry of the same configuration replaced)");
  cmd->callback([opts, fraction, &action] {
    opts->tail_rows = fraction->count() > 0 || !opts->segment_kv_type.empty();
    if (!opts->profile_out.empty() && !opts->kl_divergence)
      throw usage_error("--profile-out needs --kl-divergence (the quality it writes is the KL against an exact cache)");
    if (!opts->profile_out.empty() && !opts->segment_kv_type.empty())
      throw usage_error("--profile-out: a --segment-kv-type run mixes two KV types; profile one type at a time");
    action = [opts] { return perplexity(*opts); };
  });
}

}  // namespace pagoda::cli
