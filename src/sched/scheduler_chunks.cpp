// Chunk reuse (CacheBlend; docs/serving.md, "Chunk reuse"). A prompt part
// marked "reuse": "chunk" has its K/V computed ALONE, by a sequence of its
// own whose tokens are the part's whole blocks at positions 0, 1, ...; its
// blocks enter the prefix cache (and the KV store's tiers) under keys that
// name a chunk (sequence_options::chunk), so any later request holding the
// same tokens, wherever they stand in its prompt, finds them. The request's
// own sequence waits until its chunks are computed; when its prefill reaches
// the first chunk, each chunk's blocks are taken from the cache and copied
// into its slots by a gather op whose rotation turns the keys from positions
// 0.. to the chunk's own (RoPE is a rotation). The prompt's next steps then
// carry a `reused` mask: the runner recomputes the other tokens and the
// `recompute` fraction of the chunk's tokens whose K/V deviate most at an
// early layer (cpu_runner_blend.cpp). The sequence is off chain from there:
// blended K/V never enter the prefix cache as a prompt's.
//
// A chunk whose blocks left the cache between its computation and the
// import (memory pressure) is computed in context like any other text.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "core/assert.h"
#include "sched/scheduler_internal.h"

namespace pagoda {

status scheduler::add_chunks(request_state& r) {
  const request& req = r.req;
  std::vector<const prompt_segment*> marked;
  for (const prompt_segment& p : req.segments)
    if (p.reuse_chunk) marked.push_back(&p);
  if (marked.empty()) return {};
  float recompute = -1.0f;
  for (const prompt_segment* p : marked) {
    if (p->begin < 0 || p->end > static_cast<std::int32_t>(req.prompt.size()) || p->end <= p->begin)
      return error(errc::invalid_argument, "a part marked for chunk reuse holds no prompt token ([{}, {}))", p->begin,
                   p->end);
    if (p->recompute > 1.0f || std::isnan(p->recompute))
      return error(errc::invalid_argument, "recompute must be in [0, 1], got {}", p->recompute);
    if (recompute >= 0 && p->recompute >= 0 && p->recompute != recompute)
      return error(errc::invalid_argument, "the parts marked for chunk reuse name different recompute fractions ({} "
                   "and {}); give them one", recompute, p->recompute);
    if (p->recompute >= 0) recompute = p->recompute;
  }
  // What chunk reuse cannot combine with, each said plainly.
  if (!config_.chunk_reuse_refusal.empty()) return error(errc::unsupported, "{}", config_.chunk_reuse_refusal);
  if (!config_.enable_prefix_caching)
    return error(errc::unsupported, "chunk reuse keeps chunks in the prefix cache, which this engine runs without "
                 "(--no-prefix-caching)");
  if (kv_.n_groups() != 1)
    return error(errc::unsupported, "chunk reuse copies one KV group's slots; this engine keeps {} (a sliding-window "
                 "model or a draft model)", kv_.n_groups());
  if (computes_whole_prompt(req))
    return error(errc::unsupported, "prompt logits and logprobs need every prompt token computed in its context: drop "
                 "the chunk reuse marks to score a prompt");
  if (!r.kv_classes.empty())
    return error(errc::unsupported, "chunk reuse keeps chunks in the default KV type: drop the parts' KV types");
  if (r.seqs[0]->pol)
    return error(errc::unsupported, "chunk reuse rewrites slots a KV policy tracks: use kv_policy none with chunk "
                 "reuse");
  if (r.spec.drafter == "draft" || r.spec.mirror())
    return error(errc::unsupported, "speculative {}: its draft KV is kept apart from the chunks'; use ngram, "
                 "early-exit or self without a view type with chunk reuse", r.spec.to_string());
  std::sort(marked.begin(), marked.end(), [](const prompt_segment* a, const prompt_segment* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < marked.size(); ++i)
    if (marked[i]->begin < marked[i - 1]->end)
      return error(errc::invalid_argument, "parts marked for chunk reuse overlap ([{}, {}) and [{}, {}))",
                   marked[i - 1]->begin, marked[i - 1]->end, marked[i]->begin, marked[i]->end);
  r.recompute = recompute >= 0 ? recompute : config_.chunk_recompute;
  const int bs = config_.block_size;
  for (const prompt_segment* p : marked) {
    const int n = (p->end - p->begin) / bs * bs;
    if (n == 0) continue;  // shorter than a block: computed in context
    request_state::chunk c;
    c.at = p->begin;
    c.n = n;
    c.seq = std::make_unique<sequence>(&r, -1, seq_id(next_seq_++));
    c.seq->chunk = static_cast<int>(r.chunks.size());
    // One token more than the chunk (its last, again): a sequence computes its
    // last prompt token whatever the cache holds, so this way every block of
    // a cached chunk is a hit and only that token is computed (then dropped).
    c.seq->tokens.assign(req.prompt.begin() + c.at, req.prompt.begin() + c.at + n);
    c.seq->tokens.push_back(c.seq->tokens.back());
    c.seq->n_prompt = n + 1;
    r.chunks.push_back(std::move(c));
  }
  if (static_cast<int>(r.chunks.size()) + 1 > config_.max_num_seqs)
    return error(errc::invalid_argument, "{} chunks to reuse are computed as {} sequences beside the request's own, "
                 "beyond --max-num-seqs {}", r.chunks.size(), r.chunks.size(), config_.max_num_seqs);
  for (request_state::chunk& c : r.chunks) {
    seqs_.emplace(c.seq->id, c.seq.get());
    enqueue_by_priority(c.seq.get());
  }
  return {};
}

bool scheduler::chunks_settled(const sequence& s) const {
  if (s.chunk >= 0) return true;
  return std::all_of(s.req->chunks.begin(), s.req->chunks.end(), [](const request_state::chunk& c) { return c.done; });
}

bool scheduler::chunks_due(const sequence& s) const {
  if (s.chunk >= 0) return false;
  int first = INT32_MAX;
  for (const request_state::chunk& c : s.req->chunks)
    if (c.done && !c.imported && c.at >= s.n_computed) first = std::min(first, c.at);
  return first == s.n_computed;
}

int scheduler::chunk_alloc(const sequence& s, int n) const {
  if (!chunks_due(s)) return n;
  int end = 0;
  for (const request_state::chunk& c : s.req->chunks)
    if (c.done && !c.imported && c.at >= s.n_computed) end = std::max(end, c.at + c.n);
  return std::max(n, end - s.n_computed);
}

void scheduler::import_chunks(sequence* s) {
  const int bs = config_.block_size;
  sequence_options opts = kv_options(*s);
  opts.chunk = true;
  opts.classes = {};
  opts.side = {};
  bool any = false;
  for (request_state::chunk& c : s->req->chunks) {
    if (!c.done || c.imported || c.at < s->n_computed) continue;
    // The chunk's blocks, held while the gather reads them (its sequence's
    // tokens: one more than the chunk, so that every block of it may be a hit).
    const seq_id tmp(next_seq_++);
    auto cached = kv_.add_sequence(tmp, c.seq->tokens, opts);
    PAGODA_ASSERT(cached.ok(), "add_sequence of a chunk: {}", cached.error().message());
    if (*cached == c.n) {
      auto g = std::make_shared<kv_gather>();
      g->group = 0;
      const std::span<const block_id> src = kv_.block_table(tmp, 0);
      g->src_table.assign(src.begin(), src.begin() + c.n / bs);
      const std::span<const block_id> dst = kv_.block_table(s->id, 0);
      g->dst_table.assign(dst.begin(), dst.end());
      g->first = c.at;
      g->n = c.n;
      g->sources.resize(static_cast<std::size_t>(c.n));
      std::iota(g->sources.begin(), g->sources.end(), 0);
      g->rotate.assign(static_cast<std::size_t>(c.n), c.at - s->pos_shift);  // computed at 0.., read at its position
      pending_ops_.push_back(kv_op{.kind = kv_op_kind::gather, .gather = std::move(g), .group = 0});
      if (s->reused.size() < static_cast<std::size_t>(s->n_prompt)) s->reused.resize(static_cast<std::size_t>(s->n_prompt), 0);
      std::fill_n(s->reused.begin() + c.at, c.n, std::uint8_t{1});
      any = true;
    }
    // Else some block left the cache since the chunk was computed: its tokens are computed in context.
    c.imported = true;
    status st = kv_.free_sequence(tmp);
    PAGODA_ASSERT(st.ok(), "free: {}", st.message());
  }
  // Blended K/V are not what a plain prefill computes: they never enter the prefix cache as a prompt's.
  if (any) kv_.set_off_chain(s->id);
}

void scheduler::end_chunk(sequence* c) {
  end_loading(c);
  if (c->in_kv) {
    status st = kv_.free_sequence(c->id);
    PAGODA_ASSERT(st.ok(), "free: {}", st.message());
    c->in_kv = false;
  }
  if (c->start_order >= 0) remove_from_running(c);
  else if (auto it = std::find(waiting_.begin(), waiting_.end(), c); it != waiting_.end()) waiting_.erase(it);
  c->phase = seq_phase::finished;
  if (c->runner.known) runner_finished_.push_back(c->id);
  c->runner = runner_mirror{};
  c->req->chunks[static_cast<std::size_t>(c->chunk)].done = true;
}

void scheduler::end_chunks(request_state& r) {
  for (request_state::chunk& c : r.chunks)
    if (c.seq->phase != seq_phase::finished) end_chunk(c.seq.get());
}

}  // namespace pagoda
