#include "store/block_record.h"

#include <zstd.h>

#include <cstring>

#include "core/hash.h"

namespace pagoda {
namespace {

constexpr char k_magic[4] = {'P', 'G', 'K', 'B'};
constexpr std::uint16_t k_flag_zstd = 1;

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
result<parsed> parse(std::span<const std::byte> data, const store_key& expected) {
  // The checksum first: anything else read from damaged bytes is meaningless.
  if (data.size() < sizeof(k_magic) + 8)
    return error(errc::corrupt, "stored block {}: {} bytes, too short", expected.hex(), data.size());
  std::uint64_t sum = 0;
  std::memcpy(&sum, data.data() + data.size() - 8, 8);
  if (hash_bytes(data.data(), data.size() - 8) != sum)
    return error(errc::corrupt, "stored block {}: checksum mismatch", expected.hex());
  reader in(data.first(data.size() - 8));
  char magic[4];
  parsed p;
  std::uint16_t version = 0;
  std::uint32_t n_tenant = 0, n_tokens = 0, stored = 0;
  std::span<const std::byte> tenant, tokens;
  if (!in.get(magic) || std::memcmp(magic, k_magic, 4) != 0)
    return error(errc::corrupt, "stored block {}: not a block record", expected.hex());
  if (!in.get(version)) return error(errc::corrupt, "stored block {}: truncated", expected.hex());
  if (version != k_block_record_version)
    return error(errc::unsupported, "stored block {}: format version {}, this build reads {}", expected.hex(), version,
                 k_block_record_version);
  std::uint64_t entry = 0;
  if (!in.get(p.flags) || !in.get(entry) || !in.get(p.r.chain) || !in.get(p.r.parent) || !in.get(n_tenant) ||
      !in.get_span(n_tenant, tenant) || !in.get(n_tokens) ||
      !in.get_span(static_cast<std::size_t>(n_tokens) * sizeof(token_id), tokens) || !in.get(p.raw_size) ||
      !in.get(stored) || !in.get_span(stored, p.payload) || in.at() != data.size() - 8)
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

std::vector<std::byte> encode_block_record(const block_record& r, bool compress) {
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
  out.reserve(64 + r.tenant.size() + r.tokens.size() * sizeof(token_id) + payload.size());
  writer w(out);
  w.put_bytes(k_magic, 4);
  w.put(k_block_record_version);
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
  w.put(hash_bytes(out.data(), out.size()));
  return out;
}

result<block_record> decode_block_record(std::span<const std::byte> data, const store_key& expected) {
  PAGODA_ASSIGN_OR_RETURN(parsed p, parse(data, expected));
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

status check_block_record(std::span<const std::byte> data, const store_key& expected) {
  auto r = decode_block_record(data, expected);
  if (!r.ok()) return r.error();
  return {};
}

}  // namespace pagoda
