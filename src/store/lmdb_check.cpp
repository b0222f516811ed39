#include "store/lmdb_check.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace pagoda {
namespace {

// LMDB 0.9's on-disk constants (mdb.c).
constexpr std::uint32_t k_magic = 0xBEEFC0DE;
constexpr std::uint32_t k_data_version = 1;
constexpr std::uint64_t k_page_header = 16;  // pgno u64, pad u16, flags u16, lower u16, upper u16 (or pages u32)
constexpr std::uint64_t k_node_header = 8;   // lo u16, hi u16, flags u16, key size u16
constexpr std::uint64_t k_db_bytes = 48;     // MDB_db
constexpr std::uint64_t k_meta_end = 152;    // page header + MDB_meta
constexpr std::uint64_t k_n_metas = 2;
constexpr std::uint64_t k_invalid_page = ~std::uint64_t{0};
constexpr std::uint16_t k_branch = 0x01, k_leaf = 0x02, k_overflow = 0x04, k_meta = 0x08;
constexpr std::uint16_t k_node_big = 0x01, k_node_sub = 0x02, k_node_dup = 0x04;
constexpr std::uint16_t k_db_fixedmap = 0x01;
constexpr std::uint16_t k_db_dup_flags = 0x04 | 0x10 | 0x20 | 0x40;  // DUPSORT, DUPFIXED, INTEGERDUP, REVERSEDUP
constexpr unsigned k_max_depth = 32;                                 // LMDB's cursor stack
constexpr unsigned k_max_key = 511;
constexpr std::size_t k_max_problems = 8;
// LMDB may leave the last pages it allocated unwritten (freed in the same
// transaction), so the file may end before the last page; this much, no more.
constexpr std::uint64_t k_unwritten_slack_pages = 16384;

template <typename T>
T load(std::span<const std::byte> b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}

struct db_record {
  std::uint32_t pad = 0;
  std::uint16_t flags = 0;
  std::uint16_t depth = 0;
  std::uint64_t branch = 0, leaf = 0, overflow = 0, entries = 0, root = 0;
};

db_record parse_db(std::span<const std::byte> b) {
  db_record d;
  d.pad = load<std::uint32_t>(b, 0);
  d.flags = load<std::uint16_t>(b, 4);
  d.depth = load<std::uint16_t>(b, 6);
  d.branch = load<std::uint64_t>(b, 8);
  d.leaf = load<std::uint64_t>(b, 16);
  d.overflow = load<std::uint64_t>(b, 24);
  d.entries = load<std::uint64_t>(b, 32);
  d.root = load<std::uint64_t>(b, 40);
  return d;
}

struct meta_page {
  std::uint64_t page_bytes = 0;
  db_record free_db, main_db;
  std::uint64_t last_page = 0;
  std::uint64_t txn = 0;
};

enum class db_kind { free_list, main, named };

struct page_counts {
  std::uint64_t branch = 0, leaf = 0, overflow = 0, entries = 0;
};

class checker {
 public:
  checker(int fd, lmdb_check_report& rep, const lmdb_entry_fn& on_entry) : fd_(fd), rep_(rep), on_entry_(on_entry) {}

  void run() {
    meta_page metas[k_n_metas];
    if (!read_meta(0, 0, metas[0])) return;
    psize_ = metas[0].page_bytes;
    if (!read_meta(1, psize_, metas[1])) return;
    if (metas[1].page_bytes != psize_)
      return damage("meta pages disagree on the page size ({} and {})", psize_, metas[1].page_bytes);
    // LMDB reads the snapshot of the newer meta page (meta 0 on a tie).
    const meta_page& m = metas[1].txn > metas[0].txn ? metas[1] : metas[0];
    rep_.page_bytes = static_cast<std::int64_t>(psize_);
    file_pages_ = static_cast<std::uint64_t>(rep_.file_bytes) / psize_;
    if (m.last_page < k_n_metas - 1 || m.last_page >= file_pages_ + k_unwritten_slack_pages)
      return damage("last page {} does not fit a file of {} pages (truncated or damaged meta page)", m.last_page,
                    file_pages_);
    last_page_ = m.last_page;
    if (m.free_db.flags & k_db_fixedmap) return damage("meta page asks for a fixed address map");
    used_.assign(file_pages_, false);
    free_.assign(last_page_ + 1, false);
    n_used_ = k_n_metas;
    walk_db(m.free_db, "free list", db_kind::free_list);
    walk_db(m.main_db, "main", db_kind::main);
    for (std::uint64_t p = 0; p < file_pages_ && p <= last_page_; ++p)
      if (used_[p] && free_[p]) damage("page {} is both in use and in the free list", p);
    if (rep_.damage == 0 && n_used_ + n_free_ != last_page_ + 1)
      damage("{} pages in use and {} free, not the {} below the last page: lost or shared pages", n_used_, n_free_,
             last_page_ + 1);
  }

