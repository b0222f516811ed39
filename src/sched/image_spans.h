// Images in engine requests (request::images): the checks a request's spans
// pass, the prompt segments they become, the prefix keys of their positions
// and the rows a step's image positions take.
//
// Prefix keys by content. The KV manager hashes a block's token ids; an
// image's positions hold placeholder ids (any id: they only count rows), so
// the scheduler gives the KV manager *key tokens* there instead: negative ids
// (never a vocabulary id) drawn from the image's content hash, the tenant
// and the token's index within the image. The chained block keys then name
// the image: the same image at the same place in a later request of the same
// tenant is a hit in every tier (the memory index, disk and Redis all key by
// the chain), another image of the same size is a miss, and the blocks after
// an image differ with it. Tenants: block 0's extras carry the tenant, so no
// chain crosses tenants; the key tokens carry it too, so an image block's
// key differs between tenants even where a chain is keyed without the
// tenant (the global tenant "" of every --api-key client is one tenant: its
// clients do share, as they share text prefixes).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pagoda/request.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// A clear error for spans that are not sorted, disjoint, inside the prompt,
// with n_embd-wide rows for each token (n_embd <= 0: the width is not
// checked against the model, only between the spans), or that overlap a
// prompt segment.
status check_image_spans(const request& req, int n_embd);

// Adds a prompt segment for each image whose KV type or policy (its own, else
// default_type / default_policy) is not "", keeping req.segments sorted.
// REQUIRES: check_image_spans(req) passed.
void add_image_segments(request& req, std::string_view default_type, std::string_view default_policy);

// The key token of the index-th token of an image (negative).
token_id image_key_token(std::uint64_t content_hash, std::string_view tenant, std::int32_t index);
inline bool is_image_key_token(token_id t) { return t < 0; }

// The prompt as the KV manager keys it: image positions hold key tokens.
std::vector<token_id> keyed_prompt(const request& req);

// Prompt tokens [first, first + tokens.size()) of a step: puts the prompt's
// own ids back where key tokens stand (prompt_ids: request::prompt as
// given), and fills embedded / rows for the image positions among them
// (both left empty when there are none).
void image_rows_of_step(std::span<const image_span> images, std::span<const token_id> prompt_ids, std::int32_t first,
                        std::span<token_id> tokens, std::vector<std::uint8_t>& embedded, std::vector<float>& rows);

// Bidirectional spans (image_span::bidirectional) stay whole in a step: of
// the n tokens a step from prompt token `first` wants, the count that splits
// none: n cut before a span that would start in the step and end after it,
// or extended to the end of a span the step starts inside of (a prefix-cache
// hit or a recompute that ends in it: its cached part was computed seeing
// the whole span). 0: that rest is more than `budget` tokens (the sequence
// waits for a step with room).
int image_step_tokens(std::span<const image_span> images, std::int32_t first, int n, int budget);

// The step's forward_seq::see_until: [positions.size()] for the step's
// prompt tokens from `first` (at positions `positions`), the position of
// their bidirectional span's last token, else their own; left empty when
// the step holds no such token. REQUIRES: image_step_tokens kept the spans whole.
void image_bounds_of_step(std::span<const image_span> images, std::int32_t first,
                          std::span<const std::int32_t> positions, std::vector<std::int32_t>& see_until);

// A clear error for a bidirectional span the engine cannot compute in one
// step: more tokens than max_batched_tokens, or than the per-step cap of
// prompt logprobs (max_scored_tokens, when the request asks for them).
status check_bidirectional_spans(const request& req, int max_batched_tokens, int max_scored_tokens);

// Image tokens among a prompt's first n tokens (of them, those served from the cache).
std::int32_t image_tokens_before(std::span<const image_span> images, std::int32_t n);

// Tokens with the prompt's own ids back where key tokens stand.
void restore_prompt_ids(std::span<const token_id> prompt_ids, std::span<token_id> tokens);

}  // namespace pagoda
