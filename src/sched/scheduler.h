// The scheduler: pure bookkeeping over requests, sequences and the KV manager
// (DESIGN.md). It never touches a tensor or the model, so it is tested with a
// fake runner.
//
//   plan = schedule()            which sequences run this step and how many
//                                tokens each, under a token budget and a
//                                sequence cap; the block ops to perform, the
//                                blocks to load from an external KV source
//   runner.execute(plan, out)    (elsewhere: the runner computes and samples)
//   update(plan, out, events)    commit what was computed and sampled, finish
//                                by tokens (EOS, stop tokens, lengths), free
//   output step                  (output_processor.h: text, stop strings, latencies)
//
// A step is a list of (sequence, tokens): a prompt chunk and a decode token
// are the same thing to it (chunked prefill, vLLM v1). Each step:
//   1. Running sequences, oldest first, get their next chunk or decode token.
//      When the pool cannot supply a sequence's blocks, a victim is preempted
//      (its blocks freed, it goes back to the front of the queue; the prefix
//      cache makes recomputing cheap): of the tenant whose sequence started
//      most recently, its lowest-priority, most recently started one; when
//      the sequence's TENANT QUOTA is what blocks it, the victim is one of
//      that tenant's own sequences, never another tenant's.
//   2. Waiting sequences are admitted in order (arrival; within a tenant,
//      priority then arrival: a client's priority orders only its own
//      tenant's requests, and preemption likewise) while
//      the budget, the sequence cap and the pool allow (none after a
//      preemption: the pool is short). A request held back by its tenant's
//      quota does not hold back the others. A request whose next prompt block
//      is being computed right now by a running sequence is PENDING: it stays
//      in the queue and is admitted once that block is committed, as a
//      prefix-cache hit, instead of computing it twice or reading it early.
//      A request whose prompt continues in the external KV source (after what
//      the pool holds) enters LOADING: its blocks are filled from the source
//      during the step, and it runs from the next step with them cached.
//
// Commit after execution: tokens enter the KV manager (and full blocks the
// prefix index) in update(), only when the runner says the step succeeded. If
// it failed, every request with a sequence in the step ends with an "error"
// event and its blocks are freed; nothing the step wrote is ever shared.
//
// The plan is plain data (step_plan.h): what the runner keeps per sequence
// (tables, positions, selector, sampler) it gets in full once and then as
// deltas (runner_sync.h).
//
// Positions: token i of a sequence (prompt, then generated) is computed at
// position i. KV slots keep their positions when blocks are dropped
// (drop_blocks), so RoPE and masks stay right.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/clock.h"
#include "core/histogram.h"
#include "kv/kv_manager.h"
#include "model/tokenizer.h"
#include "pagoda/events.h"
#include "pagoda/request.h"
#include "sched/prompt_score_cache.h"
#include "sched/runner_sync.h"
#include "sched/seq_policy.h"
#include "sched/step_plan.h"
#include "spec/speculative.h"

