// A structural check of an LMDB data file (data.mdb) that never maps it.
//
// Why: LMDB trusts its file. A damaged B-tree page makes it follow garbage
// offsets (a segfault), a damaged free list makes its first write abort, and
// a truncated file turns the first read of a page past the end into a bus
// error, since the file is memory-mapped. So before LMDB opens a store, this
// walks the file with pread into its own buffers, and every field is checked
// against the file and the page before it is used: both meta pages (magic,
// version, page size), every page of the free list and of every database
// (page numbers in range and inside the file, page type and number, node
// offsets and sizes inside the page, overflow runs inside the file, each page
// reached once), the databases' page and entry counts, and LMDB's own
// invariant that every page below the last is used once or free once.
//
// The layout read here is LMDB 0.9's on-disk format on a 64-bit host (a
// 16-byte page header, 8-byte nodes, MDB_DEVEL off), which liblmdb0 writes.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda {

struct lmdb_check_report {
  bool exists = false;              // the file is there and not empty (empty: LMDB starts a new store)
  std::int64_t file_bytes = 0;
  std::int64_t page_bytes = 0;
  std::int64_t pages_checked = 0;   // pages read and checked (overflow runs count once)
  std::int64_t entries = 0;         // key/value pairs reached in the named databases
  std::int64_t damage = 0;          // problems found; 0: LMDB may open and use the file
  std::vector<std::string> problems;  // the first few, each naming a page or a structure
  bool ok() const { return damage == 0; }
  std::string summary() const;      // "N problems: first; second; ..."
};

// Called for each entry of a named database reachable without damage on the
// way: the database's name, the key and the value (read from the file).
using lmdb_entry_fn =
    std::function<void(std::string_view db, std::span<const std::byte> key, std::span<const std::byte> value)>;

// Checks the LMDB data file at `file`. Damage is reported, not returned as an
// error: an error means the file could not be read at all (permissions, I/O).
// A missing file reports exists = false. Memory: a bit per page of the file.
result<lmdb_check_report> check_lmdb_file(const std::string& file, const lmdb_entry_fn& on_entry = {});

}  // namespace pagoda
