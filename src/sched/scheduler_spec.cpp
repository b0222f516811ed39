// The scheduler's side of speculative decoding (spec/speculative.h,
// docs/speculative.md), and committing sampled tokens, which a verification
// step does several at a time.
//
// Tentative K/V: a verification step allocates slots for the last token and
// its k drafts, and the runner writes K/V into all of them. Only update()
// commits into the KV manager, and it commits the verified prefix alone, then
// truncates the sequence to what it committed: the rejected drafts' slots are
// released (blocks past the kept ones) or rewound (a truncate op on the last,
// partly kept block). Commit is the one path into the prefix index, into the
// commit hook (the store) and into what eviction sees, so nothing tentative
// reaches any of them.
#include <algorithm>
#include <map>

#include "core/assert.h"
#include "sched/scheduler.h"
#include "sched/scheduler_internal.h"

namespace pagoda {

status scheduler::resolve_speculation(request_state& r) const {
  const request& req = r.req;
  const bool own = !req.speculative.empty();
  auto spec = parse_spec_config(own ? req.speculative : config_.speculative);
  if (!spec.ok()) return spec.error().with_context(own ? "speculative" : "--speculative");
  r.spec = *spec;
  if (!r.spec.enabled()) return {};
  if (!config_.speculation_refusal.empty())
    return error(errc::invalid_argument, "{}: {}", own ? "speculative" : "--speculative", config_.speculation_refusal);
  if (r.spec.model_drafter()) {
    const char* where = own ? "speculative" : "--speculative";
    if (r.spec.drafter == "draft" && !config_.draft_model)
      return error(errc::invalid_argument, "{}: draft: this engine has no draft model (start it with --draft-model PATH)", where);
    const int n_layers = config_.n_model_layers > 0 ? config_.n_model_layers : config_.policy_shape.n_layers;
    if (r.spec.layers > n_layers)
      return error(errc::invalid_argument, "{}: {}: layers={}: this model has {} layers", where, r.spec.drafter,
                   r.spec.layers, n_layers);
    if (r.spec.view == draft_view::quest && !config_.key_summaries)
      return error(errc::invalid_argument,
                   "{}: {}: view=quest reads the KV's per-block key summaries, which this engine does not keep; start "
                   "it with --speculative {} (or a quest --kv-policy)",
                   where, r.spec.drafter, r.spec.to_string());
    if (const char* type = r.spec.mirror(); type && config_.kv_mirror != type)
      return error(errc::invalid_argument,
                   "{}: {}: view={} reads a {} copy of the KV kept beside the cache, which this engine does not keep; "
                   "start it with --speculative {}",
                   where, r.spec.drafter, type, type, r.spec.to_string());
  }
  // KV policies, attention statistics and prompt logits combine with every
  // drafter: the policy sees the rows that stood (commit_verified), a sparse
  // read selects per row, a draft model's KV follows compactions (its group
  // is gathered with the target's; a per-head one keeps its first row's slots).
  return {};
}

std::vector<token_id> scheduler::propose_drafts(sequence& s, int n, int budget) const {
  // Decoding only: one token to compute (the last sampled one), the prompt done.
  const int n_tokens = static_cast<int>(s.tokens.size());
  if (n != 1 || s.n_computed + 1 != n_tokens || s.n_computed < s.n_prompt) return {};
  const request& r = s.req->req;
  // Never past the budget, max_tokens or the context: a step emits at most
  // 1 + k tokens, the last of which may be the one that reaches a limit.
  // And k + 1 <= block_size: the step's slots span at most two blocks, the
  // two staging slots a sequence has for sealed KV formats, which the
  // runner holds for the drafts (kv_arena.h).
  const int k = std::min({s.spec->k.next(), budget - n, r.max_tokens - s.n_generated - 1,
                          config_.max_model_len - (n_tokens - s.pos_shift) - 1, config_.block_size - 1});
  if (k < 1) return {};
  // A model drafter drafts in the runner: k placeholders it fills.
  if (!s.spec->drafts) return std::vector<token_id>(static_cast<std::size_t>(k), k_runner_draft);
  return s.spec->drafts->propose(s.tokens, s.n_prompt, k);
}

void scheduler::count_spec_time(const step_plan& plan, const step_output& out) {
  std::map<std::string, std::int64_t> tokens;  // by drafter: the step's draft tokens
  std::int64_t total = 0;
  for (const scheduled_seq& q : plan.seqs) {
    if (q.draft.empty()) continue;
    const sequence* s = by_id(q.seq);
    if (!s || !s->spec) continue;
    tokens[s->spec->config.drafter] += static_cast<std::int64_t>(q.draft.size());
    total += static_cast<std::int64_t>(q.draft.size());
  }
  for (const auto& [name, n] : tokens) {
    spec_decode_stats& c = stats_.spec_decode[name];
    const double share = static_cast<double>(n) / static_cast<double>(total);
    c.draft_seconds += share * out.draft_seconds;
    c.verify_seconds += share * out.forward_seconds;
  }
}

std::span<const token_id> scheduler::drafts_of(const scheduled_seq& q, const step_output& out, std::size_t i) {
  if (!q.runner_drafts) return q.draft;
  return i < out.drafts.size() ? std::span<const token_id>(out.drafts[i]) : std::span<const token_id>();
}

void scheduler::commit_verified(sequence* s, const scheduled_seq& q, std::span<const token_id> drafts,
                                const attention_stats* stats, std::span<sampled_token> emitted,
                                std::vector<engine_event>& events) {
  const auto n_draft = static_cast<int>(q.draft.size());
  const int n_accepted = static_cast<int>(emitted.size()) - 1;
  // The tokens that stand: up to the first that finishes the sequence (EOS, a
  // stop token, max_tokens, the context); what the runner drew after it goes.
  int n_keep = 0;
  while (n_keep < static_cast<int>(emitted.size())) {
    ++n_keep;
    if (!finish_reason_of(*s, emitted[static_cast<std::size_t>(n_keep - 1)].token, s->n_generated + n_keep,
                          static_cast<int>(s->tokens.size()) + n_keep).empty())
      break;
  }
  // Verified K/V: the last token's and the accepted drafts' before the last
  // kept token (whose own K/V, as in plain decoding, are computed next step).
  const auto n_commit = static_cast<std::size_t>(n_keep);
  // The step's tokens as verified: the known ones, then the drafts (the
  // runner's, in place of the placeholders, for a model drafter).
  std::vector<token_id> tokens(q.tokens.begin(), q.tokens.end() - static_cast<std::ptrdiff_t>(n_draft));
  tokens.insert(tokens.end(), drafts.begin(), drafts.end());
  status st = kv_.commit(s->id, std::span(tokens).first(n_commit), std::span(q.positions).first(n_commit));
  PAGODA_ASSERT(st.ok(), "commit of verified tokens: {}", st.message());
  const std::int32_t n_stored = kv_.n_stored_tokens(s->id);
  st = kv_.truncate(s->id, n_stored);  // the rejected drafts' slots: released, or rewound in the kept last block
  PAGODA_ASSERT(st.ok(), "rolling back rejected drafts: {}", st.message());
  s->runner.positions_changed_from(n_stored);
  // The policy sees the rows that stood, each as a plain step; its selector
  // forgets the rejected ones (their keys reached it in the forward pass).
  if (s->pol) s->pol->commit_verified(static_cast<int>(n_commit), static_cast<int>(q.tokens.size()), stats);
  s->n_computed += n_keep;
  spec_decode_stats& c = stats_.spec_decode[s->spec->config.drafter];
  ++c.n_drafts;
  c.n_draft_tokens += n_draft;
  c.n_accepted_tokens += n_accepted;
  for (int i = 0; i < n_accepted; ++i) ++c.accepted_per_pos[static_cast<std::size_t>(i)];
  s->spec->k.observe(n_draft, n_accepted);
  s->spec->planned.clear();
  commit_tokens(s, emitted.first(n_commit), events);
}

std::string scheduler::finish_reason_of(const sequence& s, token_id tok, int n_generated, int n_tokens) const {
  const request& r = s.req->req;
  const bool stop_token = std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), tok) != r.stop_token_ids.end();
  if ((!r.ignore_eos && vocab_.is_eog(tok)) || stop_token) return "stop";
  // The context bounds the position the next token would take: with
  // positions renumbered within the cache (a streaming window) that is
  // n_tokens - pos_shift, and the stream goes on past the context.
  if (n_generated >= r.max_tokens || n_tokens - s.pos_shift >= config_.max_model_len) return "length";
  return {};
}