namespace pagoda {

// The order waiting requests are admitted in (docs/architecture.md, "The scheduler").
enum class scheduling_policy : std::uint8_t {
  fcfs,         // arrival order (within a tenant, priority first)
  cache_aware,  // longest cached or in-flight prefix first (SGLang's LPM), bounded by max_passed_steps
};

struct scheduler_config {
  int max_model_len = 2048;           // prompt + generated tokens of one sequence
  int max_num_seqs = 64;              // sequences running at once
  int max_num_batched_tokens = 2048;  // tokens per step (decode + prompt chunks)
  bool enable_prefix_caching = true;
  // The order every KV group's pool evicts cached blocks in (block_pool.h);
  // lfu is the better on bench/scheduling_trace.py.
  cache_eviction prefix_cache_eviction = cache_eviction::lfu;
  std::int32_t block_size = 16;
  std::int64_t n_blocks = 0;          // KV pool size in blocks
  std::map<std::string, std::int32_t> tenant_quota_blocks;
  // Bytes of one group-0 block: side memory (a retrieval index, policy
  // statistics) is charged in blocks of this size against the pool and the
  // tenant's quota (kv_manager.h, "Side blocks"); 0: not charged.
  std::int64_t side_block_bytes = 0;
  int max_waiting = 1 << 20;          // requests queued at once
  // cache_aware: a waiting request whose prompt has a longer prefix cached
  // (or being computed) is admitted first; one that later arrivals passed
  // over in max_passed_steps steps goes back to its place in arrival order.
  scheduling_policy scheduling = scheduling_policy::cache_aware;  // the better on bench/scheduling_trace.py
  int max_passed_steps = 16;
  // >= 0: every sequence collects attention statistics (attention_totals),
  // keeping the weights of its last `attention_stats_window` query tokens.
  int attention_stats_window = -1;
  // The model's layers (early-exit drafters name a count of them); the
  // policy shape counts KV layers, fewer when layers share KV.
  int n_model_layers = 0;
  // KV policies (policy/kv_policy.h): the default for requests that name
  // none, and the model's shape their per-row state needs.
  std::string kv_policy = "none";
  seq_policy_shape policy_shape;
  // Images (request::images): the KV type and policy of an image span that
  // names none ("": the request's), and the width its rows must have (the
  // model's n_embd; 0: not checked).
  std::string kv_image_type;
  std::string kv_image_policy;
  int n_embd = 0;
  // KV groups (kv_manager.h, kv_group.h): the layers kept differently (a
  // sliding window) have groups of their own; empty: one full-attention
  // group of kv_class_blocks (or n_blocks). After each step a sequence's
  // sliding-window groups free the blocks its next query no longer reads.
  std::vector<kv_group_config> kv_groups;
  bool key_summaries = false;  // the KV backend keeps per-block key summaries (query-aware policies need them)
  // KV classes (kv_manager.h): blocks per class, class 0 (the default type)
  // first; empty: one class of n_blocks. kv_class_of names the class of a
  // segment's kv_type, or an error the user can act on.
  std::vector<std::int32_t> kv_class_blocks;
  std::vector<std::string> kv_class_keys;  // [class]: its KV type in prefix keys (kv_manager::set_class_keys); empty: numbers
  std::function<result<std::uint8_t>(const std::string& kv_type)> kv_class_of;
  // Speculative decoding (spec/speculative.h): the default of requests that name none.
  std::string speculative = "none";
  bool draft_model = false;  // the engine has a draft model (speculative `draft`)
  std::string kv_mirror;     // the KV type of the engine's KV mirror (speculative `self:view=int4`), or empty
  // Makes a sequence's policy from its spec; null: make_kv_policy (tests inject their own).
  seq_policy::policy_factory policy_factory;
  // Chunk reuse (docs/serving.md, "Chunk reuse"): the fraction of a reused
  // chunk's tokens recomputed when a request names none; and, when not empty,
  // why this engine cannot reuse chunks (its KV layout), for the error.
  float chunk_recompute = 0.15f;
  std::string chunk_reuse_refusal;
  // Non-empty: why speculative decoding is refused (its verification could
  // not give plain decoding's tokens with this KV layout).
  std::string speculation_refusal;
  // The latency histograms (TTFT, inter-token, end to end, which the output
  // step observes) read this clock; null: the system's. Tests pass a manual_clock.
  const clock_source* clock = nullptr;
};

// Speculative decoding's counters, per drafter (vLLM's spec_decode metrics).
struct spec_decode_stats {
  std::int64_t n_drafts = 0;           // verification steps that carried drafts
  std::int64_t n_draft_tokens = 0;     // draft tokens proposed
  std::int64_t n_accepted_tokens = 0;  // of which the target accepted
  std::array<std::int64_t, k_max_draft_tokens> accepted_per_pos{};  // [i]: drafts at position i accepted
  // Seconds of draft passes (model drafters) and of the forward passes that
  // verified drafts (the whole batched pass), a step's shared among its
  // drafters by their draft tokens.
  double draft_seconds = 0;
  double verify_seconds = 0;
  // Mean tokens a verification step emits: 1 + accepted per step.
  double mean_accepted_length() const {
    return n_drafts > 0 ? 1.0 + static_cast<double>(n_accepted_tokens) / static_cast<double>(n_drafts) : 0.0;
  }
};

struct engine_stats {
  std::int64_t n_steps = 0;
  std::int64_t n_failed_steps = 0;
  std::int64_t n_requests_finished = 0;
  std::int64_t n_prompt_tokens = 0;           // admitted prompt tokens
  std::int64_t n_computed_prompt_tokens = 0;  // prompt tokens run through the model (cache misses, recomputation)
  std::int64_t n_loaded_tokens = 0;           // prompt tokens loaded from the external KV source
  std::int64_t n_reused_chunk_tokens = 0;     // prompt tokens taken from reused chunks, not recomputed
  std::int64_t n_image_tokens = 0;            // prompt tokens of images (request::images), of finished requests
  std::int64_t n_cached_image_tokens = 0;     // of which served from the prefix cache or loaded
  std::int64_t n_generated_tokens = 0;
  std::int64_t n_policy_compactions = 0;    // KV policy decisions applied (compactions)
  std::int64_t n_policy_evicted_slots = 0;  // KV slots those compactions freed
  std::int64_t n_window_freed_blocks = 0;   // blocks sliding-window groups let go as windows moved past them
  // Memory of the running sequences' sparse-read selectors (Quest's key
  // bounds, retrieval's ANN indexes), as the runner reported it after their
  // last step: now, and the most at any step.
  std::int64_t selector_bytes = 0;
  std::int64_t peak_selector_bytes = 0;
  // Most pool blocks the running sequences held for side memory at any step
  // (kv_manager.h, "Side blocks"); the gauge of now is in kv_metrics.
  std::int64_t peak_side_blocks = 0;
  int n_running = 0;
  int n_waiting = 0;
  histogram ttft_seconds{latency_buckets_seconds()};
  histogram itl_seconds{latency_buckets_seconds()};
  histogram e2e_seconds{latency_buckets_seconds()};
  std::int64_t peak_running = 0;
  std::map<std::string, spec_decode_stats> spec_decode;  // by drafter name
  // What attention read of the KV against what it could see, by the name of
  // the sequences' KV policy ("none", "quest", "retrieval", ...).
  std::map<std::string, kv_read_stats> kv_reads;
  // Sampled recall of sparse-read indexes (retrieval), by index kind.
  std::map<std::string, index_recall, std::less<>> recall_by_index;
};

// Where a sequence is in its life.
enum class seq_phase : std::uint8_t { waiting, loading, running, finished };

// A sequence holding KV now (running or loading), as llama.cpp's /slots
// shows a busy slot: what it asked for and what of it the cache holds.
struct running_sequence {
  std::int64_t seq = 0;             // its seq_id
  std::string request_id;
  int index = 0;                    // completion index within the request
  std::string tenant;
  bool loading = false;             // its prompt's blocks are coming from the KV store
  int n_prompt = 0;
  int n_cached_prompt = 0;          // prompt tokens it found cached (prefix cache or store); -1: not admitted yet
  int n_computed = 0;               // leading tokens whose K/V were computed
  int n_generated = 0;
  int max_tokens = 0;
  int n_stored_tokens = 0;          // KV slots it holds (fewer than computed once a policy dropped some)
  int n_blocks = 0;                 // KV blocks its main table holds
  sampling_params sampling;
  bool ignore_eos = false;
  std::string kv_policy;            // as the request named it ("": the engine's default)
  bool speculative = false;
};

class scheduler {
 public:
  // REQUIRES: vocab outlives the scheduler.
  scheduler(const scheduler_config& config, const tokenizer& vocab);
  ~scheduler();
  scheduler(const scheduler&) = delete;
  scheduler& operator=(const scheduler&) = delete;
  // Errors in the config (an impossible quota): the scheduler refuses to start.
  status check() const { return config_status_; }

