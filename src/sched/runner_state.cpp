#include "sched/runner_state.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "core/assert.h"
#include "spec/draft_view.h"
#include "spec/rejection.h"
#include "spec/speculative.h"

namespace pagoda {

std::shared_ptr<const grammar::vocabulary> grammar_vocabulary(const tokenizer& vocab) {
  std::vector<std::string> pieces(static_cast<std::size_t>(vocab.n_vocab()));
  for (token_id t = 0; t < vocab.n_vocab(); ++t) pieces[static_cast<std::size_t>(t)] = vocab.token_to_piece(t);
  const auto eog = vocab.eog_tokens();
  return std::make_shared<const grammar::vocabulary>(std::move(pieces), std::vector<token_id>(eog.begin(), eog.end()));
}

runner_state::runner_state(const runner_shape& shape, policy_factory make_policy)
    : shape_(shape), make_policy_(std::move(make_policy)) {}

runner_state::sequence* runner_state::find(seq_id id) {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

void runner_state::start_kv_over(sequence& s) {
  s.tables.clear();
  s.positions.clear();
  s.rows.clear();
  s.row_stride = 0;
  s.n_rows = 0;
  s.selector.reset();
  s.draft_view.reset();
}

status runner_state::apply(const step_plan& plan) {
  for (const seq_id id : plan.finished) seqs_.erase(id);
  for (const seq_id id : plan.preempted)
    if (sequence* s = find(id)) start_kv_over(*s);
  for (const scheduled_seq& q : plan.seqs) PAGODA_RETURN_IF_ERROR(apply_seq(q));
  return {};
}

status runner_state::apply_seq(const scheduled_seq& q) {
  if (q.setup) {
    auto s = std::make_unique<sequence>(q.setup->sampling);
    s->logprobs = q.setup->logprobs;
    s->prompt_logprobs = q.setup->prompt_logprobs;
    s->n_prompt = q.setup->n_prompt;
    s->history = q.setup->tokens;
    s->policy = q.setup->policy;
    s->speculation = q.setup->speculation;
    seqs_[q.seq] = std::move(s);
  }
  sequence* s = find(q.seq);
  if (!s) return error(errc::internal, "the plan runs sequence {}, which the runner does not hold", q.seq.value);
  if (q.fresh_kv) {
    start_kv_over(*s);
    if (make_policy_ && !s->policy.is_none()) {
      auto p = make_policy_(s->policy);
      if (!p.ok()) return p.error().with_context(fmt::format("sequence {}'s selector", q.seq.value));
      s->selector = (*p)->make_selector(shape_.n_layers, shape_.n_kv_heads, shape_.head_dim);
    }
    if (s->speculation.model_drafter()) {
      auto v = make_draft_view(s->speculation, shape_.n_layers, shape_.n_kv_heads, shape_.head_dim);
      if (!v.ok()) return v.error().with_context(fmt::format("sequence {}'s draft view", q.seq.value));
      s->draft_view = std::move(*v);
    }
  }
  s->draft_kv = q.fresh_kv ? q.n_stored : std::min(s->draft_kv, q.n_stored);
  s->mirror_kv = q.fresh_kv ? q.n_stored : std::min(s->mirror_kv, q.n_stored);
  for (kv_read_selector* sel : {s->selector.get(), s->draft_view.get()})
    if (sel)
      for (const slot_change& c : q.slot_changes) sel->on_slots_changed(c.n_slots, c.kept);

  // Token history: a truncation cut the sequence's tokens.
  if (static_cast<std::size_t>(q.n_tokens) > s->history.size())
    return error(errc::internal, "sequence {}: the plan counts {} tokens, the runner holds {}", q.seq.value,
                 q.n_tokens, s->history.size());
  s->history.resize(static_cast<std::size_t>(q.n_tokens));

  for (const table_update& u : q.tables) {
    if (u.group < 0 || u.group >= 64 || u.n_null < 0 || u.from < 0)
      return error(errc::internal, "sequence {}: a table update out of range", q.seq.value);
    if (static_cast<std::size_t>(u.group) >= s->tables.size()) s->tables.resize(static_cast<std::size_t>(u.group) + 1);
    std::vector<block_id>& t = s->tables[static_cast<std::size_t>(u.group)];
    t.resize(static_cast<std::size_t>(u.from));
    std::fill_n(t.begin(), std::min<std::size_t>(t.size(), static_cast<std::size_t>(u.n_null)), block_id());
    t.insert(t.end(), u.entries.begin(), u.entries.end());
  }
  const std::size_t n_slots = static_cast<std::size_t>(q.n_stored) + q.tokens.size();
  for (const std::vector<block_id>& t : s->tables)
    if (t.size() * static_cast<std::size_t>(shape_.block_size) < n_slots)
      return error(errc::internal, "sequence {}: a table of {} blocks for {} slots", q.seq.value, t.size(), n_slots);
  if (s->tables.empty()) return error(errc::internal, "sequence {} has no block table", q.seq.value);

  // Stored positions, then the step's.
  if (q.keep_positions < 0 || static_cast<std::size_t>(q.keep_positions) > s->positions.size() ||
      q.keep_positions + q.stored_positions.size() != static_cast<std::size_t>(q.n_stored) ||
      q.positions.size() != q.tokens.size())
    return error(errc::internal, "sequence {}: {} + {} stored positions for {} slots (the runner holds {})",
                 q.seq.value, q.keep_positions, q.stored_positions.size(), q.n_stored, s->positions.size());
  s->positions.resize(static_cast<std::size_t>(q.keep_positions));
  s->positions.insert(s->positions.end(), q.stored_positions.begin(), q.stored_positions.end());
  s->positions.insert(s->positions.end(), q.positions.begin(), q.positions.end());

  // Per-row positions: rewritten by a compaction, else cut to the stored
  // slots; the step's positions are every row's.
  const auto n_stored = static_cast<std::size_t>(q.n_stored);
  if (!q.rows.empty()) {
    if (n_stored == 0 || q.rows.size() % n_stored != 0)
      return error(errc::internal, "sequence {}: {} row positions for {} slots", q.seq.value, q.rows.size(), n_stored);
    s->n_rows = static_cast<int>(q.rows.size() / n_stored);
    s->row_stride = n_stored;
    s->rows = q.rows;
  }
  if (s->n_rows > 0) {
    if (n_slots > s->row_stride) {
      const std::size_t stride = std::max(n_slots, s->row_stride * 2);
      std::vector<std::int32_t> rows(static_cast<std::size_t>(s->n_rows) * stride);
      for (int r = 0; r < s->n_rows; ++r)
        std::copy_n(s->rows.begin() + static_cast<std::ptrdiff_t>(r * s->row_stride), n_stored,
                    rows.begin() + static_cast<std::ptrdiff_t>(r * stride));
      s->rows = std::move(rows);
      s->row_stride = stride;
    }
    for (int r = 0; r < s->n_rows; ++r)
      std::copy(q.positions.begin(), q.positions.end(),
                s->rows.begin() + static_cast<std::ptrdiff_t>(r * s->row_stride + n_stored));
  }
  return {};
}

token_id runner_state::draft_token(sequence& s, std::span<const float> logits, std::span<const token_id> drafts_so_far) {
  if (drafts_so_far.empty()) s.draft_q.clear();
  if (s.params.is_greedy()) return argmax(logits);
  if (!s.draft_smp) s.draft_smp = std::make_unique<sampler>(draft_sampling_params(s.params));
  // The penalties read the output and the drafts so far: appended to the
  // history for the call (no copy of a long history per draft).
  const std::size_t n_history = s.history.size();
  const std::size_t n_prompt = std::min(n_history, static_cast<std::size_t>(std::max(s.n_prompt, 0)));
  s.history.insert(s.history.end(), drafts_so_far.begin(), drafts_so_far.end());
  const std::span<const token_id> all(s.history);
  draft_draw d = draw_draft(*s.draft_smp, logits, all.first(n_prompt), all.subspan(n_prompt));
  s.history.resize(n_history);
  s.draft_q.push_back(std::move(d.q));
  return d.token;
}

sampled_token runner_state::draw(sequence& s, seq_id id, std::span<const float> logits) {
  const std::span<const token_id> all(s.history);
  const std::size_t n_prompt = std::min(all.size(), static_cast<std::size_t>(std::max(s.n_prompt, 0)));
  if (s.params.grammar.empty())
    return record(s, id, logits, s.smp.sample(logits, all.first(n_prompt), all.subspan(n_prompt)));
  // Constrained: drawn from the allowed tokens (logit_bias and the penalties
  // apply after the mask); the logprobs are the model's own. First from the
  // coarse mask; a token the grammar refuses is drawn again from the exact
  // mask (grammar/token_mask.h says why that is the same law).
  grammar::token_matcher* m = matcher_of(s);
  std::span<const float> row = m ? masked(m->coarse_mask(), logits) : std::span<const float>();
  if (row.empty()) return grammar_end(s, id, logits);
  token_id t = s.smp.sample(row, all.first(n_prompt), all.subspan(n_prompt));
  if (!m->allows(t)) {
    row = masked(m->mask(), logits);
    if (row.empty()) return grammar_end(s, id, logits);
    t = s.smp.sample(row, all.first(n_prompt), all.subspan(n_prompt));
  }
  return record(s, id, logits, t);
}

grammar::token_matcher* runner_state::matcher_of(sequence& s) {
  if (s.grammar) return s.grammar->dead() ? nullptr : &*s.grammar;
  if (!grammars_) {
    if (!make_vocabulary_) return nullptr;
    grammars_ = std::make_unique<grammar::grammar_cache>(make_vocabulary_());
  }
  auto g = grammars_->get(s.params.grammar);
  if (!g.ok()) return nullptr;  // sampling_params::validate() refuses such requests first
  s.grammar.emplace(std::move(*g));
  // A sequence set up again after it generated (a step sent anew) takes its output so far.
  for (std::size_t i = static_cast<std::size_t>(std::max(s.n_prompt, 0)); i < s.history.size(); ++i)
    if (!s.grammar->accept(s.history[i])) return nullptr;
  return &*s.grammar;
}

std::span<const float> runner_state::masked(const grammar::token_mask& mask, std::span<const float> logits) {
  if (mask.n_allowed == 0) return {};
  masked_.assign(logits.begin(), logits.end());
  const std::size_t n = logits.size();
  for (std::size_t w = 0; w * 64 < n; ++w) {
    // Rows past the tokenizer's vocabulary (a padded output matrix) have no bytes: never allowed.
    const std::uint64_t bits = w < mask.bits.size() ? mask.bits[w] : 0;
    if (bits == ~std::uint64_t{0}) continue;
    const std::size_t end = std::min(n, w * 64 + 64);
    for (std::size_t i = w * 64; i < end; ++i)
      if (((bits >> (i - w * 64)) & 1) == 0) masked_[i] = -std::numeric_limits<float>::infinity();
  }
  return masked_;
}

sampled_token runner_state::grammar_end(sequence& s, seq_id id, std::span<const float> logits) {
  token_id end = 0;
  if (s.grammar && !s.grammar->vocab().eog().empty()) end = s.grammar->vocab().eog().front();
  s.grammar.reset();
  sampled_token t = record(s, id, logits, end);
  t.grammar_end = true;
  return t;
}

sampled_token runner_state::record(sequence& s, seq_id id, std::span<const float> logits, token_id token) {
  sampled_token t;
  t.seq = id;
  t.token = token;
  if (s.logprobs >= 0) {
    token_logprob lp;
    lp.token = t.token;
    lp.logprob = sampler::log_prob(logits, t.token);
    if (s.logprobs > 0) lp.top = sampler::top_log_probs(logits, s.logprobs);
    t.logprob = std::move(lp);
  }
  s.history.push_back(t.token);
  if (s.grammar) s.grammar->accept(t.token);  // a refused token leaves it dead: the next draw ends the sequence
  return t;
}

void runner_state::score_prompt(const scheduled_seq& q, const float* first, std::size_t n_vocab, step_output& out) {
  const sequence* s = find(q.seq);
  PAGODA_ASSERT(s != nullptr && s->prompt_logprobs >= 0, "scoring sequence {}, which asked for no prompt logprobs",
                q.seq.value);
  const std::size_t n = q.n_scored(s->n_prompt);
  PAGODA_ASSERT(static_cast<std::size_t>(q.score_from) + n < s->history.size(),
                "sequence {}: scoring past the {} tokens held", q.seq.value, s->history.size());
  for (std::size_t j = 0; j < n; ++j) {
    // Row j follows token score_from + j: it predicts the next prompt token.
    const std::span<const float> row(first + j * n_vocab, n_vocab);
    token_logprob lp;
    lp.token = s->history[static_cast<std::size_t>(q.score_from) + j + 1];
    lp.logprob = sampler::log_prob(row, lp.token);
    const float x = row[static_cast<std::size_t>(lp.token)];
    lp.rank = 1 + static_cast<int>(std::count_if(row.begin(), row.end(), [x](float v) { return v > x; }));
    if (s->prompt_logprobs > 0) lp.top = sampler::top_log_probs(row, s->prompt_logprobs);
    out.prompt_scores.push_back(std::move(lp));
  }
}

status runner_state::sample(const step_plan& plan, std::vector<float>& logits, int n_vocab, step_output& out) {
  const auto V = static_cast<std::size_t>(n_vocab);
  out.sampled.clear();
  out.accepted.clear();
  out.prompt_scores.clear();
  std::size_t row = 0, kept = 0;  // rows read, rows kept for out.prompt_logits (moved to the front)
  for (const scheduled_seq& q : plan.seqs) {
    const std::size_t rows = q.every_row() ? q.tokens.size() : 1;
    if ((row + rows) * V > logits.size())
      return error(errc::internal, "the forward pass returned {} logits for more rows", logits.size());
    if (q.score_from >= 0) score_prompt(q, logits.data() + row * V, V, out);
    if (q.sample) {
      sequence* s = find(q.seq);
      PAGODA_ASSERT(s != nullptr, "sampling sequence {}, which apply() did not create", q.seq.value);
      const std::span<const float> last(logits.data() + (row + rows - 1) * V, V);
      for (const seq_fork& f : q.forks) {
        sampling_params p = s->params;
        p.seed = f.seed;
        auto c = std::make_unique<sequence>(p);
        c->logprobs = s->logprobs;
        c->prompt_logprobs = s->prompt_logprobs;
        c->n_prompt = s->n_prompt;
        c->history = s->history;
        c->policy = s->policy;
        c->speculation = s->speculation;
        c->grammar = s->grammar;
        out.sampled.push_back(draw(*c, f.seq, last));
        seqs_[f.seq] = std::move(c);
      }
      if (q.draft.empty()) {
        out.sampled.push_back(draw(*s, q.seq, last));
      } else {
        // Row j follows the j-th token of the step: the last verified one, then the drafts.
        const std::size_t at = static_cast<std::size_t>(&q - plan.seqs.data());
        PAGODA_ASSERT(q.forks.empty() && q.draft.size() < q.tokens.size(), "a verification step with forks");
        PAGODA_ASSERT(!q.runner_drafts || (at < out.drafts.size() && out.drafts[at].size() == q.draft.size()),
                      "sequence {}'s drafts were not made", q.seq.value);
        const std::span<const token_id> drafts = q.runner_drafts ? std::span<const token_id>(out.drafts[at]) : q.draft;
        const std::size_t first = row + rows - 1 - q.draft.size();
        auto row_of = [&](std::size_t j) { return std::span<const float>(logits.data() + (first + j) * V, V); };
        std::vector<token_id> emitted;
        if (q.runner_drafts && !s->params.is_greedy()) {
          // Drafts drawn from the draft's distribution: rejection sampling.
          PAGODA_ASSERT(s->draft_q.size() == drafts.size(), "sequence {}: {} draft distributions for {} drafts",
                        q.seq.value, s->draft_q.size(), drafts.size());
          // Row j's penalties read the output and drafts[0, j): appended to
          // the history as rows are reached, cut back before the tokens are recorded.
          const std::size_t n_history = s->history.size();
          const std::size_t n_prompt = std::min(n_history, static_cast<std::size_t>(std::max(s->n_prompt, 0)));
          // Under a grammar, row j's law is masked by the state after drafts[0, j).
          std::optional<grammar::token_matcher> ahead;
          if (!s->params.grammar.empty())
            if (grammar::token_matcher* m = matcher_of(*s)) ahead = *m;
          emitted = accept_distribution_drafts(drafts, s->draft_q, [&](int j) {
            if (j > 0) s->history.push_back(drafts[static_cast<std::size_t>(j - 1)]);
            const std::span<const token_id> all(s->history);
            std::span<const float> row = row_of(static_cast<std::size_t>(j));
            if (!s->params.grammar.empty()) {
              if (ahead && j > 0) ahead->accept(drafts[static_cast<std::size_t>(j - 1)]);
              row = ahead && !ahead->dead() ? masked(ahead->mask(), row) : std::span<const float>();
              if (row.empty()) return token_distribution::point(0);  // nothing allowed: the next draw ends it
            }
            return s->smp.probabilities(row, all.first(n_prompt), all.subspan(n_prompt));
          }, s->smp);
          s->history.resize(n_history);
          for (std::size_t j = 0; j < emitted.size(); ++j) out.sampled.push_back(record(*s, q.seq, row_of(j), emitted[j]));
        } else {
          emitted = accept_point_drafts(drafts, [&](int j) {
            out.sampled.push_back(draw(*s, q.seq, row_of(static_cast<std::size_t>(j))));
            return out.sampled.back().token;
          });
        }
        if (out.accepted.empty()) out.accepted.assign(plan.seqs.size(), 0);
        out.accepted[at] = static_cast<std::int32_t>(emitted.size() - 1);
      }
    }
    if (q.all_logits) {
      if (kept != row) std::memmove(logits.data() + kept * V, logits.data() + row * V, rows * V * sizeof(float));
      kept += rows;
    }
    row += rows;
  }
  // Most steps score no prompt: the forward's buffer keeps its capacity.
  out.prompt_logits.clear();
  if (kept > 0) {
    logits.resize(kept * V);
    out.prompt_logits.swap(logits);
  }
  out.selector_bytes.assign(plan.seqs.size(), 0);
  out.index_names.assign(plan.seqs.size(), {});
  out.recall.assign(plan.seqs.size(), {});
  for (std::size_t i = 0; i < plan.seqs.size(); ++i)
    if (const sequence* s = find(plan.seqs[i].seq); s && s->selector) {
      out.selector_bytes[i] = static_cast<std::int64_t>(s->selector->memory_bytes());
      out.index_names[i] = s->selector->index_name();
      if (!out.index_names[i].empty()) out.recall[i] = s->selector->sampled_recall();
    }
  return {};
}

}  // namespace pagoda
