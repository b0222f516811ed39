#include "store/block_record.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <cstring>

#include "core/assert.h"
#include "core/hash.h"

namespace pagoda {
namespace {

constexpr char k_magic[4] = {'P', 'G', 'K', 'B'};
constexpr std::uint16_t k_flag_zstd = 1;
constexpr std::size_t k_mac_bytes = std::tuple_size_v<record_secret::mac_bytes>;

class writer {
 public:
  explicit writer(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void put(T v) {
    put_bytes(&v, sizeof(T));
  }
  void put_bytes(const void* p, std::size_t n) {
    if (n == 0) return;
    const std::size_t at = out_.size();
    out_.resize(at + n);
    std::memcpy(out_.data() + at, p, n);
  }

 private:
  std::vector<std::byte>& out_;
};

class reader {
 public:
  explicit reader(std::span<const std::byte> in) : in_(in) {}
  template <typename T>
  bool get(T& v) {
    if (in_.size() - at_ < sizeof(T)) return false;
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool get_span(std::size_t n, std::span<const std::byte>& out) {
    if (in_.size() - at_ < n) return false;
    out = in_.subspan(at_, n);
    at_ += n;
    return true;
  }
  std::size_t at() const { return at_; }

 private:
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
};

struct parsed {
  block_record r;
  std::uint16_t flags = 0;
  std::uint32_t raw_size = 0;
  std::span<const std::byte> payload;
};

// Parses and checks everything but the payload's decompression.
// The MAC check (the top of block_record.h): before any field is believed.
// body: the record's bytes before its MAC (version 2) or checksum (version 1).
status authenticate(std::span<const std::byte> data, std::span<const std::byte> body, std::uint16_t version,
                    const store_key& expected, const record_secret* secret) {
  if (version != k_block_record_mac_version) {
    if (!secret) return {};
    return error(errc::unauthenticated, "stored block {}: has no MAC (written without a secret, or forged)",
                 expected.hex());
  }
  if (!secret)
    return error(errc::unauthenticated, "stored block {}: carries a MAC and no secret was given to check it",
                 expected.hex());
  const record_secret::mac_bytes mac = secret->mac(expected, body);
  if (CRYPTO_memcmp(mac.data(), data.data() + body.size(), k_mac_bytes) != 0)
    return error(errc::unauthenticated, "stored block {}: fails its MAC (forged, or written under another secret)",
                 expected.hex());
  return {};
}

result<parsed> parse(std::span<const std::byte> data, const store_key& expected, const record_secret* secret) {
  // The checksum first: anything else read from damaged bytes is meaningless.
  if (data.size() < sizeof(k_magic) + sizeof(std::uint16_t) + 8)
    return error(errc::corrupt, "stored block {}: {} bytes, too short", expected.hex(), data.size());
  std::uint64_t sum = 0;
  std::memcpy(&sum, data.data() + data.size() - 8, 8);
  if (hash_bytes(data.data(), data.size() - 8) != sum)
    return error(errc::corrupt, "stored block {}: checksum mismatch", expected.hex());
  if (std::memcmp(data.data(), k_magic, 4) != 0)
    return error(errc::corrupt, "stored block {}: not a block record", expected.hex());
  std::uint16_t version = 0;
  std::memcpy(&version, data.data() + 4, sizeof version);
  if (version != k_block_record_version && version != k_block_record_mac_version)
    return error(errc::unsupported, "stored block {}: format version {}, this build reads {} and {}", expected.hex(),
                 version, k_block_record_version, k_block_record_mac_version);
  std::size_t body_end = data.size() - 8;
  if (version == k_block_record_mac_version) {
    if (body_end < 6 + k_mac_bytes) return error(errc::corrupt, "stored block {}: truncated", expected.hex());
    body_end -= k_mac_bytes;
  }
  PAGODA_RETURN_IF_ERROR(authenticate(data, data.first(body_end), version, expected, secret));
  reader in(data.first(body_end).subspan(6));
  parsed p;
  std::uint32_t n_tenant = 0, n_tokens = 0, stored = 0;
  std::span<const std::byte> tenant, tokens;
  std::uint64_t entry = 0;
  if (!in.get(p.flags) || !in.get(entry) || !in.get(p.r.chain) || !in.get(p.r.parent) || !in.get(n_tenant) ||
      !in.get_span(n_tenant, tenant) || !in.get(n_tokens) ||
      !in.get_span(static_cast<std::size_t>(n_tokens) * sizeof(token_id), tokens) || !in.get(p.raw_size) ||
      !in.get(stored) || !in.get_span(stored, p.payload) || in.at() + 6 != body_end)
    return error(errc::corrupt, "stored block {}: fields do not add up to its size", expected.hex());
  if (entry != expected.entry) return error(errc::not_found, "stored block {}: holds another entry", expected.hex());
  p.r.key = expected;
  p.r.tenant.assign(reinterpret_cast<const char*>(tenant.data()), tenant.size());
  if (tenant_hash(p.r.tenant) != expected.tenant)
    return error(errc::not_found, "stored block {}: belongs to another tenant", expected.hex());
  p.r.tokens.resize(n_tokens);
  std::memcpy(p.r.tokens.data(), tokens.data(), tokens.size());
  if (!(p.flags & k_flag_zstd) && stored != p.raw_size)
    return error(errc::corrupt, "stored block {}: {} stored bytes for {}", expected.hex(), stored, p.raw_size);
  if (p.raw_size > k_block_record_max_bytes)
    return error(errc::corrupt, "stored block {}: {} bytes, over the {} a block may hold", expected.hex(), p.raw_size,
                 k_block_record_max_bytes);
  if ((p.flags & k_flag_zstd) && ZSTD_getFrameContentSize(p.payload.data(), p.payload.size()) != p.raw_size)
    return error(errc::corrupt, "stored block {}: the payload's frame does not declare {} bytes", expected.hex(),
                 p.raw_size);
  return p;
}

}  // namespace

record_secret::record_secret(std::string key) : key_(std::move(key)) {
  PAGODA_ASSERT(key_.size() >= k_min_bytes && key_.size() <= k_max_bytes, "a record secret of {} bytes", key_.size());
}

result<record_secret> record_secret::from_file(const std::string& path) {
  // Opened without following a FIFO's wait or a device's endless bytes: the
  // checks run on what was opened, not on the path again.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return error(errc::invalid_argument, "secret file {}: {}", path, std::strerror(errno));
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_fd{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return error(errc::invalid_argument, "secret file {}: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return error(errc::invalid_argument, "secret file {}: not a regular file", path);
  if (st.st_mode & (S_IRWXG | S_IRWXO))
    return error(errc::invalid_argument,
                 "secret file {}: mode {:04o} lets its group or others at it; make it 0600 (chmod 600 {})", path,
                 st.st_mode & 07777, path);
  std::string key(k_max_bytes + 1, '\0');
  std::size_t n = 0;
  while (n < key.size()) {
    const ssize_t got = ::read(fd, key.data() + n, key.size() - n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return error(errc::invalid_argument, "secret file {}: {}", path, std::strerror(errno));
    if (got == 0) break;
    n += static_cast<std::size_t>(got);
  }
  key.resize(n);
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
  if (key.size() > k_max_bytes)
    return error(errc::invalid_argument, "secret file {}: over {} bytes, not a secret", path, k_max_bytes);
  if (key.size() < k_min_bytes)
    return error(errc::invalid_argument, "secret file {}: {} bytes, at least {} needed (e.g. openssl rand -hex 32 > {})",
                 path, key.size(), k_min_bytes, path);
  return record_secret(std::move(key));
}

record_secret::mac_bytes record_secret::mac(const store_key& key, std::span<const std::byte> data) const {
  // HMAC-SHA256 through OpenSSL 3's EVP_MAC (the HMAC_* calls are deprecated);
  // the algorithm is fetched once. A failure here is a broken libcrypto.
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  PAGODA_ASSERT(hmac != nullptr, "libcrypto has no HMAC");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(hmac);
  PAGODA_ASSERT(ctx != nullptr, "EVP_MAC_CTX_new failed");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_construct_end()};
  const auto kb = key.bytes();
  mac_bytes out{};
  std::size_t n = 0;
  const bool ok = EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key_.data()), key_.size(), params) == 1 &&
                  EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(kb.data()), kb.size()) == 1 &&
                  EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(data.data()), data.size()) == 1 &&
                  EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &n, out.size()) == 1;
  EVP_MAC_CTX_free(ctx);
  PAGODA_ASSERT(ok && n == out.size(), "HMAC-SHA256 failed");
  return out;
}

