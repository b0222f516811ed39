// HTTP GETs over libcurl for `pagoda pull` (hub.h): a small body into memory,
// a large one appended to an open file from a byte offset (a Range request).
// Redirects are followed (Hugging Face answers a file with a redirect to its
// CDN); custom headers such as Authorization are not sent to another host.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::cli {

struct http_request {
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  std::int64_t range_from = 0;       // > 0: ask for bytes range_from.. (Range: bytes=N-)
};

// What came back. A transport failure (no network, refused, timed out, cut
// off) is an error status instead; any HTTP status is a response.
struct http_response {
  long status = 0;
  std::string body;                  // the body, unless it went to a file
  std::string next_link;             // the Link header's rel="next" URL, if any
  std::string error_header;          // X-Error-Message (Hugging Face's reason), if any
  std::int64_t content_length = -1;  // of this response's body; -1 unknown
};

// A transport failure's message starts with this when the host could not be
// reached at all (name lookup, connection): the caller may fall back to what
// it has cached.
inline constexpr const char* k_unreachable_prefix = "cannot reach ";

result<http_response> http_get(const http_request& req);

// Streams the body of a 200 or 206 answer into `out` (at its current
// position), first calling on_start with that status (a 200 to a Range request
// is the whole file: the caller starts over), then on_data with each chunk (for hashing) and on_progress with the bytes
// received so far of this response; other statuses leave `out` alone and their
// body in the response. A transfer cut off part way is an error status (what
// arrived is in `out`, so a later request can resume from there).
result<http_response> http_get_to_file(const http_request& req, std::FILE* out,
                                       const std::function<void(long status)>& on_start,
                                       const std::function<void(const char*, std::size_t)>& on_data,
                                       const std::function<void(std::int64_t received)>& on_progress);

}  // namespace pagoda::cli
