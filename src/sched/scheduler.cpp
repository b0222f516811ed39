#include "sched/scheduler.h"

#include "policy/streaming.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "core/clock.h"
#include "sched/image_spans.h"
#include "sched/scheduler_internal.h"

namespace pagoda {

namespace {

bool any_segment_policy(std::span<const prompt_segment> segments) {
  return std::any_of(segments.begin(), segments.end(), [](const prompt_segment& p) { return !p.kv_policy.empty(); });
}

// Prompt logprobs: the forward pass keeps a logits row of every token of
// the step, [tokens][n_vocab] floats; at most this many tokens a step bound
// them (64 MB at a 128K-token vocabulary) whatever the prompt's length.
constexpr int k_max_scored_tokens = 128;

// A policy spec's name ("quest:budget=0.125" -> "quest"): the label of its reads.
std::string policy_name(std::string_view spec) {
  const std::string_view name = spec.substr(0, spec.find(':'));
  return name.empty() ? std::string("none") : std::string(name);
}

}  // namespace

namespace {

std::vector<kv_group_config> groups_of(const scheduler_config& c) {
  std::vector<kv_group_config> groups = c.kv_groups;
  if (groups.empty()) {
    kv_group_config g;
    g.class_blocks = c.kv_class_blocks.empty()
                         ? std::vector<std::int32_t>{static_cast<std::int32_t>(std::clamp<std::int64_t>(c.n_blocks, 0, INT32_MAX))}
                         : c.kv_class_blocks;
    groups.push_back(std::move(g));
  }
  for (kv_group_config& g : groups) g.eviction = c.prefix_cache_eviction;
  return groups;
}

}  // namespace

scheduler::scheduler(const scheduler_config& config, const tokenizer& vocab)
    : config_(config),
      clock_(config.clock ? config.clock : &system_clock_source()),
      vocab_(vocab),
      kv_(config.block_size, groups_of(config), config.enable_prefix_caching) {
  if (config_.max_num_seqs < 1) config_status_ = error(errc::invalid_argument, "--max-num-seqs must be at least 1");
  if (config_.max_num_batched_tokens < 1)
    config_status_ = error(errc::invalid_argument, "--max-num-batched-tokens must be at least 1");
  if (config_.n_blocks < 1 || config_.n_blocks > (1ll << 30))
    config_status_ = error(errc::invalid_argument, "KV pool of {} blocks is out of range", config_.n_blocks);
  for (const auto& [tenant, quota] : config_.tenant_quota_blocks)
    if (status st = kv_.set_tenant_quota(tenant, quota); !st.ok()) config_status_ = st;
  if (config_.side_block_bytes < 0) config_status_ = error(errc::invalid_argument, "side_block_bytes is negative");
  kv_.set_side_block_bytes(std::max<std::int64_t>(config_.side_block_bytes, 0));
  kv_.set_op_listener([this](const kv_op& op) { pending_ops_.push_back(op); });
  if (!config_.kv_class_keys.empty()) {
    if (config_.kv_class_keys.size() == static_cast<std::size_t>(kv_.n_classes())) kv_.set_class_keys(config_.kv_class_keys);
    else config_status_ = error(errc::invalid_argument, "{} KV class keys for {} classes", config_.kv_class_keys.size(), kv_.n_classes());
  }
  config_.policy_shape.block_size = config_.block_size;
  kv_.set_max_step_tokens(config_.max_num_batched_tokens);
}

scheduler::~scheduler() = default;

// --- requests ------------------------------------------------------------------

status scheduler::add_request(request req) {
  const int n_vocab = vocab_.n_vocab();
  if (req.id.empty()) return error(errc::invalid_argument, "request id is empty");
  if (auto it = requests_.find(req.id); it != requests_.end()) {
    const request_state& old = *it->second;
    if (old.n_finished < (old.forked ? old.req.n : 1))
      return error(errc::invalid_argument, "request id '{}' is already in use", req.id);
    // Finished, only not yet forgotten (that happens at the next schedule()): forget it now.
    for (const auto& s : old.seqs) seqs_.erase(s->id);
    for (const auto& c : old.chunks) seqs_.erase(c.seq->id);
    requests_.erase(it);
  }
  // The messages below reach users (the server's 400s, batch's lines): they
  // never name the request's id, which is the caller's own.
  if (req.prompt.empty()) return error(errc::invalid_argument, "the prompt is empty");
  for (token_id t : req.prompt)
    if (t < 0 || t >= n_vocab)
      return error(errc::invalid_argument, "token id {} outside the vocabulary of {}", t, n_vocab);
  if (req.n < 1 || req.n > 128) return error(errc::invalid_argument, "n must be in [1, 128], got {}", req.n);
  if (req.n > config_.max_num_seqs)
    return error(errc::invalid_argument,
                 "n = {} completions can never run at once with --max-num-seqs {}; lower n or raise --max-num-seqs",
                 req.n, config_.max_num_seqs);
  if (req.max_tokens < 0)
    return error(errc::invalid_argument, "max_tokens must not be negative, got {}", req.max_tokens);
  if (req.prompt_logits && req.n != 1)
    return error(errc::invalid_argument, "prompt logits are returned for n = 1 only");
  if (req.prompt_logprobs < -1 || req.prompt_logprobs > request::k_max_prompt_logprobs)
    return error(errc::invalid_argument, "prompt_logprobs must be in [-1, {}], got {}", request::k_max_prompt_logprobs,
                 req.prompt_logprobs);
  PAGODA_RETURN_IF_ERROR(req.sampling.validate());
  if (!req.images.empty()) {
    PAGODA_RETURN_IF_ERROR(check_image_spans(req, config_.n_embd));
    PAGODA_RETURN_IF_ERROR(check_bidirectional_spans(req, config_.max_num_batched_tokens, k_max_scored_tokens));
    for (const prompt_segment& p : req.segments)
      if (p.reuse_chunk)
        return error(errc::unsupported, "segment [{}, {}): chunk reuse with images in the prompt is not supported "
                     "(a chunk computed alone would lose the image rows)", p.begin, p.end);
    add_image_segments(req, config_.kv_image_type, config_.kv_image_policy);
  }
  if (req.prompt_chunk < 0) return error(errc::invalid_argument, "prompt_chunk must not be negative");
  if (req.kv_policy.empty()) req.kv_policy = config_.kv_policy;
  std::vector<kv_class_run> classes;
  for (const prompt_segment& p : req.segments) {
    if (p.kv_type.empty()) continue;
    if (!config_.kv_class_of)
      return error(errc::invalid_argument, "segment [{}, {}): this engine keeps one KV type; start it with "
                   "--kv-segment-dtype {} to give parts that type", p.begin, p.end, p.kv_type);
    auto cls = config_.kv_class_of(p.kv_type);
    if (!cls.ok()) return cls.error().with_context(fmt::format("segment [{}, {})", p.begin, p.end));
    if (*cls != 0) classes.push_back(kv_class_run{p.begin, p.end, *cls});
  }
  side_charge side;
  {
    auto spec = parse_kv_policy_spec(req.kv_policy);
    if (!spec.ok()) return spec.error();
    auto made = new_policy(*spec, req.segments);
    if (!made.ok()) return made.error();
    // What make_policy will keep: no policy object for "none" without segment policies.
    const bool keeps_policy = !spec->is_none() || any_segment_policy(req.segments);
    side = seq_policy::side_memory_of(keeps_policy ? made->get() : nullptr, config_.policy_shape,
                                      config_.attention_stats_window);
    // Renumbered positions would bring tokens a sliding window already let go
    // back into its window: the one combination that cannot work.
    if (const std::string* pos = spec->find("positions"); pos && *pos == "cache" && kv_.has_sliding_window())
      return error(errc::unsupported,
                   "kv_policy {}: positions=cache renumbers the cache, which would bring tokens this model's "
                   "sliding-window layers have already let go back into their window; keep positions, or start "
                   "the engine with --swa-full",
                   spec->to_string());
    if ((*made)->needs().key_summaries && !config_.key_summaries)
      return error(errc::invalid_argument,
                   "kv_policy {} reads per-block key summaries, which this engine does not keep; start it with "
                   "--kv-key-summaries (or --kv-policy {})",
                   spec->name, spec->name);
  }
  for (const auto& [t, bias] : req.sampling.logit_bias)
    if (t >= n_vocab)
      return error(errc::invalid_argument, "logit_bias: token id {} outside the vocabulary of {}", t, n_vocab);
  const std::int64_t total = static_cast<std::int64_t>(req.prompt.size()) + req.max_tokens;
  // StreamingLLM (policy/streaming.h): a fixed window renumbered within the
  // cache runs past the context; its prompt still fits, and its KV never
  // holds more than the context.
  const bool streams = streams_past_context(req.kv_policy.empty() ? config_.kv_policy : req.kv_policy,
                                            config_.max_model_len);
  if (total > config_.max_model_len && !(streams && static_cast<std::int64_t>(req.prompt.size()) < config_.max_model_len))
    return error(errc::out_of_range,
                 "prompt ({} tokens) plus max_tokens ({}) is {} tokens, beyond the context of {} (a kv_policy "
                 "window:budget=N,positions=cache generates past it)",
                 req.prompt.size(), req.max_tokens, total, config_.max_model_len);
  const std::int64_t most_held = std::min<std::int64_t>(req.max_tokens, config_.max_model_len - static_cast<std::int64_t>(req.prompt.size()));
  PAGODA_RETURN_IF_ERROR(kv_.check_request_fits(static_cast<std::int32_t>(req.prompt.size()),
                                                static_cast<std::int32_t>(most_held), req.tenant, req.n, classes, side));
  if (static_cast<int>(waiting_.size()) >= config_.max_waiting)
    return error(errc::resource_exhausted, "the request queue is full ({} waiting)", waiting_.size());

  auto r = std::make_unique<request_state>();
  r->req = std::move(req);
  r->kv_classes = std::move(classes);
  r->side = side;
  r->arrival = next_arrival_++;
  if (!r->req.images.empty()) {  // the KV manager keys image positions by content
    r->prompt_ids = r->req.prompt;
    r->req.prompt = keyed_prompt(r->req);
  }
  r->seqs.push_back(std::make_unique<sequence>(r.get(), 0, seq_id(next_seq_++)));
  sequence* s = r->seqs[0].get();
  PAGODA_RETURN_IF_ERROR(make_policy(*s));
  PAGODA_RETURN_IF_ERROR(resolve_speculation(*r));
  if (r->spec.enabled() && !r->req.images.empty())
    return error(errc::unsupported, "speculative decoding with images in the prompt is not supported (drafters read "
                 "the prompt's ids, which stand for image rows there); send the request with speculative \"none\"");
  if (r->spec.enabled()) s->spec = std::make_unique<spec_sequence>(r->spec);
  PAGODA_RETURN_IF_ERROR(add_chunks(*r));
  seqs_.emplace(s->id, s);
  enqueue_by_priority(s);
  stats_.n_prompt_tokens += static_cast<std::int64_t>(r->req.prompt.size());
  requests_.emplace(r->req.id, std::move(r));
  refresh_counts();
  return {};
}

bool scheduler::abort_request(const std::string& id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  request_state* r = it->second.get();
  if (r->n_finished >= (r->forked ? r->req.n : 1)) return false;
  for (auto& s : r->seqs)
    if (s->phase != seq_phase::finished) finish(s.get(), "abort", pending_events_);
  end_chunks(*r);
  refresh_counts();
  return true;
}

void scheduler::take_events(std::vector<engine_event>& events) {
  for (engine_event& e : pending_events_) events.push_back(std::move(e));
  pending_events_.clear();
}

scheduler::sequence* scheduler::by_id(seq_id id) const {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second;
}

std::optional<seq_id> scheduler::find_sequence(const std::string& id, int index) const {
  const auto it = requests_.find(id);
  if (it == requests_.end() || index < 0 || index >= static_cast<int>(it->second->seqs.size())) return std::nullopt;
  const sequence* s = it->second->seqs[index].get();
  if (!s->in_kv) return std::nullopt;
  return s->id;
}

sequence_options scheduler::kv_options(const sequence& s) const {
  sequence_options o;
  o.tenant = s.req->req.tenant;
  o.cache_salt = s.req->req.cache_salt;
  o.lookup = !computes_whole_prompt(s.req->req);
  o.classes = s.req->kv_classes;
  o.side = s.req->side;
  if (s.chunk >= 0) {  // a chunk computed alone: its own keys, no KV classes, no side memory
    o.chunk = true;
    o.classes = {};
    o.side = {};
  }
  return o;
}

std::uint64_t scheduler::classes_needed(const sequence& s) const {
  std::uint64_t classes = 1;  // class 0: the blocks past the runs, the generated tokens'
  for (const kv_class_run& r : s.req->kv_classes) classes |= std::uint64_t{1} << r.cls;
  std::uint64_t mask = 0;  // in every group
  for (std::int32_t g = 0; g < kv_.n_groups(); ++g) mask |= classes << (g * k_max_kv_classes);
  return mask;
}

const std::vector<block_key>& scheduler::prompt_keys_of(sequence* s) {
  if (s->keys_for != s->tokens.size()) {
    s->keys = kv_.prompt_keys(s->tokens, kv_options(*s));
    s->keys_for = s->tokens.size();
  }
  return s->keys;
}

void scheduler::refresh_counts() {
  stats_.n_running = static_cast<int>(running_.size());
  stats_.n_waiting = static_cast<int>(waiting_.size());
  stats_.peak_running = std::max<std::int64_t>(stats_.peak_running, stats_.n_running);
  std::int64_t bytes = 0, side_blocks = 0;
  for (const sequence* s : running_) {
    bytes += s->runner.selector_bytes;
    side_blocks += kv_.n_side_blocks(s->id);
  }
  stats_.selector_bytes = bytes;
  stats_.peak_selector_bytes = std::max(stats_.peak_selector_bytes, bytes);
  stats_.peak_side_blocks = std::max(stats_.peak_side_blocks, side_blocks);
}

// --- planning --------------------------------------------------------------------

void scheduler::enqueue_by_priority(sequence* s) {
  // Arrival order across tenants; within s's tenant, priority then arrival
  // over the places its new requests hold. A client's priority never moves
  // it past another tenant's request (a tenant's own requests are its to
  // order), and preempted sequences, which wait at the front, keep their place.
  waiting_.push_back(s);
  const std::string& tenant = s->req->req.tenant;
  std::size_t i = waiting_.size() - 1;  // s's place, moved back over its tenant's lower-priority requests
  for (std::size_t j = i; j-- > 0;) {
    sequence* w = waiting_[j];
    if (w->req->req.tenant != tenant) continue;
    const bool preempted = w->n_generated > 0 || w->n_computed > 0 || w->req->forked;
    if (preempted || w->req->req.priority <= s->req->req.priority) break;
    std::swap(waiting_[i], waiting_[j]);  // w takes s's later place, s the earlier one
    i = j;
  }
}

void scheduler::order_waiting_by_prefix(const std::unordered_set<block_key>& in_flight) {
  const auto started = [](const sequence* w) { return w->n_generated > 0 || w->n_computed > 0 || w->req->forked; };
  const auto first = std::find_if_not(waiting_.begin(), waiting_.end(), started);  // preempted ones lead
  if (std::distance(first, waiting_.end()) < 2) return;
  struct entry {
    sequence* s;
    bool overdue;
    std::int32_t blocks;  // leading prompt blocks cached or in flight
  };
  std::vector<entry> order;
  // The prefix lookup hashes a prompt: done for the first k_prefix_window
  // requests only (SGLang falls back to FCFS on long queues likewise); the
  // rest keep their order behind them, overdue ones still go first.
  constexpr int k_prefix_window = 256;
  int n_looked_up = 0;
  for (auto it = first; it != waiting_.end(); ++it) {
    sequence* w = *it;
    entry e{w, w->passed_steps >= config_.max_passed_steps, 0};
    if (!e.overdue && n_looked_up++ < k_prefix_window && config_.enable_prefix_caching &&
        !computes_whole_prompt(w->req->req)) {
      const std::vector<block_key>& keys = prompt_keys_of(w);
      e.blocks = kv_.n_cached_prompt_blocks(w->tokens, kv_options(*w));
      while (static_cast<std::size_t>(e.blocks) < keys.size() && in_flight.contains(keys[static_cast<std::size_t>(e.blocks)]))
        ++e.blocks;
    }
    order.push_back(e);
  }
  std::stable_sort(order.begin(), order.end(), [](const entry& a, const entry& b) {
    if (a.overdue != b.overdue) return a.overdue;
    if (a.overdue) return a.s->req->arrival < b.s->req->arrival;
    return a.blocks > b.blocks;  // stable: arrival order among equals
  });
  // A tenant's own requests keep their priority order (enqueue_by_priority)
  // in the places the prefix order gave them.
  std::map<std::string, std::vector<std::size_t>> places;
  for (std::size_t i = 0; i < order.size(); ++i) places[order[i].s->req->req.tenant].push_back(i);
  for (const auto& [tenant, at] : places) {
    std::vector<entry> mine;
    for (const std::size_t i : at) mine.push_back(order[i]);
    std::stable_sort(mine.begin(), mine.end(),
                     [](const entry& a, const entry& b) { return a.s->req->req.priority < b.s->req->req.priority; });
    for (std::size_t k = 0; k < at.size(); ++k) order[at[k]] = mine[k];
  }
  auto it = first;
  for (const entry& e : order) *it++ = e.s;
}

void scheduler::remove_from_running(sequence* s) {
  auto it = std::find(running_.begin(), running_.end(), s);
  if (it != running_.end()) running_.erase(it);
  s->start_order = -1;
}

scheduler::sequence* scheduler::victim_for(const sequence& s, alloc_blocker why, std::uint64_t short_classes) const {
  // Candidates: only the blocked tenant's own sequences when its quota is
  // what blocks, and only holders of the KV classes s lacks (or s) when a
  // class is short: preempting another frees nothing s can take. The tenant
  // that pays is the one whose candidate started most recently; among that
  // tenant's candidates, the lowest priority (largest value) goes first,
  // then the most recently started. Priority orders a tenant's own
  // sequences: no client shields itself from preemption with it.
  auto candidate = [&](const sequence* c) {
    if (why == alloc_blocker::quota && c->req->req.tenant != s.req->req.tenant) return false;
    if (why == alloc_blocker::pool && short_classes != 0 && c != &s && !kv_.holds_class(c->id, short_classes))
      return false;
    return true;
  };
  const sequence* latest = nullptr;
  for (const sequence* c : running_)
    if (candidate(c) && (!latest || c->start_order > latest->start_order)) latest = c;
  PAGODA_ASSERT(latest != nullptr, "no sequence to preempt (the blocked one runs)");
  sequence* victim = nullptr;
  for (sequence* c : running_) {
    if (!candidate(c) || c->req->req.tenant != latest->req->req.tenant) continue;
    if (!victim || c->req->req.priority > victim->req->req.priority ||
        (c->req->req.priority == victim->req->req.priority && c->start_order > victim->start_order))
      victim = c;
  }
  return victim;
}

std::vector<stored_block_ref> scheduler::source_refs(const sequence& s, int first, int end) const {
  const std::vector<std::int32_t> classes = kv_.prompt_block_classes(s.tokens, kv_options(s));
  return group_block_refs(layouts_, kv_.n_groups(), s.keys, classes, first, end);
}

int scheduler::n_available(const sequence& s, std::span<const stored_block_ref> refs, int count) const {
  int n = count;
  for (std::int32_t g = 0; g < kv_.n_groups(); ++g) {
    const int got = source_->n_available(s.req->req.tenant, refs.subspan(static_cast<std::size_t>(g * count),
                                                                          static_cast<std::size_t>(count)));
    if (got == k_source_pending) return k_source_pending;
    n = std::min(n, got);
  }
  return std::clamp(n, 0, count);
}

void scheduler::plan_loads_if_settled(sequence* s, step_plan& out) {
  if (!source_->settled(s->req->req.tenant, s->load_refs)) return;
  // Every group's block at each loaded index, with that group's ref.
  for (int j = 0; j < s->load_count; ++j)
    for (std::int32_t g = 0; g < kv_.n_groups(); ++g) {
      const block_id b = kv_.block_table(s->id, g)[static_cast<std::size_t>(s->load_first + j)];
      const stored_block_ref& ref = s->load_refs[static_cast<std::size_t>(g * s->load_count + j)];
      if (b.valid()) out.loads.push_back({s->id, b, ref, s->req->req.tenant, j});
    }
  s->load_planned = true;
}

void scheduler::end_loading(sequence* s) {
  if (source_ && !s->load_refs.empty()) source_->release(s->req->req.tenant, s->load_refs);
  s->load_refs.clear();
  s->load_count = 0;
  s->load_planned = false;
}

void scheduler::preempt(sequence* s) {
  status st = kv_.preempt_sequence(s->id);
  PAGODA_ASSERT(st.ok(), "preempting a running sequence: {}", st.message());
  s->in_kv = false;
  s->n_computed = 0;
  s->pos_shift = 0;
  if (s->pol) s->pol->reset();
  if (s->spec) s->spec->planned.clear();  // its drafts go with its KV
  // Imported chunks went with its KV: imported again (or computed) when it runs again.
  for (request_state::chunk& c : s->req->chunks) c.imported = c.imported && s->chunk >= 0;
  if (s->chunk < 0) s->reused.clear();
  forget_runner_kv(s);
  end_loading(s);
  s->phase = seq_phase::waiting;
  remove_from_running(s);
  waiting_.push_front(s);
}

void scheduler::unplan(std::vector<planned>& plan, int& budget, const sequence* s) const {
  for (auto p = plan.begin(); p != plan.end(); ++p)
    if (p->s == s) {
      budget += p->n;
      plan.erase(p);
      return;
    }
}

std::unordered_set<block_key> scheduler::blocks_in_flight() const {
  // Full prompt blocks a running (or loading) sequence is computing and has not committed yet.
  std::unordered_set<block_key> keys;
  if (!config_.enable_prefix_caching) return keys;
  const auto bs = static_cast<std::size_t>(config_.block_size);
  for (const sequence* s : running_)
    for (std::size_t b = static_cast<std::size_t>(s->n_computed) / bs; b < s->keys.size(); ++b) keys.insert(s->keys[b]);
  return keys;
}

bool scheduler::admit(sequence* s, int& budget, std::vector<planned>& plan, step_plan& out,
                      const std::unordered_set<block_key>& in_flight, bool& stop, std::uint64_t& short_classes) {
  request_state* r = s->req;
  if (!chunks_settled(*s)) return false;  // its chunks are computed first
  const int slots = (s->index == 0 && !r->forked) ? r->req.n : 1;
  if (static_cast<int>(running_.size()) + slots > config_.max_num_seqs || kv_.any_group_exhausted()) {
    stop = true;
    return false;
  }
  const auto bs = config_.block_size;
  const bool sharing = config_.enable_prefix_caching && !computes_whole_prompt(r->req);
  const sequence_options opts = kv_options(*s);
  // A scoring request takes the cached blocks whose scores are kept too (the
  // block after them included, prompt_score_cache.h); once its prompt is
  // scored (computed again after a preemption), any.
  sequence_options add_opts = opts;
  if (config_.enable_prefix_caching && !r->req.prompt_logits && r->req.prompt_logprobs >= 0 && s->chunk < 0) {
    if (r->prompt_scored >= s->n_prompt) {
      add_opts.lookup = true;
    } else if (const std::int32_t m = caches_scores(*s) ? n_scored_blocks(s) : 0; m > 1) {
      add_opts.lookup = true;
      add_opts.max_lookup_blocks = m - 1;
    }
  }
  const int n_reusable = (static_cast<int>(s->tokens.size()) - 1) / bs;
  if (sharing) prompt_keys_of(s);
  // The external KV source's blocks after the cached prefix (block load_from on).
  int n_in_source = 0;
  int load_from = -1;
  if (!s->in_kv) {
    // Pending: the block after the cached prefix is being computed by a
    // running sequence right now; wait for it to be committed.
    const bool ask_source = sharing && source_;
    const std::int32_t m =
        sharing && (ask_source || !in_flight.empty()) ? kv_.n_cached_prompt_blocks(s->tokens, opts) : 0;
    if (sharing && !in_flight.empty() && m < n_reusable && in_flight.contains(s->keys[static_cast<std::size_t>(m)]))
      return false;
    // Loading: asked before the sequence takes anything, so that an answer
    // not known yet (a remote tier's lookup in flight) leaves it waiting as it
    // was, asked again at the next step, without holding back those behind it.
    if (ask_source && m < n_reusable) {
      const std::vector<stored_block_ref> refs = source_refs(*s, m, n_reusable);
      const int n = n_available(*s, refs, n_reusable - m);
      if (n == k_source_pending) return false;
      n_in_source = n;
      load_from = m;
    }
    auto cached = kv_.add_sequence(s->id, s->tokens, add_opts);
    PAGODA_ASSERT(cached.ok(), "add_sequence: {}", cached.error().message());
    if (r->req.prompt_logprobs >= 0 && *cached >= r->prompt_scored && r->prompt_scored < s->n_prompt)
      send_cached_scores(s, *cached);
    s->in_kv = true;
    s->n_computed = *cached;
    if (s->pol) s->pol->commit(*cached, nullptr);  // cached slots are the sequence's first
  }
  // The first admission that runs records what the cache gave (a refused one
  // leaves nothing behind, below).
  const auto admitted = [&] {
    if (r->cached_tokens < 0 && s->chunk < 0) r->cached_tokens = std::min(s->n_computed, s->n_prompt);
  };
  // Loading: the prompt continues in the external KV source, from the
  // cached prefix add_sequence took. Every group's blocks are loaded (a
  // sliding window's let go after the first step): what the smallest pool
  // can take now; the rest is computed.
  if (n_in_source > 0 && s->n_computed == load_from * bs) {
    int n_load = n_in_source;
    for (std::int32_t g = 0; g < kv_.n_groups(); ++g) n_load = std::min(n_load, kv_.group(g).pool().n_takeable());
    if (n_load > 0 && kv_.allocate(s->id, n_load * bs)) {
      s->phase = seq_phase::loading;
      s->load_first = load_from;
      s->load_count = n_load;
      s->load_planned = false;
      s->load_refs = source_refs(*s, load_from, load_from + n_load);
      source_->prefetch(r->req.tenant, s->load_refs);
      plan_loads_if_settled(s, out);
      s->start_order = next_start_++;
      running_.push_back(s);
      admitted();
      return true;
    }
  }
  // Back to waiting as if never admitted: no blocks, no policy state (it
  // counted the cached slots, which the next attempt takes again).
  const auto back_to_waiting = [&] {
    status st = kv_.free_sequence(s->id);
    PAGODA_ASSERT(st.ok(), "free: {}", st.message());
    s->in_kv = false;
    s->n_computed = 0;
    s->pos_shift = 0;
    if (s->pol) s->pol->reset();
    forget_runner_kv(s);
  };
  const int n = image_step_tokens(r->req.images, s->n_computed, std::min<int>(next_chunk(*s), budget), budget);
  if (n == 0) {  // the rest of a bidirectional image span needs a step with more room
    back_to_waiting();
    return false;
  }
  const int n_alloc = chunk_alloc(*s, n);
  const bool import = chunks_due(*s);
  if (!kv_.allocate(s->id, n_alloc)) {
    const alloc_blocker why = kv_.allocation_blocker(s->id, n_alloc);
    const std::uint64_t short_mask = kv_.short_classes(s->id, n_alloc);
    back_to_waiting();
    // The pool is short for everyone (first come, first served); a quota only
    // for this tenant. With KV classes, a short class only for the requests
    // that need it: those behind this one that need none of its short classes
    // go on being admitted.
    if (why != alloc_blocker::quota) {
      if (short_mask == 0) stop = true;
      else short_classes |= short_mask;
    }
    return false;
  }
  if (import) import_chunks(s);
  s->phase = seq_phase::running;
  s->start_order = next_start_++;
  running_.push_back(s);
  plan.push_back({s, n});
  budget -= n;
  admitted();
  return true;
}

step_plan scheduler::schedule() {
  for (const std::string& id : finished_requests_) {
    auto it = requests_.find(id);
    // Gone, or already replaced by a new request with the same id (add_request).
    if (it == requests_.end() || it->second->n_finished < (it->second->forked ? it->second->req.n : 1)) continue;
    for (const auto& s : it->second->seqs) seqs_.erase(s->id);
    for (const auto& c : it->second->chunks) seqs_.erase(c.seq->id);
    requests_.erase(it);
  }
  finished_requests_.clear();

  step_plan out;
  std::vector<planned> plan;
  int budget = config_.max_num_batched_tokens;
  bool preempted = false;

  // 1. Running sequences, oldest first: their next decode token or prompt chunk.
  const std::vector<sequence*> order = running_;
  for (sequence* s : order) {
    if (budget <= 0) break;
    if (s->phase != seq_phase::running) continue;  // preempted earlier in this step
    PAGODA_ASSERT(next_chunk(*s) > 0, "a running sequence has nothing to compute");
    const int n = image_step_tokens(s->req->req.images, s->n_computed, std::min<int>(next_chunk(*s), budget), budget);
    if (n == 0) continue;  // the rest of a bidirectional image span waits for a step with room
    if (s->spec) {
      // Drafts ride along only when their slots come without preempting
      // anyone; else the sequence decodes plainly.
      s->spec->planned = propose_drafts(*s, n, budget);
      const int n_draft = static_cast<int>(s->spec->planned.size());
      if (n_draft > 0 && kv_.allocate(s->id, n + n_draft)) {
        plan.push_back({s, n + n_draft});
        budget -= n + n_draft;
        continue;
      }
      s->spec->planned.clear();
    }
    const int n_alloc = chunk_alloc(*s, n);
    for (;;) {
      if (kv_.allocate(s->id, n_alloc)) {
        if (chunks_due(*s)) import_chunks(s);
        plan.push_back({s, n});
        budget -= n;
        break;
      }
      sequence* victim = victim_for(*s, kv_.allocation_blocker(s->id, n_alloc), kv_.short_classes(s->id, n_alloc));
      unplan(plan, budget, victim);
      preempt(victim);
      preempted = true;
      if (victim == s) break;
    }
  }

  // Loading sequences whose blocks the source has fetched are filled this step.
  for (sequence* s : running_)
    if (s->phase == seq_phase::loading && !s->load_planned) plan_loads_if_settled(s, out);

  // 2. Waiting sequences, in order, while the budget, the sequence cap and the
  // pool allow (none after a preemption: the pool is already short).
  if (!preempted) {
    std::unordered_set<block_key> in_flight = blocks_in_flight();
    const auto bs = static_cast<std::size_t>(config_.block_size);
    std::uint64_t short_classes = 0;  // pools a request before could not get: the ones needing them wait
    if (config_.scheduling == scheduling_policy::cache_aware) order_waiting_by_prefix(in_flight);
    std::int64_t latest_admitted = -1;  // the latest arrival admitted this step
    for (std::size_t i = 0; i < waiting_.size() && budget > 0;) {
      bool stop = false;
      sequence* s = waiting_[i];
      if (short_classes & classes_needed(*s)) {
        ++i;
        continue;
      }
      if (admit(s, budget, plan, out, in_flight, stop, short_classes)) {
        // What it computes (or loads) from now on is in flight for those behind it.
        for (std::size_t b = static_cast<std::size_t>(s->n_computed) / bs; b < s->keys.size(); ++b)
          in_flight.insert(s->keys[b]);
        latest_admitted = std::max(latest_admitted, s->req->arrival);
        waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (stop) break;
      ++i;
    }
    for (sequence* w : waiting_)
      if (w->req->arrival < latest_admitted) ++w->passed_steps;
  }
  refresh_counts();

  // 3. The plan, taken last, when tables no longer change.
  for (const planned& p : plan) out.seqs.push_back(plan_seq(p.s, p.n));
  out.ops = std::move(pending_ops_);
  pending_ops_.clear();
  out.finished = std::exchange(runner_finished_, {});
  out.preempted = std::exchange(runner_preempted_, {});
  return out;
}

scheduled_seq scheduler::plan_seq(sequence* s, int n) {
  const request& r = s->req->req;
  scheduled_seq q;
  q.seq = s->id;
  if (s->spec) {
    q.draft = s->spec->planned;
    q.runner_drafts = !q.draft.empty() && s->spec->config.model_drafter();
  }
  const int n_known = n - static_cast<int>(q.draft.size());  // of the sequence's own tokens
  q.tokens.assign(s->tokens.begin() + s->n_computed, s->tokens.begin() + s->n_computed + n_known);
  q.tokens.insert(q.tokens.end(), q.draft.begin(), q.draft.end());
  if (!s->req->prompt_ids.empty() && s->n_computed < s->n_prompt)
    image_rows_of_step(r.images, s->req->prompt_ids, s->n_computed, q.tokens, q.embedded, q.embeddings);
  q.positions.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) q.positions[static_cast<std::size_t>(i)] = s->n_computed + i - s->pos_shift;
  if (!s->req->prompt_ids.empty() && s->n_computed < s->n_prompt)
    image_bounds_of_step(r.images, s->n_computed, std::span<const std::int32_t>(q.positions).first(static_cast<std::size_t>(n_known)),
                         q.see_until);
  q.n_stored = kv_.n_stored_tokens(s->id);
  q.all_logits = r.prompt_logits && s->n_computed < s->n_prompt;
  if (r.prompt_logprobs >= 0 && s->chunk < 0 && s->n_computed < s->n_prompt - 1) q.score_from = s->n_computed;
  q.n_tokens = static_cast<std::int32_t>(s->tokens.size());
  q.sample = s->n_computed + n_known >= static_cast<int>(s->tokens.size()) && r.max_tokens > 0 && s->chunk < 0;
  if (s->n_computed < static_cast<int>(s->reused.size())) {
    // Prompt tokens whose K/V a chunk brought: the runner recomputes only some.
    const auto from = s->reused.begin() + s->n_computed;
    const auto to = from + std::min<std::ptrdiff_t>(n_known, s->reused.end() - from);
    if (std::find(from, to, std::uint8_t{1}) != to) {
      q.reused.assign(from, to);
      q.reused.resize(static_cast<std::size_t>(n), 0);
      q.recompute = s->req->recompute;
    }
  }
  // Completion i draws from seed + i, so completion 0 equals an n = 1
  // request; the others are forked at the first sample and draw their first
  // token from the same logits.
  if (q.sample && s->index == 0 && r.n > 1 && !s->req->forked)
    for (int i = 1; i < r.n; ++i) q.forks.push_back({seq_id(next_seq_++), r.sampling.seed + static_cast<std::uint64_t>(i)});
  if (!s->runner.known) {
    seq_setup u;
    u.sampling = r.sampling;
    u.sampling.seed = r.sampling.seed + static_cast<std::uint64_t>(s->index);
    u.logprobs = r.logprobs;
    u.prompt_logprobs = r.prompt_logprobs;
    u.tokens = s->tokens;
    restore_prompt_ids(s->req->prompt_ids, u.tokens);
    u.n_prompt = s->n_prompt;
    if (s->pol && s->pol->policy()) u.policy = s->pol->policy()->spec();
    if (s->spec && s->spec->config.model_drafter()) u.speculation = s->spec->config;
    q.setup = std::move(u);
    s->runner.known = true;
  }
  const bool fresh = s->runner.fresh_kv;
  sync_kv_state(kv_, s->id, n, s->runner, q);
  if (s->pol) {
    q.stats_window = s->pol->stats_window();
    // A verification's rows count one by one, those that stand only
    // (seq_policy::commit_verified): each gets a window row.
    if (q.stats_window >= 0 && !q.draft.empty()) q.stats_window = n;
    const bool rows_changed = s->pol->take_rows_changed();
    if (s->pol->per_row() && (fresh || rows_changed)) q.rows = s->pol->stored_rows();
    q.slot_changes = s->pol->take_slot_changes();
    s->pol->plan(q.positions);
  }
  return q;
}

void scheduler::forget_runner_kv(sequence* s) {
  if (s->runner.known && !s->runner.fresh_kv) runner_preempted_.push_back(s->id);
  s->runner.forget_kv();
}

// --- committing --------------------------------------------------------------------

void scheduler::commit_loads(const step_plan& plan, const step_output& out) {
  // Per sequence, the leading run of indices whose every group's block was
  // filled counts as computed; an index that failed and everything after it
  // are computed instead (their slots stay allocated).
  std::size_t i = 0;
  while (i < plan.loads.size()) {
    sequence* s = by_id(plan.loads[i].seq);
    PAGODA_ASSERT(s && s->phase == seq_phase::loading, "a load for a sequence that is not loading");
    std::size_t end = i;
    while (end < plan.loads.size() && plan.loads[end].seq == s->id) ++end;
    std::vector<std::uint8_t> filled(static_cast<std::size_t>(s->load_count), 1);
    std::vector<std::uint8_t> tier_of(static_cast<std::size_t>(s->load_count), 0);  // 1 + the tier group 0's block came from
    for (std::size_t k = i; k < end; ++k) {
      const auto j = static_cast<std::size_t>(plan.loads[k].index);
      const std::uint8_t got = k < out.loaded.size() ? out.loaded[k] : 0;
      if (!got) filled[j] = 0;
      else if (tier_of[j] == 0) tier_of[j] = got;
    }
    std::size_t n_ok = 0;
    while (n_ok < filled.size() && filled[n_ok]) ++n_ok;
    const int n_tokens = static_cast<int>(n_ok) * config_.block_size;
    if (n_tokens > 0) {
      std::vector<std::int32_t> positions(static_cast<std::size_t>(n_tokens));
      for (int j = 0; j < n_tokens; ++j) positions[static_cast<std::size_t>(j)] = s->n_computed + j;
      status st = kv_.commit(s->id, std::span(s->tokens).subspan(static_cast<std::size_t>(s->n_computed),
                                                                  static_cast<std::size_t>(n_tokens)),
                             positions);
      PAGODA_ASSERT(st.ok(), "commit of loaded blocks: {}", st.message());
      s->n_computed += n_tokens;
      if (s->pol) s->pol->commit(n_tokens, nullptr);
      stats_.n_loaded_tokens += n_tokens;
      if (!s->req->first_token_seen && s->chunk < 0) {
        s->req->cached_tokens = std::min(std::max(s->req->cached_tokens, 0) + n_tokens, s->n_prompt);
        std::vector<int>& by_tier = s->req->loaded_by_tier;
        for (std::size_t j = 0; j < n_ok; ++j) {
          const std::size_t tier = tier_of[j] - 1u;
          if (by_tier.size() <= tier) by_tier.resize(tier + 1, 0);
          by_tier[tier] += config_.block_size;
        }
      }
    }
    s->phase = seq_phase::running;
    end_loading(s);
    i = end;
  }
}

void scheduler::fail_step(const step_plan& plan, const status& st, std::vector<engine_event>& events) {
  ++stats_.n_failed_steps;
  std::vector<request_state*> affected;
  auto note = [&](seq_id id) {
    if (sequence* s = by_id(id); s && std::find(affected.begin(), affected.end(), s->req) == affected.end())
      affected.push_back(s->req);
  };
  for (const scheduled_seq& q : plan.seqs) note(q.seq);
  for (const block_load& l : plan.loads) note(l.seq);
  // The runner may not have applied the plan's notices: they go again (each is idempotent).
  runner_finished_.insert(runner_finished_.end(), plan.finished.begin(), plan.finished.end());
  runner_preempted_.insert(runner_preempted_.end(), plan.preempted.begin(), plan.preempted.end());
  const std::string why = fmt::format("the engine step failed: {}", st.message());
  for (request_state* r : affected) {
    for (auto& s : r->seqs)
      if (s->phase != seq_phase::finished) finish(s.get(), "error", events, why);
    end_chunks(*r);
  }
  refresh_counts();
}

status scheduler::check_output(const step_plan& plan, const step_output& out) const {
  const auto V = static_cast<std::size_t>(vocab_.n_vocab());
  std::size_t n_rows = 0, n_sampled = 0, n_scores = 0;
  const bool any_draft = std::any_of(plan.seqs.begin(), plan.seqs.end(), [](const scheduled_seq& q) { return !q.draft.empty(); });
  if (any_draft && out.accepted.size() != plan.seqs.size())
    return error(errc::internal, "the runner reported acceptance for {} of {} sequences", out.accepted.size(), plan.seqs.size());
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    const std::int32_t accepted = any_draft ? out.accepted[i] : 0;
    if (accepted < 0 || static_cast<std::size_t>(accepted) > q.draft.size() || (accepted > 0 && !q.sample))
      return error(errc::internal, "the runner accepted {} of {} drafts of sequence {}", accepted, q.draft.size(), q.seq.value);
    if (q.runner_drafts) {
      const std::span<const token_id> drafts = drafts_of(q, out, i);
      if (drafts.size() != q.draft.size() ||
          std::any_of(drafts.begin(), drafts.end(), [&](token_id t) { return !vocab_.valid_id(t); }))
        return error(errc::internal, "the runner drafted {} tokens of {} for sequence {}", drafts.size(),
                     q.draft.size(), q.seq.value);
    }
    if (q.all_logits) n_rows += q.tokens.size();
    if (const sequence* s = by_id(q.seq); s && q.score_from >= 0) n_scores += q.n_scored(s->n_prompt);
    if (q.sample) n_sampled += 1 + q.forks.size() + static_cast<std::size_t>(accepted);
  }
  if (out.prompt_logits.size() != n_rows * V)
    return error(errc::internal, "the runner returned {} prompt logits for {} rows of {}", out.prompt_logits.size(),
                 n_rows, V);
  if (out.sampled.size() != n_sampled)
    return error(errc::internal, "the runner sampled {} tokens for {}", out.sampled.size(), n_sampled);
  if (out.prompt_scores.size() != n_scores)
    return error(errc::internal, "the runner scored {} prompt tokens for {}", out.prompt_scores.size(), n_scores);
  std::size_t k = 0;
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    if (!q.sample) continue;
    const std::size_t accepted = any_draft ? static_cast<std::size_t>(out.accepted[i]) : 0;
    for (std::size_t j = 0; j <= q.forks.size() + accepted; ++j, ++k) {
      const sampled_token& t = out.sampled[k];
      if (t.seq != (j < q.forks.size() ? q.forks[j].seq : q.seq) || !vocab_.valid_id(t.token))
        return error(errc::internal, "the runner sampled token {} for sequence {} out of order", t.token, t.seq.value);
      // An accepted draft is the token the runner drew.
      if (j < accepted && t.token != drafts_of(q, out, i)[j])
        return error(errc::internal, "the runner accepted draft {} of sequence {} but drew {}", drafts_of(q, out, i)[j],
                     q.seq.value, t.token);
    }
  }
  return {};
}

