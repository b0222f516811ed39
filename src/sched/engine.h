// The engine: continuous batching over one model and one paged KV pool.
//
// One thread owns an engine (no locks inside). Each step() the scheduler picks
// sequences under a token budget (--max-num-batched-tokens) and a sequence cap
// (--max-num-seqs), mixing decode tokens with prompt chunks (chunked prefill);
// the model runs them all in one forward pass; each sequence whose tokens are
// all computed samples its next token. When the pool runs out, the lowest
// priority, most recently started sequence is preempted (its blocks freed, the
// sequence requeued first; the prefix cache makes recomputation cheap).
//
// Batch invariance: with f32 KV a sequence's logits do not depend on what else
// shares its steps, so greedy results under any load equal those of running it
// alone (the forward pass and attention keep every row independent).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/histogram.h"
#include "kv/kv_manager.h"
#include "kv/kv_storage.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/tokenizer_stream.h"
#include "pagoda/status.h"
#include "sched/stop_matcher.h"

namespace pagoda {

struct engine_config {
  int n_threads = 0;                  // 0: every core
  int max_model_len = 0;              // 0: the model's trained context
  int max_num_seqs = 64;              // sequences running at once
  int max_num_batched_tokens = 2048;  // tokens per step (decode + prompt chunks)
  bool enable_prefix_caching = true;
  kv_layout kv;                       // types and block size (n_layers etc. must match the model)
  std::int64_t n_blocks = 0;          // pool size in blocks
  std::map<std::string, std::int32_t> tenant_quota_blocks;
  int max_waiting = 1 << 20;          // requests queued at once (the server sets a limit)
};

struct request {
  std::string id;
  std::vector<token_id> prompt;  // tokenized, BOS included as the model wants
  int max_tokens = 16;
  sampling_params sampling = sampling_params::greedy();
  int n = 1;                       // completions sharing the prompt
  std::vector<std::string> stop;   // stop strings (not included in the output)
  std::vector<token_id> stop_token_ids;
  bool ignore_eos = false;
  std::string cache_salt;          // vLLM's cache_salt
  std::string tenant;              // "" = the global cache
  int priority = 0;                // lower runs first (vLLM's convention)
  int logprobs = -1;               // -1: none; k >= 0: the chosen token's and k alternatives
};

struct token_logprob {
  token_id token;
  float logprob;
  std::vector<std::pair<token_id, float>> top;  // the k most likely, best first
};

struct request_usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;  // over all n completions
  int cached_tokens = 0;      // prompt tokens served from the prefix cache
};

// What one step produced for one completion of one request.
struct engine_event {
  std::string request_id;
  int index = 0;                        // completion index, 0 .. n-1
  std::vector<token_id> tokens;         // tokens sampled this step (0 or 1)
  std::string text;                     // text released this step (stop strings held back)
  std::vector<token_logprob> logprobs;  // one per token, when asked for
  std::string finish_reason;            // "" while running; "stop", "length", "abort"
  bool request_finished = false;        // the last completion of the request finished
  request_usage usage;                  // valid when request_finished
};

struct engine_stats {
  std::int64_t n_steps = 0;
  std::int64_t n_requests_finished = 0;
  std::int64_t n_prompt_tokens = 0;      // admitted prompt tokens
  std::int64_t n_computed_prompt_tokens = 0;  // prompt tokens run through the model (cache misses, recomputation)
  std::int64_t n_generated_tokens = 0;
  int n_running = 0;
  int n_waiting = 0;
  histogram ttft_seconds{latency_buckets_seconds()};
  histogram itl_seconds{latency_buckets_seconds()};
  histogram e2e_seconds{latency_buckets_seconds()};
  std::int64_t peak_running = 0;
};

class engine {
 public:
  static result<std::unique_ptr<engine>> create(const llama_model& model, const engine_config& config);
  ~engine();

  // Queues a request. Rejected at once, with a clear error, when it could never
  // run: empty or out-of-vocabulary prompt, prompt + max_tokens beyond the
  // context, more blocks than the pool (or the tenant's quota) holds, bad
  // sampling values, a duplicate id, or a full queue (resource_exhausted).
  status add_request(request req);
  // Frees the request's blocks at once; emits its completions as "abort".
  // Returns false for an unknown (or finished) id.
  bool abort_request(const std::string& id);

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  // Runs one scheduling step and one forward pass; appends what it produced.
  status step(std::vector<engine_event>& events);

  kv_metrics kv_stats() const { return kv_mgr_->metrics(); }
  const engine_stats& stats() const { return stats_; }
  const engine_config& config() const { return config_; }
  const llama_model& model() const { return model_; }
  const kv_storage& storage() const { return *storage_; }
  kv_manager& kv() { return *kv_mgr_; }

 private:
  struct request_state;
  struct seq_state;

  engine(const llama_model& model, const engine_config& config);
  void preempt(seq_state* s);
  seq_state* pick_victim();
  void finish(seq_state* s, const std::string& reason, std::vector<engine_event>& events);
  void sample_next(seq_state* s, std::span<const float> logits, std::vector<engine_event>& events);
  void fork_children(seq_state* parent);
  void remove_from_running(seq_state* s);

  const llama_model& model_;
  engine_config config_;
  std::unique_ptr<kv_storage> storage_;
  std::unique_ptr<kv_manager> kv_mgr_;
  std::unique_ptr<llama_context> ctx_;

  std::unordered_map<std::string, std::unique_ptr<request_state>> requests_;
  std::vector<seq_state*> running_;  // in start order
  std::deque<seq_state*> waiting_;   // by (priority, arrival); preempted ones first
  std::int64_t next_seq_ = 0;
  std::int64_t next_arrival_ = 0;
  std::int64_t next_start_ = 0;
  engine_stats stats_;
  std::vector<float> logits_;
  std::vector<engine_event> pending_events_;   // produced outside step() (aborts)
  std::vector<std::string> finished_requests_; // erased at the next step

};

}  // namespace pagoda
