#include "server/image_input.h"

#include <xxhash.h>

#include "core/clock.h"

namespace pagoda::server {

result<std::unique_ptr<image_input>> image_input::open(const std::string& mmproj_path, const llama_model& model,
                                                       const image_options& opts) {
  auto m = vision::mmproj::open(mmproj_path);
  if (!m.ok()) return m.error().with_context("--mmproj " + mmproj_path);
  if (status st = (*m)->check_text_model(model.hparams().n_embd); !st.ok()) return st.with_context("--mmproj " + mmproj_path);
  if (opts.max_images < 1) return error(errc::invalid_argument, "--max-images-per-request must be at least 1");
  return std::unique_ptr<image_input>(new image_input(std::move(*m), model, opts));
}

image_input::image_input(std::unique_ptr<vision::mmproj> m, const llama_model& model, const image_options& opts)
    : mmproj_(std::move(m)), model_(model), opts_(opts), pool_(opts.n_threads) {}

image_input::cache_key image_input::key_of(std::span<const std::uint8_t> bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return {h.low64, h.high64, bytes.size()};
}

// Keeps a copy of the part as the newest entry; drops the oldest past the budget.
void image_input::keep(const cache_key& key, const vision::image_part& part) {
  std::size_t bytes = part.tokens.size() * sizeof(token_id);
  for (const image_span& s : part.spans) bytes += s.embeddings.size() * sizeof(float);
  if (bytes > opts_.cache_bytes) return;
  cache_.push_front(cache_entry{key, part, bytes});
  cache_index_[key] = cache_.begin();
  cache_used_ += bytes;
  while (cache_used_ > opts_.cache_bytes) {
    cache_used_ -= cache_.back().bytes;
    cache_index_.erase(cache_.back().key);
    cache_.pop_back();
  }
}

result<vision::image_part> image_input::encode(std::span<const std::uint8_t> bytes) {
  std::lock_guard lock(encode_mu_);
  const cache_key key = key_of(bytes);
  if (auto it = cache_index_.find(key); it != cache_index_.end()) {
    cache_.splice(cache_.begin(), cache_, it->second);
    n_cache_hits_.fetch_add(1, std::memory_order_relaxed);
    return cache_.front().part;
  }
  const std::int64_t t0 = now_us();
  auto part = vision::make_image_part(bytes, *mmproj_, model_.vocab(), model_.hparams().n_embd, pool_, opts_.limits);
  encode_us_.fetch_add(now_us() - t0, std::memory_order_relaxed);
  if (!part.ok()) {
    n_refused_.fetch_add(1, std::memory_order_relaxed);
    return part;
  }
  n_encoded_.fetch_add(1, std::memory_order_relaxed);
  keep(key, *part);
  return part;
}

void image_input::count_usage(int image_tokens, int cached_image_tokens) {
  n_image_tokens_.fetch_add(image_tokens, std::memory_order_relaxed);
  n_cached_image_tokens_.fetch_add(cached_image_tokens, std::memory_order_relaxed);
}

image_counters image_input::counters() const {
  image_counters c;
  c.n_encoded = n_encoded_.load(std::memory_order_relaxed);
  c.n_cache_hits = n_cache_hits_.load(std::memory_order_relaxed);
  c.n_refused = n_refused_.load(std::memory_order_relaxed);
  c.encode_seconds = static_cast<double>(encode_us_.load(std::memory_order_relaxed)) * 1e-6;
  c.n_image_tokens = n_image_tokens_.load(std::memory_order_relaxed);
  c.n_cached_image_tokens = n_cached_image_tokens_.load(std::memory_order_relaxed);
  return c;
}

}  // namespace pagoda::server
