// The KV manager: sequences -> block tables over one block pool, with prefix
// caching, copy-on-write forks, tenants with block quotas, KV block classes,
// and metrics. It holds
// no tensors: the caller (the engine) writes K/V into kv_storage at the slots the
// tables name and performs the copies allocate() reports. One engine thread owns
// it: no locks.
//
// A step of one sequence, as the scheduler drives it:
//   add_sequence(seq, prompt)        -> n tokens served from the prefix cache
//   allocate(seq, n)                 -> slots for n more tokens, or std::nullopt (preempt someone)
//   ... perform the block ops (copies, ...), then write K/V of n tokens ...
//   commit(seq, those n token ids, their positions)
//                                    -> full blocks enter the prefix index
//   free_sequence(seq) / preempt_sequence(seq)
// Commit comes after the K/V are written, never before: a block is shareable
// through the prefix index only once its K/V exist.
//
// Slots and positions. A sequence's KV slots are numbered 0..n_stored-1 in
// table order (slot i lives in table[i / block_size] at i % block_size). Each
// stored slot keeps the position its token was computed at (its RoPE
// position), which is not its slot number once blocks were dropped from the
// middle (drop()). Positions strictly increase along the slots.
//
// Block ops. What the tensors must do follows from bookkeeping here (a
// copy-on-write, a block reopened by truncate(), a partly filled block freed,
// a cached block evicted, a block entering the cache); each is reported, in
// the order it happened, to the op listener (set_op_listener), which the owner
// of the tensors applies before its next writes. Evictions all go through one
// place and are reported with the block's key, parent key and tokens while its
// bytes are still intact.
//
// Invariants (check_invariants() verifies all of them):
// - Block tables are append-only, with one exception: copy-on-write replaces the
//   table entry that holds the next write position (a partly filled block shared
//   with another sequence) by a private copy, in allocate(), before anything is
//   written into it. The other holders keep the original, unchanged.
// - A block's ref count equals the number of tables that hold it; a table holds a
//   block at most once.
// - Writes only go into blocks with ref 1 that are not in the prefix index.
// - Every block held by a sequence belongs to that sequence's tenant; blocks are
//   never shared across tenants (the tenant enters the first block's key).
// - Quotas: a tenant's used blocks never grow past its quota through allocate().
// - Classes: a sequence without class runs holds only class-0 blocks; a block
//   under a prefix key in a table is of the class its sequence's runs give its
//   index, and that class is part of its key.
//
// KV classes (per-segment KV type). The pool's blocks are split into classes
// (block_pool.h): class 0 holds the default KV type, classes 1..C-1 other
// formats. A prompt may ask for a class over positions [begin, end) of itself
// (sequence_options::classes, kv_class_run). The class of a block is fixed
// when it is taken and never changes; a table may mix classes:
// - A new block appended to a table is of class c when EVERY slot of it holds
//   a position inside runs of class c (adjacent runs of the same class count as
//   one); otherwise, straddling a run's edge or outside every run, it is of
//   class 0 (default precision). Its slots are not stored yet: their positions
//   are taken to continue consecutively from the last stored position (slot i
//   at position i when nothing is stored). Runs end inside the prompt, so the
//   blocks of generated tokens are of class 0.
// - A copy-on-write copy, and a block compact() puts in place of a shared or
//   cached one, is of the class of the block it replaces.
// - Blocks of class c come only from class c's free queue, and evictions to
//   supply them take only class c's cached blocks. When class c has no
//   takeable block, allocate() fails with alloc_blocker::pool even if other
//   classes have room. Quotas count the blocks of every class together.
// - Prefix keys: a block of class c != 0 carries the class among its extra
//   keys, so its key differs from that of a class-0 block of the same tokens,
//   and through the chain so does every key after it. A prompt asking for
//   int4 never reuses f16 blocks of the same tokens, and vice versa; two
//   prompts with the same runs share. A hit is also checked to be of the class
//   the rule gives its index.
// - Window slots (enable_window_slots) need a pool of one class.
//
// Tenants and quotas. A tenant's footprint is its used blocks plus its cached
// (ref-0, still indexed) blocks, and a quota bounds the footprint: a tenant at its
// quota that allocates evicts its OWN least recently used cached blocks first and
// never anyone else's: its cached blocks of the class it needs are taken
// first, and if its footprint is still above the quota, its least recently
// used cached blocks of other classes are evicted. A tenant below its quota
// takes from the class's free queue: free blocks first, then the least
// recently used cached block of that class, whoever owns it. So no tenant can
// hold more than its quota of the pool, in use or in cache, and with one class
// a tenant at its quota cannot push out other tenants' cache. With several
// classes it can, once: a tenant at its quota whose own cache holds no block
// of the class it needs takes that block like a tenant below its quota (which
// may evict another tenant's cached block of that class) and pays for it by
// evicting its own cached block of another class.
// allocate() fails (std::nullopt) when used + new blocks would exceed the quota.
// Cache hits move a block from cached to used within the same tenant and never
// change a footprint. Lowering a quota drops the tenant's cached blocks beyond it,
// and a tenant still above its quota (its used blocks alone exceed it) keeps no
// cache: blocks its sequences release are dropped until it is back under.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <memory>

