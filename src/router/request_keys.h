// What the router computes of a request to find the replica that holds its
// prefix: the chained keys of its prompt's full blocks, exactly as a replica's
// KV manager keys them (kv/prefix_index.h: tokens, then the tenant and cache
// salt in block 0). The prompt comes from the server's own parser
// (server/openai_request.h: the same tokenizer and chat template, loaded
// from the same GGUF), the tenant from the same tenants file the replicas
// read (the API key decides it); a replica with another model or block size
// is told apart by its summary's fingerprint (router.h).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/prefix_index.h"
#include "server/auth.h"
#include "server/bounded_json.h"
#include "server/openai_request.h"

namespace pagoda::router {

// A request's first prompt and the extra keys of its first block.
struct prompt_info {
  std::vector<token_id> prompt;
  std::string first_extras;
};

// The keys of prompt's first full blocks (at most max_blocks) at block_size,
// all of class 0 (a prompt part with a KV type of its own is keyed with its
// class by the replica: those blocks simply do not match).
std::vector<block_key> prompt_keys(const prompt_info& p, int block_size, std::size_t max_blocks);

class request_hasher {
 public:
  // tenants: the replicas' API keys and tenants (an empty store: every
  // request is the global tenant's).
  request_hasher(server::api_context ctx, server::key_store tenants, server::json_limits limits);

  // The prompt of a completion or chat body; std::nullopt when the body is
  // not one the replicas would accept (they answer it themselves: the router
  // then routes by load). authorization: the request's header, if any.
  std::optional<prompt_info> prompt_of(server::api_kind kind, std::string_view body,
                                       std::optional<std::string_view> authorization) const;

 private:
  server::api_context ctx_;
  server::key_store tenants_;
  server::json_limits limits_;
};

}  // namespace pagoda::router