  // Queues a request. Rejected at once, with a clear error, when it could never
  // run: empty or out-of-vocabulary prompt, prompt + max_tokens beyond the
  // context, n above the sequence cap, more blocks than the pool (or the
  // tenant's quota) holds, bad sampling values, a duplicate id, or a full
  // queue (resource_exhausted).
  status add_request(request req);
  // Frees the request's blocks at once; emits its completions as "abort".
  // Returns false for an unknown (or finished) id.
  bool abort_request(const std::string& id);
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  // Block ops the tensors have not applied yet: the last step of a run leaves
  // some (the blocks it sealed enter the prefix cache, which feeds the commit
  // hook); one more step() applies them. engine_core::flush() does that.
  // Sequences that ended since the last plan hold state in the runner until
  // the next one (step_plan::finished): pending too.
  bool has_pending_ops() const {
    return !pending_ops_.empty() || !runner_finished_.empty() || !runner_preempted_.empty();
  }

  // Plans the next step (an empty plan when nothing can run). Events made
  // outside a step (aborts) are handed out by the next update() or take_events().
  step_plan schedule();
  // Commits the step's results (or fails its requests when out.result is an
  // error, or when the output does not fit the plan) and appends what it
  // produced to `events`: each sampled token (no text yet: the output step
  // adds it), prompt logits, and finishes that tokens decide (EOS, stop token
  // ids, max_tokens, the context), whose blocks are freed at once.
  void update(const step_plan& plan, step_output& out, std::vector<engine_event>& events);
  // The output step found a stop string in completion `index` of request
  // `id`: it ends as an abort would, with finish reason "stop", written into
  // `e` (request_finished and usage too when it was the last). False when
  // that completion is not running.
  // n_dropped: tokens of `e` the stop string cut off (a verification step
  // emits several); they no longer count as generated.
  bool stop_sequence(const std::string& id, int index, engine_event& e, int n_dropped = 0);
  // The output step cut n_dropped tokens off an event of a completion that had
  // already ended (a stop string before its last token): they no longer count
  // as generated, nor in e's usage when e finishes the request.
  void uncount_tokens(const std::string& id, int n_dropped, engine_event& e);
  // Events produced outside a step (aborts), handed out once.
  void take_events(std::vector<engine_event>& events);

