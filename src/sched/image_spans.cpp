#include "sched/image_spans.h"

#include <algorithm>
#include <string>

#include "core/assert.h"
#include "core/hash.h"

namespace pagoda {

status check_image_spans(const request& req, int n_embd) {
  const auto n_prompt = static_cast<std::int64_t>(req.prompt.size());
  std::int64_t width = n_embd > 0 ? n_embd : 0;
  for (std::size_t i = 0; i < req.images.size(); ++i) {
    const image_span& im = req.images[i];
    if (im.n_tokens <= 0 || im.begin < 0 || static_cast<std::int64_t>(im.begin) + im.n_tokens > n_prompt)
      return error(errc::invalid_argument, "image {}: positions [{}, {}) are not a non-empty range of the {}-token prompt",
                   i, im.begin, static_cast<std::int64_t>(im.begin) + im.n_tokens, n_prompt);
    if (i > 0 && im.begin < req.images[i - 1].begin + req.images[i - 1].n_tokens)
      return error(errc::invalid_argument, "image {} (from position {}) overlaps or precedes image {}", i, im.begin, i - 1);
    const std::size_t n_values = im.embeddings.size();
    if (n_values == 0 || n_values % static_cast<std::size_t>(im.n_tokens) != 0)
      return error(errc::invalid_argument, "image {}: {} embedding values are not a row per each of its {} tokens", i,
                   n_values, im.n_tokens);
    const auto w = static_cast<std::int64_t>(n_values / static_cast<std::size_t>(im.n_tokens));
    if (width == 0) width = w;
    if (w != width)
      return error(errc::invalid_argument, "image {}: embedding rows of width {}, but the model's are {} wide (an mmproj "
                   "made for another model?)", i, w, width);
    const std::int64_t end = static_cast<std::int64_t>(im.begin) + im.n_tokens;
    for (const prompt_segment& p : req.segments)
      if (p.begin < end && im.begin < p.end)
        return error(errc::invalid_argument, "image {} (positions [{}, {})) overlaps prompt segment [{}, {}): an image "
                     "is a segment of its own (its kv_type and kv_policy)", i, im.begin, end, p.begin, p.end);
  }
  return ok_status();
}

void add_image_segments(request& req, std::string_view default_type, std::string_view default_policy) {
  bool added = false;
  for (const image_span& im : req.images) {
    prompt_segment p;
    p.begin = im.begin;
    p.end = im.begin + im.n_tokens;
    p.kv_type = im.kv_type.empty() ? std::string(default_type) : im.kv_type;
    p.kv_policy = im.kv_policy.empty() ? std::string(default_policy) : im.kv_policy;
    if (p.kv_type.empty() && p.kv_policy.empty()) continue;
    req.segments.push_back(std::move(p));
    added = true;
  }
  if (added)
    std::stable_sort(req.segments.begin(), req.segments.end(),
                     [](const prompt_segment& a, const prompt_segment& b) { return a.begin < b.begin; });
}

token_id image_key_token(std::uint64_t content_hash, std::string_view tenant, std::int32_t index) {
  hasher h(0x696d616765ULL);  // "image"
  h.update_pod(content_hash).update_pod(static_cast<std::uint64_t>(tenant.size())).update(tenant.data(), tenant.size());
  h.update_pod(index);
  // 31 bits of the digest, as a negative id: -1 .. -2^31.
  return static_cast<token_id>(-1 - static_cast<std::int64_t>(h.digest() & 0x7fffffffULL));
}

std::vector<token_id> keyed_prompt(const request& req) {
  std::vector<token_id> out = req.prompt;
  for (const image_span& im : req.images)
    for (std::int32_t j = 0; j < im.n_tokens; ++j)
      out[static_cast<std::size_t>(im.begin + j)] = image_key_token(im.content_hash, req.tenant, j);
  return out;
}

std::int32_t image_tokens_before(std::span<const image_span> images, std::int32_t n) {
  std::int32_t total = 0;
  for (const image_span& im : images) total += std::clamp(n - im.begin, 0, im.n_tokens);
  return total;
}

void restore_prompt_ids(std::span<const token_id> prompt_ids, std::span<token_id> tokens) {
  const std::size_t n = std::min(prompt_ids.size(), tokens.size());
  for (std::size_t i = 0; i < n; ++i)
    if (is_image_key_token(tokens[i])) tokens[i] = prompt_ids[i];
}

void image_rows_of_step(std::span<const image_span> images, std::span<const token_id> prompt_ids, std::int32_t first,
                        std::span<token_id> tokens, std::vector<std::uint8_t>& embedded, std::vector<float>& rows) {
  embedded.clear();
  rows.clear();
  const auto n = static_cast<std::int32_t>(tokens.size());
  for (const image_span& im : images) {
    const std::int32_t from = std::max(first, im.begin), to = std::min(first + n, im.begin + im.n_tokens);
    if (from >= to) continue;
    const std::size_t width = im.embeddings.size() / static_cast<std::size_t>(im.n_tokens);
    if (embedded.empty()) {
      embedded.assign(static_cast<std::size_t>(n), 0);
      rows.assign(static_cast<std::size_t>(n) * width, 0.0f);
    }
    for (std::int32_t p = from; p < to; ++p) {
      const auto j = static_cast<std::size_t>(p - first);
      embedded[j] = 1;
      tokens[j] = prompt_ids[static_cast<std::size_t>(p)];
      std::copy_n(im.embeddings.data() + static_cast<std::size_t>(p - im.begin) * width, width, rows.data() + j * width);
    }
  }
}

int image_step_tokens(std::span<const image_span> images, std::int32_t first, int n, int budget) {
  for (const image_span& im : images) {
    const std::int32_t end = im.begin + im.n_tokens;
    if (!im.bidirectional || end <= first || im.begin >= first + n || first + n >= end) continue;
    // The step ends inside this span.
    if (im.begin > first) return im.begin - first;  // stop before it: it starts a step of its own
    return end - first <= budget ? end - first : 0;  // its rest whole (spans are disjoint: no later one is cut)
  }
  return n;
}

void image_bounds_of_step(std::span<const image_span> images, std::int32_t first,
                          std::span<const std::int32_t> positions, std::vector<std::int32_t>& see_until) {
  see_until.clear();
  const auto n = static_cast<std::int32_t>(positions.size());
  for (const image_span& im : images) {
    const std::int32_t end = im.begin + im.n_tokens;
    const std::int32_t from = std::max(first, im.begin), to = std::min(first + n, end);
    if (!im.bidirectional || from >= to) continue;
    PAGODA_ASSERT(to == end, "a step ends inside bidirectional span [{}, {}) at {}", im.begin, end, first + n);
    if (see_until.empty()) see_until.assign(positions.begin(), positions.end());
    const std::int32_t last = positions[static_cast<std::size_t>(to - 1 - first)];
    for (std::int32_t p = from; p < to; ++p) see_until[static_cast<std::size_t>(p - first)] = last;
  }
}

status check_bidirectional_spans(const request& req, int max_batched_tokens, int max_scored_tokens) {
  for (std::size_t i = 0; i < req.images.size(); ++i) {
    const image_span& im = req.images[i];
    if (!im.bidirectional) continue;
    if (im.n_tokens > max_batched_tokens)
      return error(errc::invalid_argument,
                   "image {}: its {} tokens attend to each other both ways (Gemma 3) and are computed in one step, "
                   "but a step holds at most {} tokens; raise --max-num-batched-tokens to at least {}",
                   i, im.n_tokens, max_batched_tokens, im.n_tokens);
    if (req.prompt_logprobs >= 0 && im.n_tokens > max_scored_tokens)
      return error(errc::invalid_argument,
                   "image {}: prompt_logprobs score at most {} tokens a step, but its {} tokens attend to each other "
                   "both ways and are computed in one step; send the request without prompt_logprobs",
                   i, max_scored_tokens, im.n_tokens);
  }
  return ok_status();
}

}  // namespace pagoda
