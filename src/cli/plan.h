// pagoda plan's arithmetic: which KV configurations a model can run, how much
// memory each takes per token and per sequence, how many sequences of a length
// fit in a memory budget once weights, activations and the pool's staging are
// paid, what each costs in quality and attention speed (from measured
// profiles), and which block size a request-length mix wastes least in.
//
// Bytes per token are kv_layout::bytes_per_token() of the layout the engine
// would build (make_kv_layout), so they are `pagoda info`'s figures; for a
// plain format that is the usual formula
//   2 (K and V) x KV layers x KV heads x head_dim x bytes per element
// (Llama-3-70B at f16: 2 x 80 x 8 x 128 x 2 = 327,680 bytes per token), with
// the in-tile scales of quantized formats included.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/kv_layout.h"
#include "model/llama.h"
#include "pagoda/config.h"
#include "pagoda/status.h"

namespace pagoda::cli {

// One KV configuration: the engine flags that select it.
struct plan_config {
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype
  std::string kv_policy;                // --kv-policy ("" none)
  std::string kv_share;                 // --kv-share ("" none)
  std::string kv_layer_types;           // --kv-layer-types ("" none)
  // Tokens a sequence keeps under kv_policy (0: every token); the policy's
  // slack (one block) comes on top.
  std::int64_t kept_tokens = 0;
  // Whether the configuration keeps what the engine's default keeps: f32, or
  // the model's own float type ("auto": f16 unless the weights are f32), with
  // no policy or sharing (set by the caller, who knows the model).
  bool lossless = false;
  std::string flags() const;  // "--kv-cache-dtype int8 --kv-policy ..." as the engine takes them
};

// The configurations plan compares for a model with n_layer layers at
// context n_ctx: every KV type for K and V, the K/V mixes, a per-layer mix,
// eviction budgets of the window and h2o policies, and cross-layer sharing
// (reuse and minicache from layer 0) when the model declares none.
std::vector<plan_config> plan_configs(const llama_hparams& hp, std::int64_t n_ctx, int block_size);

// What the engine needs besides the KV pool.
struct plan_memory {
  double budget_bytes = 0;       // --memory
  double weights_bytes = 0;      // tensor data (mapped or read) + the f32 vectors copied at load
  double activation_bytes = 0;   // the forward pass's buffers for a step of max_num_batched_tokens
  double reserve_bytes = 0;      // headroom kept free (allocator, thread stacks, the process)
  double pool_bytes() const { return budget_bytes - weights_bytes - activation_bytes - reserve_bytes; }
};

// An estimate of the forward pass's activation buffers (llama_context) for a
// step of n_tokens rows and n_logit_rows rows of logits: the residual, the
// normed input, Q, K, V, the attention output, the FFN's gate and up rows in
// f32, their quantized copies for the matrix products, and the logits.
double activation_bytes(const llama_hparams& hp, std::int64_t n_tokens, std::int64_t n_logit_rows);

// The workload: sequences of n_ctx tokens (prompt + generated), or a mix of lengths.
struct plan_workload {
  std::int64_t n_ctx = 0;
  std::int64_t users = 0;              // 0: not given (only the maximum is reported)
  std::vector<std::int64_t> lengths;   // a request-length mix; empty: none
};

// One row of the answer.
struct plan_row {
  plan_config config;
  std::string layout;              // kv_layout::describe()
  std::string error;               // the engine refuses this configuration for this model (why)
  double bits_per_element = 0;
  double bytes_per_token = 0;      // sealed blocks, scales included (info's figure)
  std::int64_t staging_bytes_per_seq = 0;  // f16 windows a sequence may hold (sealed formats)
  std::int64_t blocks_per_seq = 0;  // blocks one sequence of n_ctx tokens takes (policy's side memory included)
  double bytes_per_seq = 0;        // blocks + staging
  std::int64_t max_users = 0;      // sequences of n_ctx tokens the pool holds at once
  std::int64_t max_tokens = 0;     // tokens the pool holds
  std::int64_t pool_mib = 0;       // --kv-cache-size to run it with
  bool fits = false;               // users (or 1) sequences of n_ctx tokens fit
  std::optional<double> attention_cost;  // decode attention time / f16's (speed profile)
  std::optional<double> mean_kl;         // nats per token against an exact cache (quality profile)
  std::optional<double> ppl_change_percent;
};

// Sequences of a length the pool holds at once: each takes blocks_per_seq
// blocks and k_staging_slots_per_sequence staging slots; the static scales
// are paid once (pool_blocks' accounting under --kv-cache-size).
std::int64_t max_sequences(const kv_layout& layout, double pool_bytes, std::int64_t blocks_per_seq);

// Blocks one sequence of n_tokens takes at its peak under a configuration.
// Under an eviction policy: the kept tokens, one block of slack and the
// prompt chunk written before the policy acts (it acts after each step, so a
// prompt of up to prompt_chunk tokens, --max-num-batched-tokens, is held whole
// first), and the policy's side memory on those slots.
std::int64_t blocks_per_sequence(const kv_layout& layout, const plan_config& c, std::int64_t n_tokens,
                                 std::int64_t prompt_chunk);

// Block sizes against a request-length mix.
struct block_size_row {
  int block_size = 0;
  double fragmentation = 0;        // unused slots / allocated slots, over the mix
  double wasted_tokens_per_request = 0;
  double prefix_granularity = 0;   // tokens of a shared prefix recomputed per hit, on average (block_size - 1) / 2
};
std::vector<block_size_row> block_size_rows(const std::vector<std::int64_t>& lengths);
// The largest block size whose fragmentation is at most max_fragmentation
// (fewer, larger blocks: shorter tables, longer reads), else the smallest.
int recommend_block_size(const std::vector<block_size_row>& rows, double max_fragmentation = 0.05);

// A request-length mix from a file: JSONL lines of a number, {"length": N},
// {"prompt_tokens": P, "max_tokens": G}, or a `pagoda batch` line
// ({"prompt": "text" or [ids], "max_tokens": G}; text needs `tokenize`, which
// may be null when there is no tokenizer: then such lines are an error).
using token_counter = std::function<std::int64_t(const std::string&)>;
result<std::vector<std::int64_t>> read_length_mix(const std::string& path, const token_counter& tokenize,
                                                  int default_max_tokens);

// Measured profiles (docs/plan.md): a JSON object
//   {"pagoda_profile": 1, "model": {"name", "fingerprint"},
//    "quality": [{"kv", "kv_policy", "kv_share", "mean_kl", "perplexity_change_percent", ...}],
//    "speed": [{"kv", "decode_attention_vs_f16", ...}]}
// Quality entries are keyed by the layout's description, the policy and the
// sharing; speed entries by the layout's description.
struct profile {
  std::string path;
  nlohmann::json doc;
  std::string model_name() const;
  std::string fingerprint() const;
};
result<profile> read_profile(const std::string& path);
// Profiles found for a model: the files of `dir` (*.json) whose fingerprint is `fingerprint`.
std::vector<profile> find_profiles(const std::string& dir, const std::string& fingerprint);
// Profiles with speed entries in `dir` (model-independent: attention micro-benchmarks).
std::vector<profile> find_speed_profiles(const std::string& dir);
// The directory of shipped profiles: $PAGODA_PROFILES, else profiles/ beside
// the source tree of this binary (build/<preset>/pagoda -> ../../profiles), else
// share/pagoda/profiles of its install prefix; "" when none exists.
std::string shipped_profile_dir();

// Adds (or replaces, same key) one quality entry in the profile at path,
// creating it; the model's name and fingerprint must match the file's.
status write_quality_entry(const std::string& path, const std::string& model_name, const std::string& fingerprint,
                           const nlohmann::json& entry);

// "%016x" of a model fingerprint, as profiles spell it.
std::string fingerprint_text(std::uint64_t fp);

// Fills the quality and speed columns of rows from the profiles.
void apply_profiles(std::vector<plan_row>& rows, const std::vector<profile>& quality,
                    const std::vector<profile>& speed);

// The quality budget: at most max_kl nats per token or max_ppl_change percent (either may be unset).
struct quality_budget {
  std::optional<double> max_kl;
  std::optional<double> max_ppl_change;
  bool given() const { return max_kl || max_ppl_change; }
};
// The cheapest configuration (most sequences, then fewest bytes per token)
// that fits and whose measured quality is within the budget; without a
// budget, only lossless ones qualify. -1 when none does.
int recommend(const std::vector<plan_row>& rows, const quality_budget& budget);

// "24GiB", "512MiB", "1.5G", "1000000" (bytes) -> bytes.
result<double> parse_memory_size(const std::string& text);
// MemAvailable of /proc/meminfo, else the machine's physical memory; 0 when unknown.
double available_memory_bytes();

}  // namespace pagoda::cli