void scheduler::update(const step_plan& plan, step_output& out, std::vector<engine_event>& events) {
  take_events(events);
  if (plan.seqs.empty() && plan.loads.empty()) return;
  if (out.result.ok()) out.result = check_output(plan, out);
  if (!out.result.ok()) {
    fail_step(plan, out.result, events);
    return;
  }
  ++stats_.n_steps;
  commit_loads(plan, out);
  count_spec_time(plan, out);
  std::vector<int> first_computed(plan.seqs.size(), -1);  // n_computed before this step, per planned seq

  const auto V = static_cast<std::size_t>(vocab_.n_vocab());
  std::size_t row = 0, next_sample = 0, next_score = 0;
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    sequence* s = by_id(q.seq);
    PAGODA_ASSERT(s && s->phase == seq_phase::running, "a planned sequence left the running set before update");
    const int n = static_cast<int>(q.tokens.size());
    // K/V computed with a sparse read are not what full attention computes:
    // from here on the sequence's blocks stay out of the prefix cache.
    if (i < out.sparse.size() && out.sparse[i]) kv_.set_off_chain(s->id);
    if (i < out.selector_bytes.size()) s->runner.selector_bytes = out.selector_bytes[i];
    if (i < out.recall.size() && !out.index_names[i].empty()) {
      // The runner reports a selector's running totals: add what is new since the last report.
      const index_recall now = out.recall[i], seen = s->runner.recall;
      if (now.searches >= seen.searches && now.wanted >= seen.wanted && now.found >= seen.found) {
        auto it = stats_.recall_by_index.find(out.index_names[i]);
        if (it == stats_.recall_by_index.end()) it = stats_.recall_by_index.emplace(std::string(out.index_names[i]), index_recall{}).first;
        it->second += index_recall{now.found - seen.found, now.wanted - seen.wanted, now.searches - seen.searches};
      }
      s->runner.recall = now;
    }
    if (i < out.reads.size() && out.reads[i].rows > 0) {
      const bool prompt = s->n_computed < s->n_prompt;
      kv_read_stats& r = stats_.kv_reads[policy_name(s->req->req.kv_policy)];
      (prompt ? r.prompt : r.decode) += out.reads[i];
      (prompt ? s->req->reads.prompt : s->req->reads.decode) += out.reads[i];
    }
    if (!q.draft.empty()) {
      first_computed[i] = s->n_computed;
      s->step_first = s->n_computed;
      const std::size_t n_emitted = 1 + static_cast<std::size_t>(out.accepted[i]);
      const bool has_stats = q.stats_window >= 0 && i < out.stats.size() && out.stats[i].n_kv > 0;
      commit_verified(s, q, drafts_of(q, out, i), has_stats ? &out.stats[i] : nullptr,
                      std::span(out.sampled).subspan(next_sample, n_emitted), events);
      next_sample += n_emitted;
      continue;
    }
    // The KV manager's tokens: an image's key tokens where q.tokens has the prompt's ids (image_spans.h).
    const std::span<const token_id> committed =
        q.embedded.empty() ? std::span<const token_id>(q.tokens)
                           : std::span<const token_id>(s->tokens).subspan(static_cast<std::size_t>(s->n_computed), q.tokens.size());
    status st = kv_.commit(s->id, committed, q.positions);
    PAGODA_ASSERT(st.ok(), "commit: {}", st.message());
    // What the selector really holds: the next allocate pays for it if the bound fell short.
    st = kv_.set_side_measured(s->id, s->runner.selector_bytes);
    PAGODA_ASSERT(st.ok(), "side: {}", st.message());
    first_computed[i] = s->n_computed;
    s->step_first = s->n_computed;
    if (s->pol) {
      const bool has_stats = q.stats_window >= 0 && i < out.stats.size() && out.stats[i].n_kv > 0;
      s->pol->commit(n, has_stats ? &out.stats[i] : nullptr);
    }
    const int n_reused = i < out.reused_rows.size() ? out.reused_rows[i] : 0;
    s->req->reused_chunk_tokens += n_reused;
    stats_.n_reused_chunk_tokens += n_reused;
    if (s->n_computed < s->n_prompt)
      stats_.n_computed_prompt_tokens += std::min(n, s->n_prompt - s->n_computed) - n_reused;
    const int first = s->n_computed;
    s->n_computed += n;
    if (q.all_logits) {
      engine_event e;
      e.request_id = s->req->req.id;
      e.index = s->index;
      e.first_prompt_position = first;
      const auto rows = static_cast<std::size_t>(n) * V;
      e.prompt_logits.assign(out.prompt_logits.begin() + static_cast<std::ptrdiff_t>(row),
                             out.prompt_logits.begin() + static_cast<std::ptrdiff_t>(row + rows));
      row += rows;
      events.push_back(std::move(e));
    }
    if (q.score_from >= 0) {
      const std::size_t n_scored = q.n_scored(s->n_prompt);
      push_prompt_scores(s, q.score_from + 1, std::span(out.prompt_scores).subspan(next_score, n_scored), events);
      next_score += n_scored;
    }
    if (q.sample) {
      if (!q.forks.empty()) {
        fork_children(s, q.forks);
        for (std::size_t j = 1; j < s->req->seqs.size(); ++j)
          commit_tokens(s->req->seqs[j].get(), std::span(out.sampled).subspan(next_sample++, 1), events);
      }
      commit_tokens(s, std::span(out.sampled).subspan(next_sample++, 1), events);
    } else if (s->chunk >= 0 && s->n_computed >= s->n_prompt) {
      end_chunk(s);  // its blocks enter the prefix cache, where its request's prompt takes them
    } else if (s->n_computed >= static_cast<int>(s->tokens.size())) {
      finish(s, "length", events);  // the prompt only (scoring: max_tokens 0)
    }
  }
  apply_policies(plan, first_computed);
  if (kv_.has_sliding_window()) release_windows();
  refresh_counts();
}

