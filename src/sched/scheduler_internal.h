// Inside the scheduler: its request and sequence records, shared by
// scheduler.cpp and scheduler_spec.cpp (speculation).
#pragma once

#include "sched/scheduler.h"

namespace pagoda {

// Whether a request needs every prompt position computed (the prefix cache
// is not looked up for it; its blocks still enter it).
inline bool computes_whole_prompt(const request& r) { return r.prompt_logits || r.prompt_logprobs >= 0; }

struct scheduler::request_state {
  request req;
  std::int64_t arrival = 0;     // order of arrival
  std::vector<std::unique_ptr<sequence>> seqs;  // [completion index]; 0 runs the prompt
  bool forked = false;          // children created (n > 1)
  bool first_token_seen = false;
  int n_finished = 0;
  int cached_tokens = -1;       // prompt tokens from the prefix cache (or loaded) at first admission
  std::vector<int> loaded_by_tier;  // of those, loaded from each tier of the KV source
  int completion_tokens = 0;
  int prompt_scored = 1;        // prompt_logprobs: the prompt tokens [1, prompt_scored) were scored and sent
  std::vector<token_logprob> scores;  // those scores (entry i: prompt token i + 1's), while the prompt's blocks are kept
  int score_blocks_kept = 0;    // its leading prompt blocks whose scores went to the score cache
  std::vector<kv_class_run> kv_classes;  // positions whose blocks are of another KV class (segments' kv_type)
  spec_config spec;             // its speculation (resolve_speculation)
  side_charge side;             // each completion's side memory bound (seq_policy::side_memory)
  // Chunk reuse: the parts marked "reuse": "chunk", each with the sequence
  // that computes it alone (its whole blocks, positions from 0).
  struct chunk {
    int at = 0;  // its first token in the prompt
    int n = 0;   // tokens reused: whole blocks of the part
    std::unique_ptr<sequence> seq;
    bool done = false;      // its sequence computed it (its blocks are in the prefix cache) or gave up
    bool imported = false;  // copied into the prompt's slots
  };
  std::vector<chunk> chunks;
  float recompute = 1.0f;       // the fraction of a chunk's tokens recomputed in context
  int reused_chunk_tokens = 0;  // imported tokens the runner did not recompute
  int kv_tokens_seen = 0;       // an evicting policy's completions: tokens computed, as they ended
  int kv_tokens_kept = 0;       // and what their policies keep of them
  kv_read_stats reads;          // what its completions' attention read (request_usage)
  // With images: the prompt as given (req.prompt then holds the key tokens
  // of image positions, image_spans.h), whose ids the runner gets.
  std::vector<token_id> prompt_ids;
};

struct scheduler::sequence {
  request_state* req = nullptr;
  int index = 0;
  seq_id id;
  std::vector<token_id> tokens;  // prompt, then generated; token i is computed at position i
  int n_prompt = 0;
  int n_computed = 0;            // leading tokens whose K/V were computed (some may be dropped since)
  int step_first = 0;            // n_computed before the last step that computed its tokens
  int n_generated = 0;
  seq_phase phase = seq_phase::waiting;
  std::int64_t start_order = -1; // >= 0 while running or loading
  int passed_steps = 0;          // waiting: steps in which a later arrival was admitted (cache-aware bound)
  bool in_kv = false;            // registered with the KV manager
  std::vector<block_key> keys;   // chained keys of the full blocks of `tokens` (prefix caching)
  std::size_t keys_for = 0;      // tokens.size() when keys were computed
  // The KV policy's state (and the statistics it or the engine asked for);
  // null when neither. Positions: token i is computed at position
  // i - pos_shift (pos_shift > 0 once a policy re-numbered the cache).
  std::unique_ptr<seq_policy> pol;
  int pos_shift = 0;
  // Loading: table entries [load_first, load_first + load_count) wait for the
  // source; load_planned once they are in a plan. load_refs: what was prefetched.
  int load_first = 0, load_count = 0;
  bool load_planned = false;
  std::vector<stored_block_ref> load_refs;
  runner_mirror runner;          // what the runner holds for it (runner_sync.h)
  std::unique_ptr<spec_sequence> spec;  // null: it does not speculate
  // Chunk reuse: this sequence computes chunk `chunk` of its request alone
  // (it never samples and leaves no event); -1: a completion.
  int chunk = -1;
  // A completion's prompt: 1 at the tokens whose K/V were imported from chunks.
  std::vector<std::uint8_t> reused;

  sequence(request_state* r, int idx, seq_id sid)
      : req(r), index(idx), id(sid), tokens(r->req.prompt), n_prompt(static_cast<int>(r->req.prompt.size())) {}
};

}  // namespace pagoda