void scheduler::commit_tokens(sequence* s, std::span<sampled_token> tokens, std::vector<engine_event>& events) {
  request_state* r = s->req;
  engine_event e;
  e.request_id = r->req.id;
  e.index = s->index;
  r->first_token_seen = true;
  std::string reason;
  for (sampled_token& t : tokens) {
    e.tokens.push_back(t.token);
    if (r->req.logprobs >= 0 && t.logprob) e.logprobs.push_back(std::move(*t.logprob));
    s->tokens.push_back(t.token);
    ++s->n_generated;
    ++r->completion_tokens;
    ++stats_.n_generated_tokens;
    // What the token alone decides; stop strings are the output step's (output_processor.h).
    reason = t.grammar_end ? "grammar" : finish_reason_of(*s, t.token, s->n_generated, static_cast<int>(s->tokens.size()));
    if (!reason.empty()) break;
  }
  events.push_back(std::move(e));
  if (!reason.empty()) finish(s, reason, events);
}

void scheduler::uncount_tokens(const std::string& id, int n_dropped, engine_event& e) {
  const auto it = requests_.find(id);
  if (it == requests_.end() || n_dropped <= 0) return;
  it->second->completion_tokens -= n_dropped;
  stats_.n_generated_tokens -= n_dropped;
  if (e.request_finished) e.usage.completion_tokens -= n_dropped;
}

}  // namespace pagoda
