#include "cli/hub_download.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <openssl/evp.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "cli/common.h"
#include "cli/http_client.h"

namespace pagoda::cli {
namespace fs = std::filesystem;
namespace {

class sha256_hasher {
 public:
  sha256_hasher() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) { reset(); }
  void reset() { EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr); }
  void update(const char* data, std::size_t n) { EVP_DigestUpdate(ctx_.get(), data, n); }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_.get(), md, &n);
    std::string out;
    for (unsigned int i = 0; i < n; ++i) out += fmt::format("{:02x}", md[i]);
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx_;
};

// A bar with the rate and the time left, redrawn at most ten times a second,
// when stderr is a terminal; nothing otherwise (the caller's lines say it all).
class download_meter {
 public:
  download_meter(std::string name, std::int64_t total, std::int64_t start)
      : name_(std::move(name)), total_(total), start_bytes_(start), tty_(isatty(STDERR_FILENO) == 1) {}

  void update(std::int64_t done, bool force = false) {
    if (!tty_) return;
    const auto now = clock::now();
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const double secs = std::chrono::duration<double>(now - started_).count();
    const double rate = secs > 0 ? static_cast<double>(done - start_bytes_) / secs : 0;
    std::string line = fmt::format("\r{} ", name_);
    if (total_ > 0) {
      const int pct = static_cast<int>(100 * done / total_);
      constexpr int k_width = 30;
      const int filled = pct * k_width / 100;
      line += fmt::format("{:3d}% [{}{}] {} / {}", pct, std::string(filled, '#'), std::string(k_width - filled, ' '),
                          human_bytes(static_cast<double>(done)), human_bytes(static_cast<double>(total_)));
      if (rate > 0) {
        const auto left = static_cast<long long>(static_cast<double>(total_ - done) / rate);
        line += fmt::format("  {}/s  {}m{:02d}s left", human_bytes(rate), left / 60, static_cast<int>(left % 60));
      }
    } else {
      line += human_bytes(static_cast<double>(done));
    }
    std::fprintf(stderr, "%s\x1b[K", line.c_str());
    std::fflush(stderr);
    drawn_ = true;
  }

  void finish() {
    if (!drawn_) return;
    std::fprintf(stderr, "\r\x1b[K");
    std::fflush(stderr);
  }

  double seconds() const { return std::chrono::duration<double>(clock::now() - started_).count(); }

 private:
  using clock = std::chrono::steady_clock;
  std::string name_;
  std::int64_t total_;
  std::int64_t start_bytes_;
  bool tty_;
  bool drawn_ = false;
  clock::time_point started_ = clock::now();
  clock::time_point last_draw_{};
};

struct file_closer {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using file_ptr = std::unique_ptr<std::FILE, file_closer>;

// Opens (creating) the partial file, locked against a second pull of the same file.
result<file_ptr> open_part(const std::string& part, const std::string& local) {
  std::error_code ec;
  fs::create_directories(fs::path(part).parent_path(), ec);
  if (ec) return error(errc::io_error, "cannot create {}: {}", fs::path(part).parent_path().string(), ec.message());
  const int fd = ::open(part.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return error(errc::io_error, "cannot open {}: {}", part, std::strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd);
    if (e == EWOULDBLOCK) return error(errc::io_error, "another process is pulling {} now ({} is locked)", local, part);
    return error(errc::io_error, "cannot lock {}: {}", part, std::strerror(e));
  }
  std::FILE* f = fdopen(fd, "r+b");
  if (f == nullptr) {
    ::close(fd);
    return error(errc::io_error, "cannot open {}: {}", part, std::strerror(errno));
  }
  return file_ptr(f);
}

// Hashes what an earlier attempt left and leaves the file positioned at its end.
std::int64_t hash_existing(std::FILE* f, sha256_hasher& hasher) {
  std::rewind(f);
  std::vector<char> buf(1 << 20);
  std::int64_t n_total = 0;
  for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    hasher.update(buf.data(), n);
    n_total += static_cast<std::int64_t>(n);
  }
  std::clearerr(f);
  std::fseek(f, 0, SEEK_END);
  return n_total;
}

status start_over(std::FILE* f, sha256_hasher& hasher, std::int64_t& have) {
  std::fflush(f);
  if (ftruncate(fileno(f), 0) != 0) return error(errc::io_error, "cannot truncate a partial download: {}", std::strerror(errno));
  std::rewind(f);
  hasher.reset();
  have = 0;
  return ok_status();
}

status check_space(const std::string& dir, std::int64_t needed) {
  struct statvfs st {};
  if (needed <= 0 || statvfs(dir.c_str(), &st) != 0) return ok_status();
  const auto avail = static_cast<std::int64_t>(st.f_bavail) * static_cast<std::int64_t>(st.f_frsize);
  if (avail >= needed) return ok_status();
  return error(errc::resource_exhausted, "not enough space in {}: {} to download, {} free (set PAGODA_MODELS to "
               "another folder)", dir, human_bytes(static_cast<double>(needed)), human_bytes(static_cast<double>(avail)));
}

