#include "core/anon_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

namespace pagoda {
namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

// The first line of a sysfs file, or "" where it cannot be read.
std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Faults [p, p + bytes) in for writing. "" when it did, else why not.
std::string populate(std::byte* p, std::size_t bytes) {
  int rc;
  do rc = ::madvise(p, bytes, MADV_POPULATE_WRITE);
  while (rc != 0 && errno == EINTR);
  if (rc == 0) return "";
  if (errno != EINVAL) return fmt::format("faulting the memory in failed ({}); it faults in as written", std::strerror(errno));
  // A kernel before 5.14: one write a base page. (Not after ENOMEM above:
  // writing would then meet the out-of-memory killer instead of an error.)
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (std::size_t at = 0; at < bytes; at += page) *reinterpret_cast<volatile std::byte*>(p + at) = std::byte{0};
  return "";
}

}  // namespace

namespace {

// The sum of smaps field `field` ("AnonHugePages: %llu kB") over the regions
// that start in [begin, begin + bytes).
std::optional<std::size_t> smaps_kib(const void* begin, std::size_t bytes, const char* field) {
  std::FILE* f = std::fopen("/proc/self/smaps", "re");
  if (!f) return std::nullopt;
  const auto lo_wanted = reinterpret_cast<std::uintptr_t>(begin);
  // Whole lines however long (a header's path may be): a fixed buffer would
  // split one, and its tail could parse as another header.
  char* line = nullptr;
  std::size_t cap = 0;
  bool inside = false;
  std::size_t kib = 0;
  while (getline(&line, &cap, f) > 0) {
    unsigned long long lo = 0, hi = 0;
    if (std::sscanf(line, "%llx-%llx ", &lo, &hi) == 2) {
      // A region header (field lines never parse as two hex numbers); the
      // kernel may have split the mapping into several regions.
      inside = lo >= lo_wanted && lo < lo_wanted + bytes;
      continue;
    }
    unsigned long long v = 0;
    if (inside && std::sscanf(line, field, &v) == 1) kib += static_cast<std::size_t>(v);
  }
  std::free(line);
  std::fclose(f);
  return kib * 1024;
}

}  // namespace

std::optional<std::size_t> anon_huge_page_bytes(const void* begin, std::size_t bytes) {
  return smaps_kib(begin, bytes, "AnonHugePages: %llu kB");
}

std::optional<std::size_t> file_huge_page_bytes(const void* begin, std::size_t bytes) {
  return smaps_kib(begin, bytes, "FilePmdMapped: %llu kB");
}

void* map_file_huge_aligned(int fd, std::size_t bytes) {
  const std::size_t align = huge_page_bytes();
  // Reserve one huge page more than the file, map the file over the reserve
  // from its first aligned address, and give back the rest.
  void* r = ::mmap(nullptr, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  auto* base = static_cast<std::byte*>(r);
  const auto misaligned = reinterpret_cast<std::uintptr_t>(base) % align;
  const std::size_t head = misaligned ? align - misaligned : 0;
  void* m = ::mmap(base + head, bytes, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
  if (m == MAP_FAILED) {
    const int e = errno;
    ::munmap(r, bytes + align);
    errno = e;
    return nullptr;
  }
  if (head) ::munmap(base, head);
  // The tail of the reserve: from the end of the file's last page.
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t used = head + (bytes + page - 1) / page * page;
  if (used < bytes + align) ::munmap(base + used, bytes + align - used);
#ifdef MADV_HUGEPAGE
  ::madvise(m, bytes, MADV_HUGEPAGE);  // advice only: base pages work the same
#endif
  return m;
}

std::string transparent_huge_page_mode() {
  const std::string line = first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  const std::size_t open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos || close < open
             ? std::string()
             : line.substr(open + 1, close - open - 1);
}

std::size_t huge_page_bytes() {
  static const std::size_t bytes = [] {
    const std::string line = first_line("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    const unsigned long long n = std::strtoull(line.c_str(), nullptr, 10);
    return n >= 4096 && (n & (n - 1)) == 0 ? static_cast<std::size_t>(n) : std::size_t{2} << 20;
  }();
  return bytes;
}

result<anon_memory> anon_memory::map(std::size_t bytes, bool huge_pages, bool fault_in) {
  const std::size_t align = huge_pages ? huge_page_bytes() : 1;
  const std::size_t size = (bytes + align - 1) / align * align;
  // Huge pages: map one huge page more and trim to an aligned start.
  const std::size_t mapped = huge_pages ? size + align : size;
  void* m = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return error(errc::resource_exhausted, "cannot map {} bytes: {}", size, std::strerror(errno));
  auto* base = static_cast<std::byte*>(m);
  anon_memory a;
  a.data_ = base;
  a.size_ = size;
  if (!huge_pages) return a;
  const auto misaligned = reinterpret_cast<std::uintptr_t>(base) % align;
  const std::size_t head = misaligned ? align - misaligned : 0;
  if (head) ::munmap(base, head);
  if (mapped - head - size) ::munmap(base + head + size, mapped - head - size);
  a.data_ = base + head;
  huge_page_outcome& h = a.huge_;
  h.asked = true;
  const auto t0 = std::chrono::steady_clock::now();
  if (::madvise(a.data_, size, MADV_HUGEPAGE) != 0) {
    const std::string mode = transparent_huge_page_mode();
    h.problem = fmt::format("the kernel refused huge pages ({}; transparent_hugepage/enabled: {})", std::strerror(errno),
                            mode.empty() ? "missing" : mode);
  }
  if (!fault_in) return a;
  const std::optional<std::size_t> before = anon_huge_page_bytes(a.data_, size);
  const std::string failed = populate(a.data_, size);
  h.resident = failed.empty();
  if (!failed.empty()) h.problem += (h.problem.empty() ? "" : "; ") + failed;
  h.fault_in_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (const std::optional<std::size_t> after = anon_huge_page_bytes(a.data_, size); before && after)
    h.huge_bytes = *after > *before ? std::min(*after - *before, size) : 0;
  return a;
}

anon_memory::~anon_memory() { release(); }

anon_memory::anon_memory(anon_memory&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), huge_(std::move(o.huge_)) {}

anon_memory& anon_memory::operator=(anon_memory&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    huge_ = std::move(o.huge_);
  }
  return *this;
}

void anon_memory::release() {
  if (data_) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace pagoda
