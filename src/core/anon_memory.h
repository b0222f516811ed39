// Anonymous memory for a long-lived pool (the KV cache's tiles): zeroed pages
// that fault in as they are first written, or, when asked, transparent huge
// pages faulted in whole when the memory is mapped, so that a process pays
// for finding, zeroing and compacting them at start rather than in its first
// requests (docs/serving.md, --kv-huge-pages). Also the huge-page helpers a
// file mapping uses (the model's weights).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "pagoda/status.h"

namespace pagoda {

// The size of a transparent huge page (PMD): the kernel's
// /sys/kernel/mm/transparent_hugepage/hpage_pmd_size, or 2 MiB where it does
// not say.
std::size_t huge_page_bytes();

// The kernel's transparent huge page mode: the bracketed word of
// /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise",
// "never"), or "" where the file is missing (no THP).
std::string transparent_huge_page_mode();

// Bytes in transparent huge pages (AnonHugePages of /proc/self/smaps) of the
// regions that start in [begin, begin + bytes): a mapping made there, however
// the kernel split it. nullopt where smaps cannot be read.
std::optional<std::size_t> anon_huge_page_bytes(const void* begin, std::size_t bytes);
// The same for a file mapping: its bytes mapped by huge pages of the page
// cache (FilePmdMapped).
std::optional<std::size_t> file_huge_page_bytes(const void* begin, std::size_t bytes);

// Maps `bytes` (> 0) of the open file `fd` from offset 0, read-only and
// private, at an address aligned to huge_page_bytes(), and advises
// MADV_HUGEPAGE: where the page cache holds the file in huge folios (files
// read in through such a mapping, on filesystems with large folios), the
// kernel can then map them whole, one TLB entry per 2 MiB, which it cannot at
// an address whose offset within a huge page differs from the file's. Unmap
// with munmap(result, bytes). nullptr (errno set) where mmap fails.
void* map_file_huge_aligned(int fd, std::size_t bytes);

// What a huge-page mapping got.
struct huge_page_outcome {
  bool asked = false;            // mapped with huge_pages
  bool resident = false;         // faulted in whole at map time
  // Of the mapping, bytes in huge pages after the fault-in (what it added
  // to AnonHugePages in /proc/self/smaps); nullopt where that is unreadable.
  std::optional<std::size_t> huge_bytes;
  double fault_in_ms = 0;        // wall time of the advice and the fault-in
  std::string problem;           // what fell short ("" when nothing did): the advice refused,
                                 // the fault-in failed; the memory works either way
};

class anon_memory {
 public:
  anon_memory() = default;
  // At least `bytes` (> 0) of zeroed anonymous memory. Without huge_pages,
  // exactly `bytes`, page-aligned, in base pages faulted in as written. With
  // huge_pages: aligned to and rounded up to huge_page_bytes(), advised with
  // MADV_HUGEPAGE and, with fault_in, faulted in whole (MADV_POPULATE_WRITE,
  // or one write a base page where the kernel lacks it); without fault_in
  // huge pages fault in as written (for benchmarks that map more than they
  // touch). A refused advice or a failed fault-in is not an error: the
  // memory is usable in base pages or faults in lazily, and huge().problem
  // says what happened.
  // Errors: the mapping itself fails (resource_exhausted).
  static result<anon_memory> map(std::size_t bytes, bool huge_pages, bool fault_in = true);
  ~anon_memory();
  anon_memory(anon_memory&& o) noexcept;
  anon_memory& operator=(anon_memory&& o) noexcept;
  anon_memory(const anon_memory&) = delete;
  anon_memory& operator=(const anon_memory&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_; }  // as mapped (rounded up with huge pages)
  std::span<std::byte> bytes() const { return {data_, size_}; }
  const huge_page_outcome& huge() const { return huge_; }

 private:
  void release();
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  huge_page_outcome huge_;
};

}  // namespace pagoda