status http_file_error(const download_target& t, const http_response& r) {
  const std::string why = r.error_header.empty() ? "" : fmt::format(" ({})", r.error_header);
  switch (r.status) {
    case 401:
    case 403:
      return error(errc::not_found, "GET {}: HTTP {}{}: {}", t.url, r.status, why,
                   t.headers.empty() ? "the file needs a token: set HF_TOKEN (for a gated model, accept its terms first)"
                                     : "HF_TOKEN cannot read it (for a gated model, accept its terms first)");
    case 404:
      return error(errc::not_found, "GET {}: HTTP 404{}: the repository lists the file but does not serve it", t.url, why);
    default:
      return error(errc::io_error, "GET {}: HTTP {}{}", t.url, r.status, why);
  }
}

// Fetches what the partial file lacks. A 416 (the partial file is not a prefix
// the server knows) starts over once.
status fetch_rest(const download_target& t, std::FILE* f, sha256_hasher& hasher, std::int64_t& have) {
  const std::string name = fs::path(t.local_path).filename().string();
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::fprintf(stderr, "pagoda: downloading %s%s\n", t.url.c_str(),
                 have > 0 ? fmt::format(" from byte {} (resuming)", have).c_str() : "");
    download_meter meter(name, t.size, have);
    const std::int64_t base = have;
    status restart;
    auto on_start = [&](long code) {
      if (code == 200 && base > 0) restart = start_over(f, hasher, have);  // the server ignored the Range
    };
    auto on_data = [&](const char* data, std::size_t n) {
      hasher.update(data, n);
      have += static_cast<std::int64_t>(n);
    };
    auto on_progress = [&](std::int64_t) { meter.update(have); };
    auto r = http_get_to_file({t.url, t.headers, have}, f, on_start, on_data, on_progress);
    meter.finish();
    std::fflush(f);
    PAGODA_RETURN_IF_ERROR(restart);
    if (!r.ok()) return r.error();
    if (r->status == 416 && have > 0) {
      PAGODA_RETURN_IF_ERROR(start_over(f, hasher, have));
      continue;
    }
    if (r->status != 200 && r->status != 206) return http_file_error(t, *r);
    return ok_status();
  }
  return error(errc::io_error, "GET {}: the server refused the range twice", t.url);
}

status verify(const download_target& t, const std::string& part, std::int64_t have, const std::string& sha) {
  auto refuse = [&](const std::string& why) {
    std::error_code ec;
    fs::remove(part, ec);
    fs::remove(fs::path(part).parent_path(), ec);  // the repository's folder, when this was its only file
    return error(errc::corrupt, "{}: {}; the download was deleted, run the same command to fetch it again",
                 t.local_path, why);
  };
  if (t.size >= 0 && have != t.size)
    return refuse(fmt::format("{} bytes arrived, the repository lists {}", have, t.size));
  if (!t.sha256.empty() && sha != t.sha256)
    return refuse(fmt::format("SHA-256 {} does not match the published {}", sha, t.sha256));
  char magic[4] = {0};
  std::ifstream in(part, std::ios::binary);
  in.read(magic, 4);
  if (std::memcmp(magic, "GGUF", 4) != 0) return refuse("not a GGUF file (it does not start with \"GGUF\")");
  return ok_status();
}

}  // namespace

status download_verified(const download_target& t) {
  const std::string part = t.local_path + ".part";
  PAGODA_ASSIGN_OR_RETURN(file_ptr f, open_part(part, t.local_path));
  sha256_hasher hasher;
  std::int64_t have = hash_existing(f.get(), hasher);
  if (t.size >= 0 && have > t.size) PAGODA_RETURN_IF_ERROR(start_over(f.get(), hasher, have));
  const std::int64_t resumed_from = have;
  download_meter clock_only("", -1, have);
  if (t.size < 0 || have < t.size) {
    PAGODA_RETURN_IF_ERROR(check_space(fs::path(part).parent_path().string(), t.size - have));
    PAGODA_RETURN_IF_ERROR(fetch_rest(t, f.get(), hasher, have));
  }
  const std::string sha = hasher.hex();
  PAGODA_RETURN_IF_ERROR(verify(t, part, have, sha));
  std::error_code ec;
  fs::rename(part, t.local_path, ec);
  if (ec) return error(errc::io_error, "cannot rename {} to {}: {}", part, t.local_path, ec.message());
  std::ofstream(t.local_path + ".sha256") << sha << "  " << fs::path(t.local_path).filename().string() << "\n";
  const double secs = clock_only.seconds();
  std::fprintf(stderr, "pagoda: pulled %s (%s in %.1f s%s, sha256 %s)\n", t.local_path.c_str(),
               human_bytes(static_cast<double>(have - resumed_from)).c_str(), secs,
               secs > 0 ? fmt::format(", {}/s", human_bytes(static_cast<double>(have - resumed_from) / secs)).c_str() : "",
               t.sha256.empty() ? "not published, not checked" : "verified");
  return ok_status();
}

}  // namespace pagoda::cli