 private:
  template <typename... A>
  void damage(fmt::format_string<A...> f, A&&... args) {
    ++rep_.damage;
    if (rep_.problems.size() < k_max_problems) rep_.problems.push_back(fmt::format(f, std::forward<A>(args)...));
  }

  bool read_at(std::uint64_t offset, std::span<std::byte> out) {
    if (offset > static_cast<std::uint64_t>(rep_.file_bytes) ||
        out.size() > static_cast<std::uint64_t>(rep_.file_bytes) - offset)
      return false;
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<std::size_t>(n);
    }
    return true;
  }

  bool read_meta(std::uint64_t index, std::uint64_t offset, meta_page& m) {
    std::byte b[k_meta_end];
    if (!read_at(offset, b)) {
      damage("meta page {}: the file ends before it ({} bytes)", index, rep_.file_bytes);
      return false;
    }
    const std::span<const std::byte> s(b);
    const auto flags = load<std::uint16_t>(s, 10);
    const auto magic = load<std::uint32_t>(s, 16);
    const auto version = load<std::uint32_t>(s, 20);
    if (!(flags & k_meta) || magic != k_magic) {
      damage("meta page {}: not an LMDB meta page", index);
      return false;
    }
    if (version != k_data_version) {
      damage("meta page {}: LMDB data version {}, this build reads {}", index, version, k_data_version);
      return false;
    }
    m.free_db = parse_db(s.subspan(40, k_db_bytes));
    m.main_db = parse_db(s.subspan(88, k_db_bytes));
    m.page_bytes = m.free_db.pad;
    m.last_page = load<std::uint64_t>(s, 136);
    m.txn = load<std::uint64_t>(s, 144);
    if (m.page_bytes < 512 || m.page_bytes > 32768 || (m.page_bytes & (m.page_bytes - 1)) != 0) {
      damage("meta page {}: page size {} is not one LMDB uses", index, m.page_bytes);
      return false;
    }
    if (static_cast<std::uint64_t>(rep_.file_bytes) < k_n_metas * m.page_bytes) {
      damage("the file's {} bytes do not hold its two meta pages", rep_.file_bytes);
      return false;
    }
    return true;
  }

  // Takes pages [first, first + n) for one use; false (damage) when one is
  // out of range, past the end of the file, or already taken.
  bool claim(std::uint64_t first, std::uint64_t n, std::string_view db) {
    if (first < k_n_metas || first > last_page_ || n == 0 || n > last_page_ + 1 - first) {
      damage("{}: page {} (+{}) is out of range (last page {})", db, first, n, last_page_);
      return false;
    }
    if (first + n > file_pages_) {
      damage("{}: page {} (+{}) is past the end of the file ({} pages): truncated", db, first, n, file_pages_);
      return false;
    }
    for (std::uint64_t p = first; p < first + n; ++p) {
      if (used_[p]) {
        damage("{}: page {} is reached twice", db, p);
        return false;
      }
    }
    for (std::uint64_t p = first; p < first + n; ++p) used_[p] = true;
    n_used_ += n;
    return true;
  }

  void walk_db(const db_record& db, std::string_view name, db_kind kind) {
    if (kind == db_kind::named && (db.flags & k_db_dup_flags))
      return damage("database {}: flags {:#x} this store never sets", name, db.flags);
    if (db.depth == 0) {
      if (db.root != k_invalid_page || db.entries != 0 || db.branch + db.leaf + db.overflow != 0)
        damage("database {}: empty, yet it names a root page or counts", name);
      return;
    }
    if (db.depth > k_max_depth) return damage("database {}: depth {} is beyond LMDB's {}", name, db.depth, k_max_depth);
    page_counts c;
    const std::int64_t before = rep_.damage;
    walk_page(db.root, 1, db.depth, name, kind, c);
    if (rep_.damage != before) return;  // the counts cannot match a damaged walk; say so once
    if (c.branch != db.branch || c.leaf != db.leaf || c.overflow != db.overflow || c.entries != db.entries)
      damage("database {}: counts {} branch, {} leaf, {} overflow pages and {} entries; found {}, {}, {} and {}", name,
             db.branch, db.leaf, db.overflow, db.entries, c.branch, c.leaf, c.overflow, c.entries);
  }