  // --- hooks for policies and speculation ----------------------------------
  // The sequence of completion `index` of request `id`, while it holds KV.
  std::optional<seq_id> find_sequence(const std::string& id, int index = 0) const;
  // Frees whole blocks (table indices) of a running sequence's KV; the
  // sequence goes on without them (kv_manager::drop).
  status drop_blocks(seq_id seq, std::span<const std::int32_t> block_indices);
  // Rolls a running sequence back to its first n_tokens tokens (prompt
  // included): later tokens, their KV and their statistics are forgotten.
  // Tokens already handed out in events are not taken back (a speculative
  // decoder reports tokens only once verified). REQUIRES n_tokens >= 1.
  status truncate(seq_id seq, int n_tokens);
  // The attention statistics collected so far (attention_stats_window >= 0,
  // or a policy that asks for them): [n_stored][n_layers * n_kv_heads]
  // accumulated weights, slot by slot; and the last window rows (the last
  // query tokens, across steps). nullptr before any.
  const std::vector<float>* attention_totals(seq_id seq) const;
  const attention_stats* last_attention_window(seq_id seq) const;
  // The sequence's policy state (nullptr without a policy or statistics).
  const seq_policy* policy_of(seq_id seq) const;
  // The external KV source for the load path; nullptr for none.
  // layouts[g][c]: the layout fingerprint of KV group g's class c (what the
  // runner names those blocks' bytes with), which the source is asked for;
  // empty: 0 for every block.
  void set_kv_source(kv_block_source* source, std::vector<std::vector<std::uint64_t>> layouts = {}) {
    source_ = source;
    layouts_ = std::move(layouts);
  }

  const engine_stats& stats() const { return stats_; }
  // The sequences holding KV now, in start order (chunk-reuse helpers left out).
  std::vector<running_sequence> running_sequences() const;
  // For the output step, which observes the latency histograms (output_processor.h).
  engine_stats& output_stats() { return stats_; }
  const clock_source& clock() const { return *clock_; }
  const scheduler_config& config() const { return config_; }
  kv_manager& kv() { return kv_; }
  const kv_manager& kv() const { return kv_; }

 private:
  struct request_state;
  struct sequence;
  struct planned {
    sequence* s;
    int n;
  };