void scheduler::release_windows() {
  // Every sequence in the pool, not only the step's: a sequence that only
  // loaded blocks, or a child forked this step, lets go of what it just got.
  for (sequence* s : running_) {
    if (!s->in_kv || (s->phase != seq_phase::running && s->phase != seq_phase::loading)) continue;
    // The next query sits at position n_computed - pos_shift or later.
    const auto freed = kv_.release_window(s->id, s->n_computed - s->pos_shift);
    PAGODA_ASSERT(freed.ok(), "releasing out-of-window blocks: {}", freed.error().message());
    stats_.n_window_freed_blocks += *freed;
  }
}

void scheduler::apply_policies(const step_plan& plan, const std::vector<int>& first_computed) {
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    sequence* s = by_id(plan.seqs[i].seq);
    if (!s || !s->pol || !s->in_kv || s->phase != seq_phase::running || !s->pol->policy()) continue;
    std::optional<kv_compaction> c = s->pol->decide(kv_, s->id, policy_context(*s, first_computed[i]));
    if (!c) continue;
    const bool renumbered = !c->gather->rotate.empty();
    c->next_position = s->n_computed - s->pos_shift;  // a sliding window keeps only what that query reads
    const std::int64_t n_before = kv_.n_stored_tokens(s->id);
    kv_compaction kept = *c;
    // resource_exhausted: a shared block needs a copy and the pool has none;
    // the policy tries again after the next step.
    if (!kv_.compact(s->id, std::move(*c)).ok()) continue;
    s->pol->compacted(kept);
    s->runner.positions_changed_from(kept.first);
    ++stats_.n_policy_compactions;
    stats_.n_policy_evicted_slots += n_before - kept.n_slots;
    // Positions within the cache: the next token follows the last kept one.
    if (renumbered) s->pos_shift = s->n_computed - (kv_.positions(s->id).back() + 1);
  }
}