  void walk_page(std::uint64_t pgno, unsigned level, unsigned depth, std::string_view db, db_kind kind, page_counts& c) {
    if (!claim(pgno, 1, db)) return;
    std::vector<std::byte> buf(psize_);
    if (!read_at(pgno * psize_, buf)) return damage("{}: page {} cannot be read", db, pgno);
    ++rep_.pages_checked;
    const std::span<const std::byte> p(buf);
    const bool branch = level < depth;
    const auto stored_pgno = load<std::uint64_t>(p, 0);
    const auto flags = load<std::uint16_t>(p, 10);
    const auto lower = load<std::uint16_t>(p, 12);
    const auto upper = load<std::uint16_t>(p, 14);
    if (stored_pgno != pgno) return damage("{}: page {} says it is page {}", db, pgno, stored_pgno);
    if ((flags & 0xff) != (branch ? k_branch : k_leaf))
      return damage("{}: page {} has flags {:#x}, expected a {} page", db, pgno, flags, branch ? "branch" : "leaf");
    if (lower < k_page_header || upper < lower || upper > psize_ || (lower - k_page_header) % 2 != 0)
      return damage("{}: page {} has free-space bounds {}..{} outside the page", db, pgno, lower, upper);
    const unsigned n = (lower - k_page_header) / 2;
    if (branch && n == 0) return damage("{}: branch page {} has no children", db, pgno);
    ++(branch ? c.branch : c.leaf);
    for (unsigned i = 0; i < n; ++i) {
      const std::uint64_t off = load<std::uint16_t>(p, k_page_header + 2 * i);
      if (off < upper || off % 2 != 0 || off + k_node_header > psize_) {
        damage("{}: page {} node {} at offset {} is outside the page's nodes", db, pgno, i, off);
        continue;
      }
      const auto lo = load<std::uint16_t>(p, off), hi = load<std::uint16_t>(p, off + 2);
      const auto nflags = load<std::uint16_t>(p, off + 4), ksize = load<std::uint16_t>(p, off + 6);
      const std::uint64_t key_at = off + k_node_header;
      if (ksize > k_max_key || key_at + ksize > psize_) {
        damage("{}: page {} node {} has a {}-byte key past the page", db, pgno, i, ksize);
        continue;
      }
      const std::span<const std::byte> key = p.subspan(key_at, ksize);
      if (branch) {
        const std::uint64_t child = lo | (std::uint64_t{hi} << 16) | (std::uint64_t{nflags} << 32);
        walk_page(child, level + 1, depth, db, kind, c);
      } else {
        ++c.entries;
        visit_leaf_node(p, pgno, i, key, lo | (std::uint64_t{hi} << 16), nflags, key_at + ksize, db, kind, c);
      }
    }
  }

  void visit_leaf_node(std::span<const std::byte> p, std::uint64_t pgno, unsigned i, std::span<const std::byte> key,
                       std::uint64_t dsize, std::uint16_t nflags, std::uint64_t data_at, std::string_view db,
                       db_kind kind, page_counts& c) {
    if ((nflags & ~(k_node_big | k_node_sub)) != 0 || (nflags & k_node_big && nflags & k_node_sub))
      return damage("{}: page {} node {} has flags {:#x} this store never writes", db, pgno, i, nflags);
    std::vector<std::byte> big;
    std::span<const std::byte> value;
    if (nflags & k_node_big) {
      if (data_at + 8 > psize_) return damage("{}: page {} node {}: overflow page number past the page", db, pgno, i);
      if (!read_overflow(load<std::uint64_t>(p, data_at), dsize, db, c, big)) return;
      value = big;
    } else {
      if (data_at + dsize > psize_) return damage("{}: page {} node {}: a {}-byte value past the page", db, pgno, i, dsize);
      value = p.subspan(data_at, dsize);
    }
    if (nflags & k_node_sub) {
      if (kind != db_kind::main || value.size() != k_db_bytes)
        return damage("{}: page {} node {}: a sub-database where none can be", db, pgno, i);
      const std::string name(reinterpret_cast<const char*>(key.data()), key.size());
      return walk_db(parse_db(value), name, db_kind::named);
    }
    if (kind == db_kind::free_list) return take_free_pages(key, value, db);
    ++rep_.entries;
    if (kind == db_kind::named && on_entry_) on_entry_(db, key, value);
  }

