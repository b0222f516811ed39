// Pagoda as a library: what a C++ program links against to run a GGUF model
// with Pagoda's paged, prefix-cached, optionally quantized KV cache.
//
//   auto eng = pagoda::engine::create({.model_path = "model.gguf"});
//   pagoda::request r{.id = "a", .prompt = (*eng)->tokenize("Once upon a time"), .max_tokens = 32};
//   (*eng)->add_request(std::move(r));
//   std::vector<pagoda::engine_event> events;
//   while ((*eng)->has_work()) (*eng)->step(events);   // events carry tokens and text as they come
//
// Many requests may be in flight at once: each step batches them all
// (continuous batching, chunked prefill), shares KV of common prompt prefixes
// and preempts when the KV pool runs short. An engine is used by one thread at
// a time. examples/generate.cpp is a complete program.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/config.h"
#include "pagoda/events.h"
#include "pagoda/request.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// What the engine was opened with, resolved (defaults filled in).
struct engine_info {
  std::string model_path;
  std::string model_name;          // general.name, or the architecture
  std::string architecture;
  int n_vocab = 0;
  int n_ctx = 0;                   // tokens per sequence
  std::string kv_layout;           // "f16+f16", "int8/token+int4/token", or per layer ranges
  int kv_block_size = 0;           // tokens per KV block
  std::int64_t kv_blocks = 0;      // blocks in the pool
  std::size_t kv_bytes_per_block = 0;  // of the pool's blocks: with a window group, the full layers' part
  double kv_bytes_per_token = 0;
  std::size_t kv_bytes_total = 0;  // every byte the KV cache maps
  // Sliding-window layers beside full ones keep only their window, in a KV
  // group of their own (0 blocks: none, or --swa-full): its blocks (per KV
  // type), the bytes of one, the window.
  std::int64_t kv_window_blocks = 0;
  std::size_t kv_window_block_bytes = 0;
  int kv_window_tokens = 0;
};

// The KV pool now.
struct kv_usage {
  std::int32_t n_blocks_used = 0;
  std::int32_t n_blocks_used_peak = 0;
  std::int32_t n_blocks_cached = 0;  // held only by the prefix cache, reusable
  std::int64_t n_prefix_hit_tokens = 0;
  std::int64_t n_preemptions = 0;
  std::int32_t n_window_blocks_used_peak = 0;  // blocks of the window group (engine_info) used at once, at most
};

// Speculative decoding so far, over every drafter (docs/speculative.md).
struct speculation_usage {
  std::int64_t n_drafts = 0;           // verification steps that carried drafts
  std::int64_t n_draft_tokens = 0;     // draft tokens proposed
  std::int64_t n_accepted_tokens = 0;  // of which accepted
  double draft_seconds = 0;            // in model drafters' draft passes
  double verify_seconds = 0;           // in the forward passes that verified drafts
};

class engine {
 public:
  // Loads the model and maps the KV cache. Errors name the file or the option
  // at fault ("--kv-cache-dtype: unknown KV cache type 'f7'").
  static result<std::unique_ptr<engine>> create(const engine_config& config);
  ~engine();
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // The model's tokenizer. add_bos: prepend BOS where the vocabulary has one.
  std::vector<token_id> tokenize(std::string_view text, bool add_bos = true) const;
  std::string detokenize(std::span<const token_id> tokens) const;
  bool is_end_of_generation(token_id token) const;

  // Queues a request; rejected at once with a clear error when it can never
  // run (prompt longer than the context, more KV than the pool holds, bad
  // sampling values, a duplicate id, ...).
  status add_request(request req);
  // Ends a request now ("abort" events follow); false for an unknown id.
  bool abort_request(const std::string& id);
  bool has_work() const;
  // One step of continuous batching; appends what it produced. A failed step
  // ends its requests with "error" events; the engine stays usable.
  void step(std::vector<engine_event>& events);

  const engine_info& info() const;
  kv_usage usage() const;
  speculation_usage speculation() const;

 private:
  struct impl;
  explicit engine(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace pagoda