#include "kv/block_pool.h"
#include "kv/kv_gather.h"
#include "kv/kv_metrics.h"
#include "kv/prefix_index.h"
#include "kv/window_slots.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Positions [begin, end) of a prompt whose KV should be of block class cls
// (see "KV classes"). Runs of one prompt are sorted and do not overlap;
// 0 <= begin < end <= the prompt's length; cls < n_classes().
struct kv_class_run {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  std::uint8_t cls = 0;
};

struct sequence_options {
  std::string_view tenant;      // "" is the default tenant, which shares the global cache
  std::string_view cache_salt;  // vLLM's cache_salt; "" for none
  bool lookup = true;           // take cached blocks of the prompt (false: compute it all, e.g. to score it)
  std::span<const kv_class_run> classes;  // none: every block of class 0. add_sequence copies them.
};

// Copy the first n_tokens token slots of src into dst, every layer, K and V.
struct block_copy {
  block_id src;
  block_id dst;
  std::int32_t n_tokens = 0;
};

// A block operation the tensors must perform (see "Block ops" above).
enum class kv_op_kind : std::uint8_t {
  copy,      // copy the first n_tokens slots of src into block (copy-on-write)
  truncate,  // slots [n_tokens, block_size) of block become writable again
  release,   // block returned to the free pool without a prefix key (drop per-block state)
  evict,     // block left the prefix cache; key/parent/tokens say what it held
  cache,     // block entered the prefix cache (its K/V are written): key/parent/tokens
  gather,    // a sequence's slots are rewritten from other slots (compact()): `gather` says how
  bind_window,  // block's windowed-layer K/V now live in window slot `slot` (whatever block held it before lost them)
};
struct kv_op {
  kv_op_kind kind = kv_op_kind::copy;
  block_id block;
  block_id src;                // copy only
  std::int32_t n_tokens = 0;   // copy: slots copied; truncate: slots kept
  block_key key = 0;             // evict, cache
  block_key parent = 0;          // evict, cache
  std::vector<token_id> tokens;  // evict, cache: the block's token ids
  std::string tenant;            // evict, cache: its owner's tenant name
  std::shared_ptr<const kv_gather> gather;  // gather only
  std::int32_t slot = -1;                   // bind_window only
};

// What compact() does to one sequence: it keeps n_slots slots, of which
// [0, first) stay as they are and [first, n_slots) are rewritten (the gather
// says from which slots of the table before compaction).
struct kv_compaction {
  std::int32_t first = 0;
  std::int32_t n_slots = 0;
  std::vector<token_id> tokens;          // [n_slots - first]: the token of each rewritten slot
  std::vector<std::int32_t> positions;   // [n_slots - first]: increasing, after positions[first - 1]
  std::shared_ptr<kv_gather> gather;     // its tables and range are filled in by compact()
};

// Why allocate() could not supply blocks.
enum class alloc_blocker : std::uint8_t { none, pool, quota };

// What allocate() did. The caller performs every copy before writing into dst.
struct allocation {
  std::int32_t n_new_blocks = 0;   // blocks appended to the table
  std::vector<block_copy> copies;  // copy-on-write, at most one per call
};

class kv_manager {
 public:
  // One block class. REQUIRES: block_size > 0, n_blocks >= 0.
  kv_manager(std::int32_t block_size, std::int32_t n_blocks, bool enable_prefix_caching = true);
  // class_blocks[c] blocks of class c (ids in class order, block_pool.h).
  // REQUIRES: block_size > 0, 1 <= class_blocks.size() <= k_max_kv_classes, every count >= 0.
  kv_manager(std::int32_t block_size, std::vector<std::int32_t> class_blocks, bool enable_prefix_caching = true);

