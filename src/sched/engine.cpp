#include "sched/engine.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "core/clock.h"

namespace pagoda {

struct engine::request_state {
  request req;
  std::int64_t arrival = 0;     // order of arrival
  std::int64_t arrival_us = 0;  // wall clock of arrival
  std::vector<std::unique_ptr<seq_state>> seqs;  // [completion index]; 0 runs the prompt
  bool forked = false;          // children created (n > 1)
  bool first_token_seen = false;
  int n_finished = 0;
  int cached_tokens = -1;       // prompt tokens from the prefix cache at first admission
  int completion_tokens = 0;
};

struct engine::seq_state {
  request_state* req = nullptr;
  int index = 0;
  seq_id id;
  std::vector<token_id> tokens;  // prompt, then generated
  int n_prompt = 0;
  int n_computed = 0;            // tokens whose K/V are stored
  int n_generated = 0;
  std::int64_t start_order = -1; // >= 0 while running
  bool in_kv = false;            // registered with the KV manager
  bool finished = false;
  std::int64_t last_token_us = 0;
  sampler smp;
  stream_decoder decoder;
  stop_matcher stops;

  seq_state(request_state* r, int idx, seq_id sid, const tokenizer& vocab, std::uint64_t seed)
      : req(r), index(idx), id(sid), tokens(r->req.prompt), n_prompt(static_cast<int>(r->req.prompt.size())),
        smp([&] {
          sampling_params p = r->req.sampling;
          p.seed = seed;
          return p;
        }()),
        decoder(vocab, /*at_text_start=*/false),
        stops(r->req.stop) {}
};

result<std::unique_ptr<engine>> engine::create(const llama_model& model, const engine_config& config) {
  const llama_hparams& hp = model.hparams();
  if (config.kv.n_layers != hp.n_layer || config.kv.n_kv_heads != hp.n_head_kv || config.kv.head_dim != hp.head_dim)
    return error(errc::invalid_argument, "KV layout ({} layers, {} KV heads, head_dim {}) does not match the model",
                 config.kv.n_layers, config.kv.n_kv_heads, config.kv.head_dim);
  if (config.max_num_seqs < 1) return error(errc::invalid_argument, "--max-num-seqs must be at least 1");
  if (config.max_num_batched_tokens < 1) return error(errc::invalid_argument, "--max-num-batched-tokens must be at least 1");
  if (config.n_blocks < 1 || config.n_blocks > (1ll << 30))
    return error(errc::invalid_argument, "KV pool of {} blocks is out of range", config.n_blocks);
  std::unique_ptr<engine> e(new engine(model, config));
  if (e->config_.max_model_len <= 0) e->config_.max_model_len = hp.n_ctx_train;
  PAGODA_ASSIGN_OR_RETURN(e->storage_, kv_storage::create(config.kv, config.n_blocks));
  e->kv_mgr_ = std::make_unique<kv_manager>(config.kv.block_size, static_cast<std::int32_t>(config.n_blocks),
                                            config.enable_prefix_caching);
  for (const auto& [tenant, quota] : config.tenant_quota_blocks)
    PAGODA_RETURN_IF_ERROR(e->kv_mgr_->set_tenant_quota(tenant, quota));
  e->ctx_ = std::make_unique<llama_context>(model, *e->storage_, config.n_threads);
  return e;
}

engine::engine(const llama_model& model, const engine_config& config) : model_(model), config_(config) {}
engine::~engine() = default;

status engine::add_request(request req) {
  const llama_hparams& hp = model_.hparams();
  if (req.id.empty()) return error(errc::invalid_argument, "request id is empty");
  if (requests_.contains(req.id)) return error(errc::invalid_argument, "request id '{}' is already in use", req.id);
  if (req.prompt.empty()) return error(errc::invalid_argument, "request '{}': the prompt is empty", req.id);
  for (token_id t : req.prompt)
    if (t < 0 || t >= hp.n_vocab)
      return error(errc::invalid_argument, "request '{}': token id {} outside the vocabulary of {}", req.id, t, hp.n_vocab);
  if (req.n < 1 || req.n > 128) return error(errc::invalid_argument, "request '{}': n must be in [1, 128], got {}", req.id, req.n);
  if (req.max_tokens < 1)
    return error(errc::invalid_argument, "request '{}': max_tokens must be at least 1, got {}", req.id, req.max_tokens);
  if (auto st = req.sampling.validate(); !st.ok()) return st.with_context(fmt::format("request '{}'", req.id));
  const std::int64_t total = static_cast<std::int64_t>(req.prompt.size()) + req.max_tokens;
  if (total > config_.max_model_len)
    return error(errc::out_of_range,
                 "request '{}': prompt ({} tokens) plus max_tokens ({}) is {} tokens, beyond the context of {}", req.id,
                 req.prompt.size(), req.max_tokens, total, config_.max_model_len);
  std::string tenant = req.tenant;
  if (auto st = kv_mgr_->check_request_fits(static_cast<std::int32_t>(req.prompt.size()), req.max_tokens, tenant, req.n);
      !st.ok())
    return st.with_context(fmt::format("request '{}'", req.id));
  if (static_cast<int>(waiting_.size()) >= config_.max_waiting)
    return error(errc::resource_exhausted, "the request queue is full ({} waiting)", waiting_.size());

  auto r = std::make_unique<request_state>();
  r->req = std::move(req);
  r->arrival = next_arrival_++;
  r->arrival_us = now_us();
  // Completion i draws from seed + i, so completion 0 equals an n = 1 request.
  r->seqs.push_back(std::make_unique<seq_state>(r.get(), 0, seq_id(next_seq_++), model_.vocab(), r->req.sampling.seed));
  seq_state* s = r->seqs[0].get();
  // Waiting order: priority, then arrival; preempted sequences stay at the front.
  auto pos = waiting_.end();
  while (pos != waiting_.begin()) {
    seq_state* prev = *(pos - 1);
    if (prev->start_order < 0 && prev->n_computed == 0 && prev->req->req.priority > r->req.priority &&
        prev->n_generated == 0)
      --pos;
    else
      break;
  }
  waiting_.insert(pos, s);
  stats_.n_prompt_tokens += static_cast<std::int64_t>(r->req.prompt.size());
  requests_.emplace(r->req.id, std::move(r));
  stats_.n_waiting = static_cast<int>(waiting_.size());
  return {};
}

void engine::remove_from_running(seq_state* s) {
  auto it = std::find(running_.begin(), running_.end(), s);
  if (it != running_.end()) running_.erase(it);
  s->start_order = -1;
}

engine::seq_state* engine::pick_victim() {
  // Lowest priority (largest value) first, then the most recently started.
  seq_state* victim = nullptr;
  for (seq_state* s : running_)
    if (!victim || s->req->req.priority > victim->req->req.priority ||
        (s->req->req.priority == victim->req->req.priority && s->start_order > victim->start_order))
      victim = s;
  return victim;
}

void engine::preempt(seq_state* s) {
  status st = kv_mgr_->preempt_sequence(s->id);
  PAGODA_ASSERT(st.ok(), "preempting a running sequence: {}", st.message());
  s->in_kv = false;
  s->n_computed = 0;
  remove_from_running(s);
  waiting_.push_front(s);
}

void engine::fork_children(seq_state* parent) {
  request_state* r = parent->req;
  r->forked = true;
  for (int i = 1; i < r->req.n; ++i) {
    auto child = std::make_unique<seq_state>(r, i, seq_id(next_seq_++), model_.vocab(), r->req.sampling.seed + i);
    status st = kv_mgr_->fork(parent->id, child->id);
    PAGODA_ASSERT(st.ok(), "fork: {}", st.message());
    child->tokens = parent->tokens;
    child->n_computed = parent->n_computed;
    child->in_kv = true;
    child->start_order = next_start_++;
    running_.push_back(child.get());
    r->seqs.push_back(std::move(child));
  }
}

void engine::finish(seq_state* s, const std::string& reason, std::vector<engine_event>& events) {
  request_state* r = s->req;
  if (s->in_kv) {
    status st = kv_mgr_->free_sequence(s->id);
    PAGODA_ASSERT(st.ok(), "free: {}", st.message());
    s->in_kv = false;
  }
  if (s->start_order >= 0) remove_from_running(s);
  else if (auto it = std::find(waiting_.begin(), waiting_.end(), s); it != waiting_.end()) waiting_.erase(it);
  s->finished = true;
  ++r->n_finished;
  if (events.empty() || events.back().request_id != r->req.id || events.back().index != s->index ||
      !events.back().finish_reason.empty()) {
    engine_event e;
    e.request_id = r->req.id;
    e.index = s->index;
    events.push_back(std::move(e));
  }
  engine_event& e = events.back();
  e.finish_reason = reason;
  // Before the prompt is computed (only an abort can end it then) the children
  // of an n > 1 request are not born yet.
  const int expected = r->forked ? r->req.n : 1;
  if (r->n_finished >= expected) {
    e.request_finished = true;
    e.usage.prompt_tokens = static_cast<int>(r->req.prompt.size());
    e.usage.completion_tokens = r->completion_tokens;
    e.usage.cached_tokens = std::max(r->cached_tokens, 0);
    stats_.e2e_seconds.observe((now_us() - r->arrival_us) * 1e-6);
    ++stats_.n_requests_finished;
    finished_requests_.push_back(r->req.id);
  }
}

void engine::sample_next(seq_state* s, std::span<const float> logits, std::vector<engine_event>& events) {
  request_state* r = s->req;
  const tokenizer& vocab = model_.vocab();
  token_id tok = s->smp.sample(logits);
  engine_event e;
  e.request_id = r->req.id;
  e.index = s->index;
  e.tokens.push_back(tok);
  if (r->req.logprobs >= 0) {
    token_logprob lp;
    lp.token = tok;
    lp.logprob = sampler::log_prob(logits, tok);
    if (r->req.logprobs > 0) lp.top = sampler::top_log_probs(logits, r->req.logprobs);
    e.logprobs.push_back(std::move(lp));
  }
  std::int64_t now = now_us();
  if (!r->first_token_seen) {
    r->first_token_seen = true;
    stats_.ttft_seconds.observe((now - r->arrival_us) * 1e-6);
  } else if (s->last_token_us > 0) {
    stats_.itl_seconds.observe((now - s->last_token_us) * 1e-6);
  }
  s->last_token_us = now;
  s->tokens.push_back(tok);
  ++s->n_generated;
  ++r->completion_tokens;
  ++stats_.n_generated_tokens;

  std::string reason;
  bool stop_token = std::find(r->req.stop_token_ids.begin(), r->req.stop_token_ids.end(), tok) != r->req.stop_token_ids.end();
  if ((!r->req.ignore_eos && vocab.is_eog(tok)) || stop_token) {
    reason = "stop";
    e.text = s->stops.flush();
  } else {
    e.text = s->stops.push(s->decoder.push(tok));
    if (s->stops.stopped()) reason = "stop";
  }
  if (reason.empty() && (s->n_generated >= r->req.max_tokens ||
                         static_cast<int>(s->tokens.size()) >= config_.max_model_len)) {
    reason = "length";
    e.text += s->stops.push(s->decoder.flush());
    e.text += s->stops.flush();
  }
  events.push_back(std::move(e));
  if (!reason.empty()) finish(s, reason, events);
}

bool engine::abort_request(const std::string& id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  request_state* r = it->second.get();
  for (auto& s : r->seqs)
    if (!s->finished) finish(s.get(), "abort", pending_events_);
  return true;
}

status engine::step(std::vector<engine_event>& events) {
  for (engine_event& e : pending_events_) events.push_back(std::move(e));
  pending_events_.clear();
  for (const std::string& id : finished_requests_) requests_.erase(id);
  finished_requests_.clear();
  if (!has_work()) return {};

  struct planned {
    seq_state* s;
    int n;
  };
  std::vector<planned> plan;
  int budget = config_.max_num_batched_tokens;
  bool preempted = false;
  auto unplan = [&](seq_state* s) {
    for (auto p = plan.begin(); p != plan.end(); ++p)
      if (p->s == s) {
        budget += p->n;
        plan.erase(p);
        return;
      }
  };

  // 1. Running sequences, oldest first: their next decode token or prompt chunk.
  std::vector<seq_state*> order = running_;
  for (seq_state* s : order) {
    if (budget <= 0) break;
    if (s->start_order < 0) continue;  // preempted earlier in this step
    int n = std::min<int>(static_cast<int>(s->tokens.size()) - s->n_computed, budget);
    PAGODA_ASSERT(n > 0, "a running sequence has nothing to compute");
    for (;;) {
      std::optional<allocation> a = kv_mgr_->allocate(s->id, n);
      if (a) {
        for (const block_copy& c : a->copies) storage_->copy_block(c.src, c.dst);
        plan.push_back({s, n});
        budget -= n;
        break;
      }
      seq_state* victim = pick_victim();
      unplan(victim);
      preempt(victim);
      preempted = true;
      if (victim == s) break;
    }
  }

  // Tokens planned for this step are committed now, before the forward pass:
  // their full blocks enter the prefix index at once, so a request admitted
  // below reuses blocks that this very step computes. That is safe because the
  // forward pass writes every sequence's K/V of a layer before any attention of
  // that layer reads. Victims are settled by now, so no planned block is dropped.
  auto commit_planned = [&](seq_state* s, int n) {
    status st = kv_mgr_->commit(s->id, std::span(s->tokens).subspan(s->n_computed, n));
    PAGODA_ASSERT(st.ok(), "commit: {}", st.message());
  };
  for (const planned& p : plan) commit_planned(p.s, p.n);

  // 2. Waiting sequences, in order, while the budget, the sequence cap and the
  // pool allow (none after a preemption: the pool is already short).
  while (!preempted && budget > 0 && !waiting_.empty()) {
    seq_state* s = waiting_.front();
    request_state* r = s->req;
    int slots = (s->index == 0 && !r->forked) ? r->req.n : 1;
    if (static_cast<int>(running_.size()) + slots > config_.max_num_seqs) break;
    if (kv_mgr_->n_free_blocks() == 0) break;
    if (!s->in_kv) {
      sequence_options opts;
      opts.tenant = r->req.tenant;
      opts.cache_salt = r->req.cache_salt;
      auto cached = kv_mgr_->add_sequence(s->id, s->tokens, opts);
      PAGODA_ASSERT(cached.ok(), "add_sequence: {}", cached.error().message());
      s->in_kv = true;
      s->n_computed = *cached;
      if (r->cached_tokens < 0) r->cached_tokens = std::min(*cached, s->n_prompt);
    }
    int n = std::min<int>(static_cast<int>(s->tokens.size()) - s->n_computed, budget);
    std::optional<allocation> a = kv_mgr_->allocate(s->id, n);
    if (!a) {
      status st = kv_mgr_->free_sequence(s->id);
      PAGODA_ASSERT(st.ok(), "free: {}", st.message());
      s->in_kv = false;
      s->n_computed = 0;
      break;
    }
    for (const block_copy& c : a->copies) storage_->copy_block(c.src, c.dst);
    waiting_.pop_front();
    s->start_order = next_start_++;
    running_.push_back(s);
    plan.push_back({s, n});
    budget -= n;
    commit_planned(s, n);
  }
  stats_.n_running = static_cast<int>(running_.size());
  stats_.n_waiting = static_cast<int>(waiting_.size());
  stats_.peak_running = std::max<std::int64_t>(stats_.peak_running, stats_.n_running);
  if (plan.empty()) return {};

  // 3. One forward pass for everything planned.
  std::vector<forward_seq> batch;
  batch.reserve(plan.size());
  for (const planned& p : plan)
    batch.push_back({std::span(p.s->tokens).subspan(p.s->n_computed, p.n), p.s->n_computed,
                     kv_mgr_->block_table(p.s->id), false});
  PAGODA_RETURN_IF_ERROR(ctx_->forward(batch, logits_));
  ++stats_.n_steps;

  // 4. Sample where a sequence is fully computed.
  const int V = model_.hparams().n_vocab;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    seq_state* s = plan[i].s;
    const int n = plan[i].n;
    if (s->n_computed < s->n_prompt) stats_.n_computed_prompt_tokens += std::min(n, s->n_prompt - s->n_computed);
    s->n_computed += n;
    if (s->n_computed < static_cast<int>(s->tokens.size())) continue;  // prompt chunk, more to come
    std::span<const float> row(&logits_[i * V], V);
    if (s->index == 0 && s->req->req.n > 1 && !s->req->forked) {
      fork_children(s);
      for (auto& c : s->req->seqs)
        if (c.get() != s) sample_next(c.get(), row, events);
    }
    sample_next(s, row, events);
  }
  stats_.n_running = static_cast<int>(running_.size());
  stats_.n_waiting = static_cast<int>(waiting_.size());
  return {};
}

}  // namespace pagoda