seq_policy_context scheduler::policy_context(const sequence& s, int first_computed) {
  seq_policy_context ctx;
  ctx.tokens = s.tokens;
  ctx.n_seen = s.n_computed;
  ctx.n_prompt = s.n_prompt;
  ctx.n_new = s.n_computed - first_computed;  // a verification's: the tokens that stood
  ctx.prompt_done_now = first_computed < s.n_prompt && s.n_computed >= s.n_prompt;
  return ctx;
}

void scheduler::count_kept(sequence* s) {
  if (!s->in_kv || !s->pol || !s->pol->policy() || !s->pol->policy()->lossy()) return;
  // A sequence ends inside the step that computed its last tokens, before
  // its policy acts on them: what it keeps is the decision it would take now
  // (none under the slack: then everything it holds). A sequence ended while
  // its blocks were loading holds what it holds.
  const int n_stored = kv_.n_stored_tokens(s->id);
  std::optional<kv_compaction> c;
  if (s->phase == seq_phase::running && s->pol->n_slots() == n_stored)
    c = s->pol->decide(kv_, s->id, policy_context(*s, s->step_first));
  s->req->kv_tokens_seen += s->n_computed;
  s->req->kv_tokens_kept += c ? c->n_slots : n_stored;
}

status scheduler::make_policy(sequence& s) const {
  const request& r = s.req->req;
  std::unique_ptr<kv_policy> p;
  auto spec = parse_kv_policy_spec(r.kv_policy.empty() ? config_.kv_policy : r.kv_policy);
  if (!spec.ok()) return spec.error();
  if (!spec->is_none() || any_segment_policy(r.segments)) {
    auto made = new_policy(*spec, r.segments);
    if (!made.ok()) return made.error();
    p = std::move(*made);
  }
  if (!p && config_.attention_stats_window < 0) return ok_status();
  s.pol = std::make_unique<seq_policy>(std::move(p), config_.policy_shape, config_.attention_stats_window);
  return ok_status();
}