  std::int32_t block_size() const { return block_size_; }
  std::int32_t n_blocks() const { return pool_.n_blocks(); }  // all classes
  bool prefix_caching_enabled() const { return prefix_caching_; }
  std::int32_t n_classes() const { return pool_.n_classes(); }
  // The class of a block (fixed for its lifetime). REQUIRES: 0 <= b < n_blocks().
  std::int32_t block_class(block_id b) const { return pool_.class_of(b); }
  // What each class's blocks carry in their prefix keys: keys[c] names class
  // c's KV type (keys[0] is not used), so that a key names the type its K/V
  // were computed against whatever the class's number is in another process
  // (a persistent KV store across restarts). Default: the class number.
  // REQUIRES: no sequence yet, keys.size() == n_classes().
  void set_class_keys(std::vector<std::string> keys);

  // --- tenants ---------------------------------------------------------------
  // The id of a tenant, registered on first use. "" is tenant 0, the default.
  tenant_id tenant(std::string_view name);
  std::optional<tenant_id> find_tenant(std::string_view name) const;
  const std::string& tenant_name(tenant_id t) const { return tenants_[static_cast<std::size_t>(t.value)].name; }
  // Limits the tenant's footprint (used + cached blocks) to max_blocks; std::nullopt
  // lifts the limit. Cached blocks beyond a lowered quota are evicted at once.
  status set_tenant_quota(std::string_view name, std::optional<std::int32_t> max_blocks);

  // --- sequences -------------------------------------------------------------
  // Registers a sequence with its prompt and takes the longest run of cached full
  // blocks of it (ref + 1 each). Returns the number of prompt tokens reused: a
  // multiple of block_size, at most floor((n_prompt - 1) / block_size) blocks, so
  // the last prompt token is always computed. Never allocates and never fails for
  // capacity. Errors: seq already present, empty prompt, class runs that are
  // out of order, overlap, leave the prompt or name a class the pool lacks.
  result<std::int32_t> add_sequence(seq_id seq, std::span<const token_id> prompt, const sequence_options& options = {});

