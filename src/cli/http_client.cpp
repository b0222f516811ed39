#include "cli/http_client.h"

#include <curl/curl.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>

namespace pagoda::cli {
namespace {

struct transfer {
  CURL* curl = nullptr;
  http_response response;
  std::FILE* out = nullptr;  // null: the body goes to response.body
  const std::function<void(long)>* on_start = nullptr;
  const std::function<void(const char*, std::size_t)>* on_data = nullptr;
  const std::function<void(std::int64_t)>* on_progress = nullptr;
  std::int64_t received = 0;
  bool started = false;
  bool write_failed = false;
  int write_errno = 0;
};

bool streaming(transfer& t) {
  if (t.out == nullptr) return false;
  long code = 0;
  curl_easy_getinfo(t.curl, CURLINFO_RESPONSE_CODE, &code);
  if (code != 200 && code != 206) return false;
  if (!t.started) {
    t.started = true;
    if (*t.on_start) (*t.on_start)(code);
  }
  return true;
}

std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user) {
  auto& t = *static_cast<transfer*>(user);
  const std::size_t bytes = size * n;
  if (!streaming(t)) {
    if (t.response.body.size() < (1u << 20)) t.response.body.append(data, bytes);  // an error page: keep its start
    return bytes;
  }
  if (std::fwrite(data, 1, bytes, t.out) != bytes) {
    t.write_failed = true;
    t.write_errno = errno;
    return 0;  // aborts the transfer
  }
  if (*t.on_data) (*t.on_data)(data, bytes);
  t.received += static_cast<std::int64_t>(bytes);
  if (*t.on_progress) (*t.on_progress)(t.received);
  return bytes;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == '\n' || s.back() == ' ')) s.pop_back();
  std::size_t b = s.find_first_not_of(' ');
  return b == std::string::npos ? std::string() : s.substr(b);
}

bool header_is(const std::string& line, const char* name) {
  const std::size_t n = std::strlen(name);
  return line.size() > n && strncasecmp(line.c_str(), name, n) == 0 && line[n] == ':';
}

// Link: <https://...?cursor=x>; rel="next" (the tree API's pagination).
std::string next_link_of(const std::string& value) {
  std::size_t at = 0;
  while (at < value.size()) {
    const std::size_t lt = value.find('<', at), gt = value.find('>', lt == std::string::npos ? at : lt);
    if (lt == std::string::npos || gt == std::string::npos) break;
    const std::size_t end = value.find(',', gt);
    const std::string params = value.substr(gt, end == std::string::npos ? std::string::npos : end - gt);
    if (params.find("rel=\"next\"") != std::string::npos) return value.substr(lt + 1, gt - lt - 1);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user) {
  auto& r = static_cast<transfer*>(user)->response;
  const std::string line(data, size * n);
  if (line.starts_with("HTTP/")) {  // a new response (after a redirect): forget the last one's headers
    r.next_link.clear();
    r.error_header.clear();
  } else if (header_is(line, "Link")) {
    r.next_link = next_link_of(trimmed(line.substr(5)));
  } else if (header_is(line, "X-Error-Message")) {
    r.error_header = trimmed(line.substr(16));
  }
  return size * n;
}

std::string host_of(const std::string& url) {
  const std::size_t scheme = url.find("://");
  const std::size_t start = scheme == std::string::npos ? 0 : scheme + 3;
  return url.substr(start, url.find('/', start) - start);
}

status transport_error(CURLcode code, const char* detail, const transfer& t, const std::string& url) {
  const std::string what = detail[0] != '\0' ? detail : curl_easy_strerror(code);
  switch (code) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
      return error(errc::io_error, "{}{} ({}): is the network up?", k_unreachable_prefix, host_of(url), what);
    case CURLE_WRITE_ERROR:
      if (t.write_failed) return error(errc::io_error, "writing the download failed: {}", std::strerror(t.write_errno));
      break;
    default:
      break;
  }
  if (t.out != nullptr)
    return error(errc::io_error, "the download from {} stopped after {} bytes ({}); run the same command again to resume",
                 host_of(url), t.received, what);
  return error(errc::io_error, "GET {} failed: {}", url, what);
}

std::once_flag g_curl_init;

result<http_response> perform(const http_request& req, transfer& t) {
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) return error(errc::internal, "libcurl could not start a transfer");
  t.curl = curl.get();
  curl_slist* headers = nullptr;
  for (const std::string& h : req.headers) headers = curl_slist_append(headers, h.c_str());
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> header_list(headers, curl_slist_free_all);
  char detail[CURL_ERROR_SIZE] = {0};
  const std::string range = std::to_string(req.range_from) + "-";
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
  curl_easy_setopt(c, CURLOPT_UNRESTRICTED_AUTH, 0L);  // the token stays with the host it was given for
  curl_easy_setopt(c, CURLOPT_USERAGENT, "pagoda/" PAGODA_VERSION_STRING);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 30L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);  // a stalled transfer ends after a minute without a byte
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, detail);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  if (req.range_from > 0) curl_easy_setopt(c, CURLOPT_RANGE, range.c_str());
  const CURLcode code = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &t.response.status);
  curl_off_t length = -1;
  curl_easy_getinfo(c, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
  t.response.content_length = length;
  if (code != CURLE_OK) return transport_error(code, detail, t, req.url);
  return std::move(t.response);
}

}  // namespace

result<http_response> http_get(const http_request& req) {
  transfer t;
  return perform(req, t);
}

result<http_response> http_get_to_file(const http_request& req, std::FILE* out,
                                       const std::function<void(long status)>& on_start,
                                       const std::function<void(const char*, std::size_t)>& on_data,
                                       const std::function<void(std::int64_t received)>& on_progress) {
  transfer t;
  t.out = out;
  t.on_start = &on_start;
  t.on_data = &on_data;
  t.on_progress = &on_progress;
  return perform(req, t);
}

}  // namespace pagoda::cli