std::vector<std::byte> encode_block_record(const block_record& r, bool compress, const record_secret* secret) {
  std::vector<std::byte> packed;
  std::uint16_t flags = 0;
  if (compress && !r.bytes.empty()) {
    packed.resize(ZSTD_compressBound(r.bytes.size()));
    const std::size_t n = ZSTD_compress(packed.data(), packed.size(), r.bytes.data(), r.bytes.size(), 1);
    if (!ZSTD_isError(n) && n + n / 16 < r.bytes.size()) {
      packed.resize(n);
      flags |= k_flag_zstd;
    } else {
      packed.clear();
    }
  }
  const std::span<const std::byte> payload = flags & k_flag_zstd ? std::span<const std::byte>(packed) : r.bytes;
  std::vector<std::byte> out;
  out.reserve(96 + r.tenant.size() + r.tokens.size() * sizeof(token_id) + payload.size());
  writer w(out);
  w.put_bytes(k_magic, 4);
  w.put(secret ? k_block_record_mac_version : k_block_record_version);
  w.put(flags);
  w.put(r.key.entry);
  w.put(r.chain);
  w.put(r.parent);
  w.put(static_cast<std::uint32_t>(r.tenant.size()));
  w.put_bytes(r.tenant.data(), r.tenant.size());
  w.put(static_cast<std::uint32_t>(r.tokens.size()));
  w.put_bytes(r.tokens.data(), r.tokens.size() * sizeof(token_id));
  w.put(static_cast<std::uint32_t>(r.bytes.size()));
  w.put(static_cast<std::uint32_t>(payload.size()));
  w.put_bytes(payload.data(), payload.size());
  if (secret) {
    const record_secret::mac_bytes mac = secret->mac(r.key, out);
    w.put_bytes(mac.data(), mac.size());
  }
  w.put(hash_bytes(out.data(), out.size()));
  return out;
}

result<block_record> decode_block_record(std::span<const std::byte> data, const store_key& expected,
                                         const record_secret* secret) {
  PAGODA_ASSIGN_OR_RETURN(parsed p, parse(data, expected, secret));
  if (p.flags & k_flag_zstd) {
    p.r.bytes.resize(p.raw_size);
    const std::size_t n = ZSTD_decompress(p.r.bytes.data(), p.r.bytes.size(), p.payload.data(), p.payload.size());
    if (ZSTD_isError(n) || n != p.raw_size)
      return error(errc::corrupt, "stored block {}: the payload does not decompress to {} bytes", expected.hex(),
                   p.raw_size);
  } else {
    p.r.bytes.assign(p.payload.begin(), p.payload.end());
  }
  return std::move(p.r);
}

status check_block_record(std::span<const std::byte> data, const store_key& expected, const record_secret* secret) {
  auto r = decode_block_record(data, expected, secret);
  if (!r.ok()) return r.error();
  return {};
}

}  // namespace pagoda