result<std::unique_ptr<kv_policy>> scheduler::new_policy(const kv_policy_spec& spec,
                                                         std::span<const prompt_segment> segments) const {
  if (!any_segment_policy(segments)) return config_.policy_factory ? config_.policy_factory(spec) : make_kv_policy(spec);
  std::vector<kv_segment> parts;
  for (const prompt_segment& p : segments) {
    if (p.kv_policy.empty()) continue;  // a KV type only: the request's policy applies
    auto part = parse_kv_policy_spec(p.kv_policy.empty() ? "none" : p.kv_policy);
    if (!part.ok()) return part.error().with_context(fmt::format("segment [{}, {})", p.begin, p.end));
    parts.push_back(kv_segment{p.begin, p.end, std::move(*part)});
  }
  return make_segmented_policy(spec, parts);
}

int scheduler::next_chunk(const sequence& s) const {
  int left = static_cast<int>(s.tokens.size()) - s.n_computed;
  // A step stops where reused chunks start: they are imported before it.
  if (s.chunk < 0)
    for (const request_state::chunk& c : s.req->chunks)
      if (c.done && !c.imported && c.at > s.n_computed) left = std::min(left, c.at - s.n_computed);
  if (s.n_computed >= s.n_prompt) return left;
  if (s.req->req.prompt_logprobs >= 0) left = std::min(left, k_max_scored_tokens);
  if (const int chunk = s.req->req.prompt_chunk; chunk > 0) return std::min(left, chunk);
  // A prompt longer than its policy keeps: in chunks, the policy acting
  // between them (kv_policy::prompt_chunks), the last one whole enough for
  // SnapKV's observation window.
  const prompt_chunking c =
      s.pol && s.pol->policy() ? s.pol->policy()->prompt_chunks(s.n_prompt, config_.block_size) : prompt_chunking{};
  if (c.chunk <= 0) return left;
  int n = std::min(left, c.chunk);
  const int rest = s.n_prompt - s.n_computed;
  if (n < rest && rest - n < c.min_last && rest > c.min_last) n = std::min(n, rest - c.min_last);
  return n;
}