  // Blocks allocate(seq, n_new_tokens) would take from the pool: appended blocks
  // plus one copy-on-write block when the next write lands in a shared block.
  // REQUIRES (this and the two below): contains(seq), n_new_tokens >= 0.
  std::int32_t n_blocks_needed(seq_id seq, std::int32_t n_new_tokens) const;
  bool can_allocate(seq_id seq, std::int32_t n_new_tokens) const;
  // What stands in the way of allocate(seq, n_new_tokens): the pool (free +
  // evictable blocks of a class the new blocks need) or the tenant's quota;
  // none when it would succeed.
  alloc_blocker allocation_blocker(seq_id seq, std::int32_t n_new_tokens) const;
  // With more than one block class: the classes (bit c for class c) that
  // allocate(seq, n_new_tokens) needs more blocks of than they can supply
  // now; 0 with one class, or when no class is short.
  std::uint32_t short_classes(seq_id seq, std::int32_t n_new_tokens) const;
  // Whether seq's table holds a block of one of the classes in mask (bit c for class c).
  bool holds_class(seq_id seq, std::uint32_t mask) const;
  // Ensures the table has slots for n_new_tokens tokens beyond the stored ones.
  // Copy-on-write: when n_new_tokens > 0 and the block holding the next write
  // position is partly filled and shared (ref > 1), it is replaced in this table
  // by a fresh block and the copy is reported. std::nullopt when the pool (after
  // evicting cached blocks) or the tenant's quota cannot supply the blocks; then
  // nothing has changed. Call it before every write; it is idempotent once slots
  // exist.
  std::optional<allocation> allocate(seq_id seq, std::int32_t n_new_tokens);
  // Records that K/V of these tokens are now stored in the next slots, computed
  // at `positions` (a prompt chunk, a sampled token fed back, or blocks loaded
  // from elsewhere). Blocks that become full are keyed and registered in the
  // prefix index, unless another block already holds that key or the sequence
  // went off chain: after a drop(), or at the first block whose positions are
  // not its slot numbers (a key names tokens at positions 0, 1, 2, ...). Errors, with nothing changed: unknown seq, more
  // tokens than allocated slots, tokens that differ from the prompt at the
  // same slots, positions that do not increase past the last stored one, a
  // write into a shared or cached block (allocate() was skipped).
  status commit(seq_id seq, std::span<const token_id> tokens, std::span<const std::int32_t> positions);
  // The same with consecutive positions after the last stored one (0 for none).
  status commit(seq_id seq, std::span<const token_id> tokens);
  // Frees whole blocks from anywhere in the table (eviction policies): the
  // blocks at these table indices leave the table, the slots after them move
  // up, and their positions stay. Only full blocks may be dropped. Blocks the
  // sequence fills from now on are not registered in the prefix index: their
  // K/V were computed without the dropped tokens. Errors, with nothing changed:
  // unknown seq, an index out of range or repeated, a block not full.
  status drop(seq_id seq, std::span<const std::int32_t> block_indices);
  // Token-granular eviction: the sequence keeps c.n_slots slots, slots
  // [c.first, c.n_slots) rewritten by the backend from the gather's sources
  // (slots of the table before). Blocks past the new end are released; a
  // rewritten block that is shared with another table, or cached under a key,
  // is first replaced by a fresh block (its kept leading slots copied), or, when
  // cached and only this sequence holds it and the pool has no free block,
  // leaves the prefix index. Reports: copies (and evictions of the blocks
  // they take), one gather op, then releases. The sequence goes off chain. Errors, with nothing changed:
  // unknown seq, a range or positions that do not fit, and resource_exhausted
  // when a shared block needs a copy and the pool or quota has no block.
  status compact(seq_id seq, kv_compaction c);
  // Blocks this sequence fills from now on are not registered in the prefix
  // index (their K/V were computed by a lossy policy, e.g. a sparse read).
  void set_off_chain(seq_id seq) { seq_at(seq).off_chain = true; }
  // Rolls the sequence back to its first n_slots stored slots (speculative
  // decoding, a failed step): blocks past them are released (allocated but
  // unwritten ones too), and a partly kept last block becomes writable from
  // slot n_slots again: in place (a truncate op) when only this sequence holds
  // it, else by copy-on-write at the next allocate (shared or cached blocks are
  // never written). Errors, with nothing changed: unknown seq, n_slots outside
  // [0, n_stored].
  status truncate(seq_id seq, std::int32_t n_slots);
  // For n > 1 completions: child shares every block of parent (ref + 1) and copies
  // its tokens, tenant and class runs. The shared partial block is copied on first write.
  // Errors: unknown parent, existing child, parent holding slots past its stored
  // tokens (fork between commit and the next allocate).
  status fork(seq_id parent, seq_id child);
  // Releases every block of the table, deepest first, so cached blocks of a chain
  // are evicted deepest first. Errors: unknown seq.
  status free_sequence(seq_id seq);
  // free_sequence, counted as a preemption (the scheduler will re-add the sequence
  // with prompt + generated tokens; the prefix cache makes that cheap).
  status preempt_sequence(seq_id seq);

  bool contains(seq_id seq) const { return seqs_.contains(seq); }
  std::size_t n_sequences() const { return seqs_.size(); }
  // REQUIRES (all four): contains(seq).
  std::span<const block_id> block_table(seq_id seq) const;
  std::int32_t n_stored_tokens(seq_id seq) const;
  // The token of every stored slot, then the prompt tokens not stored yet.
  std::span<const token_id> tokens(seq_id seq) const;
  // [n_stored_tokens]: the position each stored slot was computed at.
  std::span<const std::int32_t> positions(seq_id seq) const;
  tenant_id tenant_of(seq_id seq) const;

