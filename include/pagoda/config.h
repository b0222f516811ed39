// How to open an engine: the model, the KV cache and the scheduler's limits,
// in the words of the command line (every `pagoda` command that runs a model
// fills one of these from its flags). Part of Pagoda's public API (engine.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pagoda {

struct engine_config {
  // --- model -------------------------------------------------------------
  std::string model_path;            // a GGUF file
  int n_threads = 0;                 // 0: every core
  int n_ctx = 0;                     // tokens per sequence; 0: the model's trained context
  bool use_mmap = true;              // false: read the weights into memory (--no-mmap)

  // --- KV cache ----------------------------------------------------------
  // Types: "auto" (the model's float type), f32, f16, bf16, fp8 (fp8_e4m3),
  // fp8_e5m2, int8, int4, int2, q8_0, q4_0; TYPE/MODE picks the scale
  // granularity (token, channel, gN, static, none); K/V pairs as "k8v4" or
  // "int8+int4/token".
  std::string kv_cache_dtype = "auto";
  std::string cache_type_k;          // overrides kv_cache_dtype for K
  std::string cache_type_v;          // overrides kv_cache_dtype for V
  std::string kv_layer_types;        // per layer ranges, later rules win: "0-1:f16,2-:int4"
  std::string kv_scales_path;        // calibrated ranges (pagoda calibrate) for static scales
  // Cross-layer KV sharing for a model that declares none (docs/kv-sharing.md):
  // "none", or "reuse:from=L" (from layer L up, each pair's upper layer reads
  // the lower one's KV).
  std::string kv_share = "none";
  int block_size = 16;               // tokens per KV block
  double kv_cache_size_mib = 0;      // pool size in MiB, or
  std::int64_t max_kv_tokens = 0;    // pool size in tokens; neither: max_num_seqs full contexts, at most 4 GiB
  // The pool's blocks in transparent huge pages, faulted in when the engine
  // starts (--kv-huge-pages): decode attention reads them with fewer TLB
  // misses, at the price of a slower start and the whole pool resident from
  // it. Off: base pages, faulted in as blocks are first written.
  bool kv_huge_pages = false;
  bool enable_prefix_caching = true;
  // The order cached prefix blocks are evicted in: "lfu" (reuse counts, aged:
  // one-off prompts pass through without flushing reused prefixes) or "lru".
  std::string prefix_cache_eviction = "lfu";
  std::map<std::string, std::int32_t> tenant_quota_blocks;  // tenant -> most KV blocks it may hold
  // KV policy of requests that name none: "NAME[:key=value,...]" (docs/policies.md),
  // e.g. "h2o:budget=0.25"; "none" keeps every token.
  std::string kv_policy = "none";
  // Speculative decoding of requests that name none: "NAME[:key=value,...]"
  // (docs/speculative.md), e.g. "ngram:k=5,n=3"; "none" decodes one token a step.
  std::string speculative = "none";
  // A draft model for speculative `draft` (a GGUF with this model's
  // vocabulary); with it, `speculative` "none" becomes "draft".
  std::string draft_model_path;
  // Keep per-block key summaries (min/max/mean of the keys) so that requests
  // may use query-aware policies (quest) whatever the default policy.
  bool kv_key_summaries = false;
  // Sliding-window layers keep K/V for every position (llama.cpp's --swa-full).
  // Off: they keep only their window (blocks freed as it moves when every
  // layer slides; window slots when some do), and a request's KV policy is
  // refused on such models (a default --kv-policy keeps every position).
  bool swa_full = false;
  // KV classes for prompt segments that ask for their own KV type (a part's
  // "kv": {"type": ...}): each "TYPE[:FRACTION]" adds a class of blocks of
  // TYPE (as --kv-cache-dtype takes it) that gets FRACTION (default 0.25) of
  // the pool's bytes; --kv-cache-dtype's blocks get the rest.
  std::vector<std::string> kv_segment_dtypes;
  // Images in the prompt (request::images): the KV type of their blocks (a
  // class of that type is added, --kv-segment-dtype's default fraction,
  // unless one is listed there or it is the default type) and their KV
  // policy; "": as the text around them. A request's image span may name its own.
  std::string kv_image_type;
  std::string kv_image_policy;

  // --- KV warehouse (persistent tiers behind the pool) ---------------------
  std::string kv_store_path;         // local disk tier directory (LMDB); "" = none
  double kv_store_size_gib = 8;      // its size cap
  std::string kv_store_remote;       // a Redis URL (redis://, rediss://), shared between servers; "" = none
  std::int64_t kv_store_ttl_s = 0;   // entries unused this long are dropped; 0 = no expiry
  // A file holding the secret that MACs stored records (docs/kv-store.md);
  // "" = records are only checksummed (forgeable by whoever can write a tier).
  std::string kv_store_secret_file;

  // --- scheduling --------------------------------------------------------
  int max_num_seqs = 64;             // sequences running at once
  int max_num_batched_tokens = 2048; // tokens per step (decode + prompt chunks)
  int max_waiting = 1 << 20;         // requests queued at once
  // Admission order of waiting requests: "fcfs", or "cache-aware" (longest
  // cached or in-flight prefix first; a request passed over by later
  // arrivals in max_passed_steps steps goes back to arrival order).
  std::string scheduling_policy = "cache-aware";
  int max_passed_steps = 16;
};

}  // namespace pagoda