void scheduler::fork_children(sequence* parent, std::span<const seq_fork> forks) {
  request_state* r = parent->req;
  r->forked = true;
  for (std::size_t k = 0; k < forks.size(); ++k) {
    auto child = std::make_unique<sequence>(r, static_cast<int>(k) + 1, forks[k].seq);
    status st = kv_.fork(parent->id, child->id);
    PAGODA_ASSERT(st.ok(), "fork: {}", st.message());
    child->tokens = parent->tokens;
    child->n_computed = parent->n_computed;
    child->step_first = parent->step_first;
    child->pos_shift = parent->pos_shift;
    if (parent->pol)
      child->pol = parent->pol->fork([this, r](const kv_policy_spec& spec) { return new_policy(spec, r->req.segments); });
    if (parent->spec) child->spec = std::make_unique<spec_sequence>(r->spec);  // drafts on its own
    child->runner.known = true;  // the runner made it at the fork; its KV state comes with its first run
    child->in_kv = true;
    child->phase = seq_phase::running;
    child->start_order = next_start_++;
    running_.push_back(child.get());
    seqs_.emplace(child->id, child.get());
    r->seqs.push_back(std::move(child));
  }
}

void scheduler::push_prompt_scores(sequence* s, std::int32_t first, std::span<const token_logprob> scores,
                                   std::vector<engine_event>& events) {
  // A sequence computed again (preempted part way) scores its prompt again:
  // each token's entry goes out once.
  request_state* r = s->req;
  const std::size_t skip = static_cast<std::size_t>(std::clamp(r->prompt_scored - first, 0, static_cast<int>(scores.size())));
  if (skip == scores.size()) return;
  engine_event e;
  e.request_id = r->req.id;
  e.index = s->index;
  e.first_prompt_logprob = first + static_cast<int>(skip);
  e.prompt_logprobs.assign(scores.begin() + static_cast<std::ptrdiff_t>(skip), scores.end());
  r->prompt_scored = e.first_prompt_logprob + static_cast<int>(e.prompt_logprobs.size());
  if (caches_scores(*s)) {
    r->scores.insert(r->scores.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
    keep_scores(s);
  }
  events.push_back(std::move(e));
}

bool scheduler::caches_scores(const sequence& s) const {
  const request& r = s.req->req;
  // Under a KV policy a token's scores depend on what the policy kept, not
  // on the tokens alone.
  return config_.enable_prefix_caching && r.prompt_logprobs >= 0 && !r.prompt_logits && s.chunk < 0 &&
         !(s.pol && s.pol->policy());
}

std::int32_t scheduler::n_scored_blocks(sequence* s) {
  const std::vector<block_key>& keys = prompt_keys_of(s);
  const auto bs = static_cast<std::size_t>(config_.block_size);
  const std::size_t n_blocks = std::min(keys.size(), static_cast<std::size_t>(s->n_prompt) / bs);
  std::size_t m = 0;
  for (; m < n_blocks; ++m) {
    const std::span<const token_id> tokens = std::span<const token_id>(s->tokens).subspan(m * bs, bs);
    if (!score_cache_.find(keys[m], m == 0 ? k_root_parent_key : keys[m - 1], tokens, s->req->req.prompt_logprobs))
      break;
  }
  return static_cast<std::int32_t>(m);
}

void scheduler::send_cached_scores(sequence* s, std::int32_t n_cached) {
  request_state* r = s->req;
  const std::vector<block_key>& keys = prompt_keys_of(s);
  const auto bs = static_cast<std::size_t>(config_.block_size);
  const int k = r->req.prompt_logprobs;
  engine_event e;
  e.request_id = r->req.id;
  e.index = s->index;
  e.first_prompt_logprob = r->prompt_scored;
  // Tokens [prompt_scored, n_cached]: the last is the first computed token's
  // predecessor's next, which the hit skips too.
  for (auto t = static_cast<std::size_t>(r->prompt_scored); t <= static_cast<std::size_t>(n_cached); ++t) {
    const std::size_t b = t / bs;
    const std::span<const token_id> tokens = std::span<const token_id>(s->tokens).subspan(b * bs, bs);
    const std::vector<token_logprob>* got =
        score_cache_.find(keys[b], b == 0 ? k_root_parent_key : keys[b - 1], tokens, k);
    PAGODA_ASSERT(got != nullptr, "the scores of block {} went between the lookup and the hit", b);
    token_logprob lp = (*got)[t % bs];
    if (lp.top.size() > static_cast<std::size_t>(k)) lp.top.resize(static_cast<std::size_t>(k));
    e.prompt_logprobs.push_back(std::move(lp));
  }
  r->prompt_scored = n_cached + 1;
  r->scores.insert(r->scores.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
  pending_events_.push_back(std::move(e));
}

void scheduler::keep_scores(sequence* s) {
  request_state* r = s->req;
  const std::vector<block_key>& keys = prompt_keys_of(s);
  const int bs = config_.block_size;
  const int n_blocks = std::min(static_cast<int>(keys.size()), s->n_prompt / bs);
  for (int& b = r->score_blocks_kept; b < n_blocks && (b + 1) * bs <= r->prompt_scored; ++b) {
    // Block b scores its tokens [b * bs, (b + 1) * bs); the first prompt token has no score.
    std::vector<token_logprob> block;
    for (int t = b * bs; t < (b + 1) * bs; ++t)
      block.push_back(t == 0 ? token_logprob{s->tokens[0], 0.0f, {}} : r->scores[static_cast<std::size_t>(t - 1)]);
    const auto at = static_cast<std::size_t>(b) * static_cast<std::size_t>(bs);
    score_cache_.put(keys[static_cast<std::size_t>(b)], b == 0 ? k_root_parent_key : keys[static_cast<std::size_t>(b) - 1],
                     std::span<const token_id>(s->tokens).subspan(at, static_cast<std::size_t>(bs)),
                     r->req.prompt_logprobs, std::move(block));
  }
}

void scheduler::finish(sequence* s, const std::string& reason, std::vector<engine_event>& events,
                       const std::string& why) {
  request_state* r = s->req;
  if (events.empty() || events.back().request_id != r->req.id || events.back().index != s->index ||
      !events.back().finish_reason.empty() || !events.back().prompt_logits.empty()) {
    engine_event e;
    e.request_id = r->req.id;
    e.index = s->index;
    events.push_back(std::move(e));
  }
  end_sequence(s, reason, events.back(), why);
}

void scheduler::end_sequence(sequence* s, const std::string& reason, engine_event& e, const std::string& why) {
  request_state* r = s->req;
  end_loading(s);  // a loading sequence aborted or failed
  count_kept(s);
  if (s->in_kv) {
    status st = kv_.free_sequence(s->id);
    PAGODA_ASSERT(st.ok(), "free: {}", st.message());
    s->in_kv = false;
  }
  if (s->start_order >= 0) remove_from_running(s);
  else if (auto it = std::find(waiting_.begin(), waiting_.end(), s); it != waiting_.end()) waiting_.erase(it);
  s->phase = seq_phase::finished;
  s->pol.reset();
  if (s->runner.known) runner_finished_.push_back(s->id);
  s->runner = runner_mirror{};
  ++r->n_finished;
  e.finish_reason = reason;
  e.error = why;
  // Before the prompt is computed (only an abort or an error can end it then)
  // the children of an n > 1 request are not born yet.
  const int expected = r->forked ? r->req.n : 1;
  if (r->n_finished >= expected) {
    e.request_finished = true;
    e.usage.prompt_tokens = static_cast<int>(r->req.prompt.size());
    e.usage.completion_tokens = r->completion_tokens;
    e.usage.cached_tokens = std::max(r->cached_tokens, 0);
    e.usage.loaded_tokens_by_tier = r->loaded_by_tier;
    e.usage.reused_chunk_tokens = r->reused_chunk_tokens;
    e.usage.image_tokens = image_tokens_before(r->req.images, static_cast<std::int32_t>(r->req.prompt.size()));
    e.usage.cached_image_tokens = image_tokens_before(r->req.images, e.usage.cached_tokens);
    stats_.n_image_tokens += e.usage.image_tokens;
    stats_.n_cached_image_tokens += e.usage.cached_image_tokens;
    e.usage.kv_tokens_seen = r->kv_tokens_seen;
    e.usage.kv_tokens_kept = r->kv_tokens_kept;
    e.usage.kv_prompt_tokens_visible = r->reads.prompt.tokens_visible;
    e.usage.kv_prompt_tokens_read = r->reads.prompt.tokens_read;
    e.usage.kv_decode_tokens_visible = r->reads.decode.tokens_visible;
    e.usage.kv_decode_tokens_read = r->reads.decode.tokens_read;
    end_chunks(*r);
    ++stats_.n_requests_finished;
    finished_requests_.push_back(r->req.id);
  }
}

bool scheduler::stop_sequence(const std::string& id, int index, engine_event& e, int n_dropped) {
  const auto it = requests_.find(id);
  if (it == requests_.end() || index < 0 || index >= static_cast<int>(it->second->seqs.size())) return false;
  sequence* s = it->second->seqs[static_cast<std::size_t>(index)].get();
  if (s->phase == seq_phase::finished) return false;
  s->req->completion_tokens -= n_dropped;
  stats_.n_generated_tokens -= n_dropped;
  end_sequence(s, "stop", e);
  refresh_counts();
  return true;
}

// --- hooks ------------------------------------------------------------------------

status scheduler::drop_blocks(seq_id seq, std::span<const std::int32_t> block_indices) {
  sequence* s = by_id(seq);
  if (!s || !s->in_kv || s->phase != seq_phase::running)
    return error(errc::not_found, "drop: sequence {} is not running", seq.value);
  PAGODA_RETURN_IF_ERROR(kv_.drop(seq, block_indices));
  if (s->pol) s->pol->dropped(block_indices);
  if (!block_indices.empty())
    s->runner.positions_changed_from(*std::min_element(block_indices.begin(), block_indices.end()) * config_.block_size);
  return {};
}

status scheduler::truncate(seq_id seq, int n_tokens) {
  sequence* s = by_id(seq);
  if (!s || !s->in_kv || s->phase != seq_phase::running)
    return error(errc::not_found, "truncate: sequence {} is not running", seq.value);
  if (n_tokens < 1 || n_tokens > static_cast<int>(s->tokens.size()))
    return error(errc::out_of_range, "truncate: sequence {} has {} tokens; cannot keep {}", seq.value, s->tokens.size(),
                 n_tokens);
  // The last kept token is computed again: its logits choose what comes next.
  const int n_computed = std::min(s->n_computed, n_tokens - 1);
  const auto positions = kv_.positions(seq);
  const auto n_slots = static_cast<std::int32_t>(
      std::lower_bound(positions.begin(), positions.end(), n_computed - s->pos_shift) - positions.begin());
  PAGODA_RETURN_IF_ERROR(kv_.truncate(seq, n_slots));
  s->runner.positions_changed_from(n_slots);
  s->tokens.resize(static_cast<std::size_t>(n_tokens));
  s->n_computed = n_computed;
  s->n_generated = std::max(0, n_tokens - s->n_prompt);
  if (s->pol) s->pol->truncated(n_slots);
  return {};
}

const std::vector<float>* scheduler::attention_totals(seq_id seq) const {
  const sequence* s = by_id(seq);
  return s && s->pol && !s->pol->totals().empty() ? &s->pol->totals() : nullptr;
}

const attention_stats* scheduler::last_attention_window(seq_id seq) const {
  const sequence* s = by_id(seq);
  return s && s->pol ? s->pol->window() : nullptr;
}

const seq_policy* scheduler::policy_of(seq_id seq) const {
  const sequence* s = by_id(seq);
  return s ? s->pol.get() : nullptr;
}

}  // namespace pagoda