  // An overflow run holding a big value: its first page's header, the run's
  // pages claimed, the value read when someone needs it.
  bool read_overflow(std::uint64_t first, std::uint64_t dsize, std::string_view db, page_counts& c,
                     std::vector<std::byte>& value) {
    if (first < k_n_metas || first >= file_pages_ || first > last_page_) {
      damage("{}: overflow page {} is out of range or past the end of the file", db, first);
      return false;
    }
    std::byte h[k_page_header];
    if (!read_at(first * psize_, h)) {
      damage("{}: overflow page {} cannot be read", db, first);
      return false;
    }
    const std::span<const std::byte> s(h);
    const auto stored_pgno = load<std::uint64_t>(s, 0);
    const auto flags = load<std::uint16_t>(s, 10);
    const std::uint64_t n = load<std::uint32_t>(s, 12);
    if (stored_pgno != first || (flags & 0xff) != k_overflow) {
      damage("{}: page {} is not the overflow page its node names", db, first);
      return false;
    }
    if (n == 0 || n * psize_ - k_page_header < dsize) {
      damage("{}: overflow page {}: {} pages cannot hold {} bytes", db, first, n, dsize);
      return false;
    }
    if (!claim(first, n, db)) return false;
    ++rep_.pages_checked;
    c.overflow += n;
    value.resize(dsize);
    if (!read_at(first * psize_ + k_page_header, value)) {
      damage("{}: overflow page {} cannot be read", db, first);
      return false;
    }
    return true;
  }

  // A free-list record: u64 count, then that many page numbers.
  void take_free_pages(std::span<const std::byte> key, std::span<const std::byte> value, std::string_view db) {
    if (key.size() != 8 || value.size() < 8 || value.size() % 8 != 0)
      return damage("{}: a record of {}-byte key and {}-byte value is not a page list", db, key.size(), value.size());
    const auto count = load<std::uint64_t>(value, 0);
    if (count != value.size() / 8 - 1) return damage("{}: a page list says {} pages in {} bytes", db, count, value.size());
    for (std::uint64_t i = 1; i <= count; ++i) {
      const auto pg = load<std::uint64_t>(value, i * 8);
      if (pg < k_n_metas || pg > last_page_) {
        damage("{}: free page {} is out of range (last page {})", db, pg, last_page_);
        continue;
      }
      if (free_[pg]) {
        damage("{}: page {} is free twice", db, pg);
        continue;
      }
      free_[pg] = true;
      ++n_free_;
    }
  }

  int fd_;
  lmdb_check_report& rep_;
  const lmdb_entry_fn& on_entry_;
  std::uint64_t psize_ = 0, file_pages_ = 0, last_page_ = 0;
  std::vector<bool> used_, free_;
  std::uint64_t n_used_ = 0, n_free_ = 0;
};

}  // namespace

std::string lmdb_check_report::summary() const {
  std::string s = fmt::format("{} problem{}", damage, damage == 1 ? "" : "s");
  for (std::size_t i = 0; i < problems.size(); ++i) s += (i ? "; " : ": ") + problems[i];
  if (static_cast<std::int64_t>(problems.size()) < damage) s += "; ...";
  return s;
}

result<lmdb_check_report> check_lmdb_file(const std::string& file, const lmdb_entry_fn& on_entry) {
  lmdb_check_report rep;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return rep;
    return error(errc::io_error, "{}: cannot open: {}", file, std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return error(errc::io_error, "{}: cannot stat: {}", file, std::strerror(e));
  }
  rep.file_bytes = st.st_size;
  rep.exists = st.st_size > 0;
  if (rep.exists) checker(fd, rep, on_entry).run();
  ::close(fd);
  return rep;
}

}  // namespace pagoda