  // short_classes: the (group, class) pools s lacks blocks of (kv_manager::short_classes);
  // when not 0, only s itself or a sequence holding a block of one is chosen.
  sequence* victim_for(const sequence& s, alloc_blocker why, std::uint64_t short_classes = 0) const;
  void preempt(sequence* s);
  // Puts a new request's sequence in the waiting queue (priority within its tenant only).
  void enqueue_by_priority(sequence* s);
  // cache_aware: the waiting (never started) sequences reordered by the
  // prefix blocks they would not compute, overdue ones (passed over
  // max_passed_steps times) first in arrival order; a tenant's own requests
  // keep their priority order. Preempted sequences stay at the front.
  void order_waiting_by_prefix(const std::unordered_set<block_key>& in_flight);
  void unplan(std::vector<planned>& plan, int& budget, const sequence* s) const;
  // stop: admit no one after s; short_classes gains the KV classes s could
  // not get (only the requests needing one of them wait behind it).
  bool admit(sequence* s, int& budget, std::vector<planned>& plan, step_plan& out,
             const std::unordered_set<block_key>& in_flight, bool& stop, std::uint64_t& short_classes);
  // The (group, class) pools a sequence's blocks may come from (bits as kv_manager::short_classes).
  std::uint64_t classes_needed(const sequence& s) const;
  std::unordered_set<block_key> blocks_in_flight() const;
  // The source's refs of s's full prompt blocks [first, end) (s->keys must be current).
  // The source's refs of s's prompt blocks [first, end) in every KV group,
  // group-major: group g's are [g * (end - first), (g + 1) * (end - first)).
  std::vector<stored_block_ref> source_refs(const sequence& s, int first, int end) const;
  // How many leading blocks of such refs every group's blocks are available
  // for in the source, or k_source_pending.
  int n_available(const sequence& s, std::span<const stored_block_ref> refs, int count) const;
  // A loading sequence's blocks go into the plan once the source has them.
  void plan_loads_if_settled(sequence* s, step_plan& out);
  // s leaves the loading state (loaded, preempted, finished): the source may drop what it prefetched.
  void end_loading(sequence* s);
  const std::vector<block_key>& prompt_keys_of(sequence* s);
  sequence_options kv_options(const sequence& s) const;
  void commit_loads(const step_plan& plan, const step_output& out);
  // The runner's scores of s's prompt tokens first .. (step_output::prompt_scores) as an event, less those sent before.
  void push_prompt_scores(sequence* s, std::int32_t first, std::span<const token_logprob> scores,
                          std::vector<engine_event>& events);
  // Prompt scores by block (prompt_score_cache.h), for requests asking for
  // prompt logprobs under full KV: whether s's are kept and read there; how
  // many of s's leading prompt blocks have scores there; the scores of the
  // prompt tokens up to n_cached (a hit of that many tokens) sent from there;
  // the blocks whose scores are all known kept there.
  bool caches_scores(const sequence& s) const;
  std::int32_t n_scored_blocks(sequence* s);
  void send_cached_scores(sequence* s, std::int32_t n_cached);
  void keep_scores(sequence* s);
  void fail_step(const step_plan& plan, const status& st, std::vector<engine_event>& events);
  // Ends s, its finish merged into the last event when that is s's token event.
  void finish(sequence* s, const std::string& reason, std::vector<engine_event>& events, const std::string& why = {});
  void end_sequence(sequence* s, const std::string& reason, engine_event& e, const std::string& why = {});
  // Whether out holds what plan asks for (prompt rows, sampled tokens in order, in the vocabulary).
  status check_output(const step_plan& plan, const step_output& out) const;
  // Appends tokens to s in one event, up to the first that finishes it (then s ends).
  void commit_tokens(sequence* s, std::span<sampled_token> tokens, std::vector<engine_event>& events);
  // What token `tok` decides when it is s's n_generated-th generated token and
  // makes its length n_tokens: "stop", "length", or "" (stop strings are the output step's).
  std::string finish_reason_of(const sequence& s, token_id tok, int n_generated, int n_tokens) const;
  // Speculation (scheduler_spec.cpp). The drafts s carries in a step that
  // computes n of its tokens within `budget` (none when it does not speculate).
  std::vector<token_id> propose_drafts(sequence& s, int n, int budget) const;
  // Adds the step's draft and verification time to its drafters' counters.
  void count_spec_time(const step_plan& plan, const step_output& out);
  // The drafts of plan.seqs[i] as verified: the plan's, or the runner's (runner_drafts).
  static std::span<const token_id> drafts_of(const scheduled_seq& q, const step_output& out, std::size_t i);
  // Commits a verification step of s: the verified prefix's K/V (the
  // tentative rest truncated), the policy's statistics of the rows that
  // stood (`stats`, null when none collected), the emitted tokens, the
  // counters. `emitted`: the runner's tokens for s (1 + accepted).
  void commit_verified(sequence* s, const scheduled_seq& q, std::span<const token_id> drafts,
                       const attention_stats* stats, std::span<sampled_token> emitted, std::vector<engine_event>& events);
  // The request's speculation, from its own spec or the engine's default.
  status resolve_speculation(request_state& r) const;
  void fork_children(sequence* parent, std::span<const seq_fork> forks);
  // The plan's entry for s computing n tokens, with the runner's state updates.
  scheduled_seq plan_seq(sequence* s, int n);
  // s's KV state in the runner goes (preempted, or a refused admission).
  void forget_runner_kv(sequence* s);
  // After a committed step: each sequence's policy may evict (compact its KV).
  void apply_policies(const step_plan& plan, const std::vector<int>& first_computed);
  // Sliding-window groups: every sequence in the pool lets go of the blocks its next query no longer reads.
  void release_windows();
  status make_policy(sequence& s) const;
  // What s's policy is told after a step that began at first_computed tokens.
  static seq_policy_context policy_context(const sequence& s, int first_computed);
  // An ending sequence's context and what its evicting policy keeps of it, into its request's usage.
  void count_kept(sequence* s);
  result<std::unique_ptr<kv_policy>> new_policy(const kv_policy_spec& spec,
                                                std::span<const prompt_segment> segments = {}) const;
  // Tokens the sequence computes next at most: the rest of its prompt (by
  // prompt_chunk), or its one new token.
  int next_chunk(const sequence& s) const;
  void remove_from_running(sequence* s);
  void refresh_counts();
  sequence* by_id(seq_id id) const;
  // Chunk reuse (scheduler_chunks.cpp). Checks the request's chunk parts and
  // makes a sequence for each that computes it alone (queued before r's own).
  status add_chunks(request_state& r);
  // Whether s may be admitted: every chunk of its request computed (or given up).
  bool chunks_settled(const sequence& s) const;
  // Whether s's chunks are imported now: its next token is the first of the
  // first chunk not imported yet.
  bool chunks_due(const sequence& s) const;
  // Slots s allocates to compute n tokens now: through its last chunk when they are due, else n.
  int chunk_alloc(const sequence& s, int n) const;
  // After that allocation: the chunks' K/V are copied into s's slots (gather
  // ops, keys rotated to their positions) and s goes off chain.
  void import_chunks(sequence* s);
  // A chunk's sequence computed its tokens, or its request ended: its KV goes
  // (full blocks stay in the prefix cache), no event.
  void end_chunk(sequence* c);
  // Every chunk sequence of r that still runs or waits ends (r finished, failed or was aborted).
  void end_chunks(request_state& r);

  scheduler_config config_;
  const clock_source* clock_;
  status config_status_;
  const tokenizer& vocab_;
  kv_manager kv_;
  kv_block_source* source_ = nullptr;
  std::vector<std::vector<std::uint64_t>> layouts_;  // [KV group][KV class]: layout fingerprints for source refs
  std::vector<kv_op> pending_ops_;  // reported by the KV manager, not yet planned
  std::vector<seq_id> runner_finished_;   // for the next plan's finished / preempted
  std::vector<seq_id> runner_preempted_;

  std::unordered_map<std::string, std::unique_ptr<request_state>> requests_;
  std::unordered_map<seq_id, sequence*> seqs_;  // every live sequence
  std::vector<sequence*> running_;  // in start order (loading ones included)
  std::deque<sequence*> waiting_;   // by (priority, arrival); preempted ones first
  std::int64_t next_seq_ = 0;
  std::int64_t next_arrival_ = 0;
  std::int64_t next_start_ = 0;
  engine_stats stats_;
  prompt_score_cache score_cache_{std::size_t{1} << 16};  // at most this many tokens' scores
  std::vector<engine_event> pending_events_;   // produced outside a step (aborts)
  std::vector<std::string> finished_requests_; // erased at the next step
};

}  // namespace pagoda