  // --- pool --------------------------------------------------------------------
  // Blocks an allocation could take now: free + evictable cached (vLLM's
  // get_num_free_blocks). Not kv_metrics::n_blocks_free, which excludes cached.
  std::int32_t n_takeable_blocks() const { return pool_.n_takeable(); }
  // The same for class cls. REQUIRES: 0 <= cls < n_classes().
  std::int32_t n_takeable_blocks(std::int32_t cls) const { return pool_.n_takeable(cls); }
  // The chained keys of prompt's full blocks for a sequence with these options
  // (the keys add_sequence looks up): what a scheduler compares to see two
  // prompts share blocks, and what an external KV source is asked for.
  std::vector<block_key> prompt_keys(std::span<const token_id> prompt, const sequence_options& options = {}) const;
  // [full blocks of prompt]: the KV class each would be of (see "KV classes"),
  // beside prompt_keys: what an external KV source is asked for is in that class's layout.
  std::vector<std::int32_t> prompt_block_classes(std::span<const token_id> prompt,
                                                 const sequence_options& options = {}) const;
  // How many leading blocks of prompt add_sequence would take from the cache
  // now (at most floor((n_prompt - 1) / block_size)); changes nothing. 0 for
  // class runs add_sequence would refuse.
  std::int32_t n_cached_prompt_blocks(std::span<const token_id> prompt, const sequence_options& options = {}) const;
  // The receiver of block ops (see "Block ops"); none by default.
  void set_op_listener(std::function<void(const kv_op&)> listener) { op_listener_ = std::move(listener); }
  // Whether a request could ever run: the blocks for n_completions sequences of
  // prompt + max new tokens (full prompt blocks shared) against the pool, each
  // class's share of it (blocks classed by the rule of "KV classes", slot i at
  // position i) and the tenant's quota. An error the user can act on when not:
  // invalid_argument for bad class runs, resource_exhausted naming the class
  // that is too small.
  status check_request_fits(std::int32_t n_prompt_tokens, std::int32_t n_max_new_tokens,
                            std::string_view tenant = {}, std::int32_t n_completions = 1,
                            std::span<const kv_class_run> classes = {}) const;
  // Drops every cached (ref-0) block from the prefix index (vLLM's
  // reset_prefix_cache). Returns how many; each counts as an eviction.
  std::int32_t evict_cached_blocks();
  // The same for one tenant's cached blocks only (an admin erasing a tenant's
  // KV); 0 for a tenant never seen. Blocks its running sequences hold stay.
  std::int32_t evict_cached_blocks(std::string_view tenant);

  // --- windowed layers (window_slots.h) ---------------------------------------
  // The model's sliding-window layers keep only their window: their K/V live
  // in n_slots window slots instead of the blocks, and a sequence CLAIMS the
  // window slots of its table's blocks from window_from on (a table index;
  // blocks before it are out of every later query's window). A slot is pinned
  // while some sequence claims it; unclaimed, it is retained for prefix-cache
  // hits until a new block needs it. allocate() binds one to every new block
  // (and fails, like a full pool, when none is takeable); add_sequence() takes
  // only a cached prefix whose blocks in the first query's window still hold
  // their windowed K/V. drop() and compact() are refused.
  // REQUIRES: no sequence yet, window_tokens > 0, n_slots > 0, and a pool of
  // one block class (window slots are indexed by block, not by class; the
  // call aborts with a message otherwise: a configuration bug, checked when
  // the engine is built).
  void enable_window_slots(std::int32_t window_tokens, std::int32_t n_slots);
  const window_slots* windows() const { return window_ ? &*window_ : nullptr; }
  std::int32_t window_tokens() const { return window_tokens_; }
  // The sequence's next query sits at position next_position or later: its
  // leading blocks whose every position is at or below next_position -
  // window_tokens are out of its window for good, and it stops claiming them.
  // No-op without window slots. Errors: unknown seq.
  status release_window(seq_id seq, std::int32_t next_position);

  kv_metrics metrics() const;
  // Restarts the peak of used blocks from the current value.
  void reset_peak() { peak_used_ = pool_.n_used(); }

  const block_pool& pool() const { return pool_; }
  const prefix_index& index() const { return index_; }

  // Recomputes everything from scratch (O(blocks + table entries)): pool and
  // index consistency, ref counts = table memberships, table validity, prefix
  // keys (with the block's class), class runs and the class of keyed blocks,
  // tenant ownership and quotas, stored-token accounting.
  status check_invariants() const;

 private:
  struct sequence {
    tenant_id tenant;
    std::string first_extras;       // extra keys of block 0
    std::vector<kv_class_run> classes;  // sorted, non-overlapping
    std::vector<block_id> table;
    std::vector<token_id> tokens;   // [slot]: stored tokens, then the prompt tokens not stored yet
    std::vector<std::int32_t> positions;  // [n_stored]
    std::int32_t n_stored = 0;      // slots whose K/V are stored
    // Keys of the leading full blocks whose contents the plain chain names:
    // every full block until the sequence goes off chain; none without prefix caching.
    std::vector<block_key> keys;
    // The slots no longer hold what the plain chain of keys names (blocks were
    // dropped, or a position is not its slot number): keys stop growing.
    bool off_chain = false;
    // Window slots: table entries from this index on are claimed.
    std::int32_t window_from = 0;
  };
  struct tenant_state {
    std::string name;
    std::optional<std::int32_t> quota_blocks;
  };

  // Blocks to take, per class.
  struct class_demand {
    std::array<std::int32_t, k_max_kv_classes> n{};  // [class]
    std::int32_t total = 0;
    void add(std::int32_t cls, std::int32_t k = 1) {
      n[static_cast<std::size_t>(cls)] += k;
      total += k;
    }
  };

