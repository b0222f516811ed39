// Images in chat requests (`pagoda serve --mmproj FILE`): the vision tower the
// server encodes `image_url` content parts with, its limits, and its counters.
//
// Where encoding runs: a chat request that carries image parts is parsed on
// the server's image thread (one thread, http_server.h) instead of a worker,
// so text requests are never parsed behind an image; that thread drives a
// pool of `n_threads` encoder threads of its own (vision::make_image_part,
// one image at a time, in arrival order). Neither is the engine thread:
// decoding steps keep running while an image is encoded, but the encoder's
// threads share the machine's cores with the engine's, so a step that
// overlaps an encode runs slower (docs/serving.md, "Images").
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "core/thread_pool.h"
#include "model/llama.h"
#include "pagoda/status.h"
#include "vision/image_decode.h"
#include "vision/image_prompt.h"
#include "vision/mmproj.h"

namespace pagoda::server {

struct image_options {
  // Per image: encoded bytes (after base64), width x height, each side.
  vision::image_limits limits;
  int max_images = 8;  // image parts in one request
  int n_threads = 0;   // encoder threads; <= 0: every hardware thread
  // Encoder outputs kept by the image's bytes (LRU, their embedding rows'
  // bytes counted), so the same image again is neither decoded nor encoded:
  // its prompt part is the same, and its KV then comes from the prefix cache.
  // 0: nothing kept.
  std::size_t cache_bytes = std::size_t{64} << 20;
};

// What /metrics shows of images (prometheus.h, render_image_metrics).
struct image_counters {
  std::int64_t n_encoded = 0;              // images encoded
  std::int64_t n_cache_hits = 0;           // images whose encoder output was kept (not encoded again)
  std::int64_t n_refused = 0;              // image parts refused (bad URL, bytes, format, size)
  double encode_seconds = 0;               // spent in the encoder, decoding included
  std::int64_t n_image_tokens = 0;         // prompt tokens of images in answered requests
  std::int64_t n_cached_image_tokens = 0;  // of which served from the prefix cache
};

class image_input {
 public:
  // Loads the mmproj and checks it against the model (its projection must be
  // the model's embedding width). Errors name the file (--mmproj).
  // REQUIRES: model outlives the image_input.
  static result<std::unique_ptr<image_input>> open(const std::string& mmproj_path, const llama_model& model,
                                                   const image_options& opts);

  const image_options& options() const { return opts_; }
  int n_threads() const { return pool_.size(); }  // the encoder's threads (options().n_threads resolved)
  const vision::mmproj& mmproj() const { return *mmproj_; }

  // The image's prompt part (markers, placeholders, spans with their rows),
  // from its file bytes, or a copy of the one kept for the same bytes.
  // errc::invalid_argument / out_of_range for an image that does not decode
  // or is over a limit. Safe from any thread (encodes are serialized).
  result<vision::image_part> encode(std::span<const std::uint8_t> bytes);

  // Counts an image part refused before encoding.
  void count_refused() { n_refused_.fetch_add(1, std::memory_order_relaxed); }
  // Counts a finished request's image tokens (request_usage).
  void count_usage(int image_tokens, int cached_image_tokens);
  image_counters counters() const;

 private:
  image_input(std::unique_ptr<vision::mmproj> m, const llama_model& model, const image_options& opts);

  std::unique_ptr<vision::mmproj> mmproj_;
  const llama_model& model_;
  image_options opts_;
  // The encoder output cache: newest first; keyed by the bytes' 128-bit
  // XXH3 and their length (a collision would need both to agree).
  struct cache_key {
    std::uint64_t low = 0, high = 0, size = 0;
    bool operator==(const cache_key&) const = default;
  };
  struct cache_key_hash {
    std::size_t operator()(const cache_key& k) const { return static_cast<std::size_t>(k.low ^ (k.high * 31)); }
  };
  struct cache_entry {
    cache_key key;
    vision::image_part part;
    std::size_t bytes = 0;
  };
  static cache_key key_of(std::span<const std::uint8_t> bytes);
  void keep(const cache_key& key, const vision::image_part& part);

  std::mutex encode_mu_;  // the pool runs one job at a time; guards the cache too
  thread_pool pool_;
  std::list<cache_entry> cache_;
  std::unordered_map<cache_key, std::list<cache_entry>::iterator, cache_key_hash> cache_index_;
  std::size_t cache_used_ = 0;
  std::atomic<std::int64_t> n_encoded_{0}, n_refused_{0}, encode_us_{0}, n_image_tokens_{0}, n_cached_image_tokens_{0},
      n_cache_hits_{0};
};

}  // namespace pagoda::server
