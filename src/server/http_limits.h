// What one client may cost the server, and how long it may take. Each has a
// `pagoda serve` flag (docs/serving.md); the defaults follow nginx and Envoy
// where they have the same limit:
//
//   header bytes      32 KiB  nginx: large_client_header_buffers 4 x 8k; Envoy: max_request_headers_kb 60
//   header count      100     Envoy: max_headers_count 100
//   body bytes        4 MiB   nginx: client_max_body_size 1m; counted as received, chunked or not
//   header timeout    10 s    nginx: client_header_timeout 60s (from accept or the first byte of a request)
//   body timeout      60 s    nginx: client_body_timeout 60s (here: the whole body, not between reads)
//   idle timeout      75 s    nginx: keepalive_timeout 75s (a keep-alive connection between requests)
//   send timeout      60 s    nginx: send_timeout 60s (a write that makes no progress)
//   connections       8192    nginx: worker_connections x workers; beyond it 503 and close
//   per address       1024    nginx: limit_conn (no default there); beyond it 503 and close
//
// A body with Content-Encoding other than identity is refused (415): the
// server never inflates, so a small compressed body cannot become a large one.
#pragma once

#include <chrono>
#include <cstddef>

#include "server/bounded_json.h"

namespace pagoda::server {

struct http_limits {
  std::size_t max_header_bytes = 32u << 10;  // request line and fields; beyond: 431
  int max_header_count = 100;                // fields, trailers included; beyond: 431
  std::size_t max_body_bytes = 4u << 20;     // beyond: 413
  // Bodies held in memory by all connections at once (received and not yet
  // parsed). Beyond it a request gets 503 and Retry-After, so many concurrent
  // large uploads cannot exhaust memory.
  std::size_t max_body_memory_bytes = 128u << 20;
  // Of that, what the bodies of one API key's requests may hold at once
  // (beyond it 429 and Retry-After): a tenant's slow or parallel uploads
  // spend its own share, never everyone's. A connection holds at most one
  // body, so its own share is max_body_bytes, and max_body_memory_bytes
  // caps the sum over keyless requests (no keys configured).
  std::size_t max_body_memory_per_key_bytes = 32u << 20;
  std::chrono::milliseconds header_timeout{10'000};  // beyond: 408 and close
  std::chrono::milliseconds body_timeout{60'000};    // beyond: 408 and close
  std::chrono::milliseconds idle_timeout{75'000};    // beyond: closed quietly
  std::chrono::milliseconds send_timeout{60'000};    // beyond: closed (and its requests cancelled)
  // Bytes of a streamed response queued for a client that does not read;
  // beyond it the stream's requests are cancelled and the connection closed.
  std::size_t max_pending_send_bytes = 4u << 20;
  int max_connections = 8192;  // open at once; beyond: 503 and close
  // Open at once from one client address (an IPv6 /64); beyond: 503 and
  // close (connection_limits.h; /health is still answered). 0: no cap.
  int max_connections_per_address = 1024;
  json_limits json;
};

}  // namespace pagoda::server