  const sequence& seq_at(seq_id seq) const;
  sequence& seq_at(seq_id seq);
  // The extra keys of table entry block_index of s: tenant and salt for block 0, the block's class.
  std::string extras_of(const sequence& s, std::size_t block_index) const;
  block_key chain_key(const sequence& s, std::size_t block_index, block_key parent, std::string_view extras) const;
  static std::string first_block_extras(const sequence_options& options);
  // Errors for class runs that are out of order, overlap, leave [0, n_prompt) or name a missing class.
  status check_class_runs(std::span<const kv_class_run> runs, std::size_t n_prompt) const;
  // Leading blocks of `tokens` (at most max_blocks) found in the index for
  // tenant t, each of the class the runs give its index.
  std::vector<block_id> match_prefix(std::span<const token_id> tokens, std::string_view first_extras,
                                     std::span<const kv_class_run> runs, tenant_id t, std::size_t max_blocks) const;
  void emit(kv_op op);
  // Whether the next write of s lands in a partly filled block that it may not
  // write: shared with another table, or cached under a key (after truncate()).
  bool needs_cow(const sequence& s, std::int32_t n_new_tokens) const;
  std::int32_t n_appended_blocks(const sequence& s, std::int32_t n_new_tokens) const;
  // The class of table entry block_index when appended now (see "KV classes"). REQUIRES: block_index >= table size.
  std::int32_t new_block_class(const sequence& s, std::size_t block_index) const;
  // The blocks allocate(s, n_new_tokens) takes, by class; with `order`, also
  // the class of each in the order taken (the copy-on-write block first).
  class_demand demand(const sequence& s, std::int32_t n_new_tokens, std::vector<std::int32_t>* order = nullptr) const;
  bool can_take(tenant_id t, const class_demand& d) const;
  alloc_blocker take_blocker(tenant_id t, const class_demand& d) const;
  // One block of each class in `classes`, in that order; d counts them. REQUIRES: can_take(t, d).
  std::vector<block_id> take_blocks(tenant_id t, const class_demand& d, std::span<const std::int32_t> classes);
  void hold(block_id b);
  void release(block_id b);
  void drop_cached(block_id b);
  // The one place a cached block leaves the index: reports the eviction, erases, counts.
  void forget_cached(block_id b);
  void evict_over_quota(tenant_id t);
  // Window slots: a claim pins b's slot (binding one when b has none); the
  // last unclaim retains it. No-ops without window slots.
  void claim(block_id b);
  void unclaim(block_id b);
  // The table index of the first block a query at next_position can see.
  std::int32_t window_start(std::int64_t next_position) const;
  // How many leading hits can be used: those whose blocks in the first
  // query's window still hold their windowed K/V.
  std::size_t usable_hits(std::span<const block_id> hits) const;
  status check_window_invariants() const;
  status check_compaction(const sequence& s, const kv_compaction& c) const;
  void note_peak();

  std::int32_t block_size_;
  bool prefix_caching_;
  std::vector<std::string> class_keys_;  // [class]: its extra key value ("" for class 0)
  block_pool pool_;
  prefix_index index_;
  std::unordered_map<seq_id, sequence> seqs_;
  std::vector<tenant_state> tenants_;  // [tenant id]
  std::unordered_map<std::string, tenant_id> tenant_ids_;

  // Token slots written in each block (the most any holder has written); the sum
  // over used blocks is stored_tokens_in_used_ (shared blocks count once).
  std::vector<std::int32_t> fill_;  // [n_blocks]
  std::int64_t stored_tokens_in_used_ = 0;

  std::function<void(const kv_op&)> op_listener_;
  std::vector<std::int32_t> class_order_;  // allocate()'s scratch: the class of each block it takes
  std::optional<window_slots> window_;
  std::int32_t window_tokens_ = 0;
  std::vector<std::int32_t> claims_;  // [n_blocks]: sequences claiming the block's window slot
  std::int32_t peak_used_ = 0;
  std::int64_t n_query_tokens_ = 0;
  std::int64_t n_hit_tokens_ = 0;
  std::int64_t n_query_blocks_ = 0;
  std::int64_t n_hit_blocks_ = 0;
  std::int64_t n_evictions_ = 0;
  std::int64_t n_preemptions_ = 0;
  std::int64_t n_cow_copies_ = 0;
};

}  // namespace pagoda
