// The KV manager: a coordinator over KV groups (kv_group.h). It keeps what
// is the sequence's, whatever group holds its K/V: sequences, their tokens
// and positions, prefix keys, tenants and quotas, the KV class rule, the op
// log and the invariants; each group keeps its blocks (pool, prefix index,
// one table per sequence). It holds no tensors: the caller (the engine)
// writes K/V into the backend at the slots the tables name and performs the
// ops it reports. One engine thread owns it: no locks.
//
// A step of one sequence, as the scheduler drives it:
//   add_sequence(seq, prompt)        -> n tokens served from the prefix cache
//   allocate(seq, n)                 -> slots for n more tokens in every group, or std::nullopt (preempt someone)
//   ... perform the block ops (copies, ...), then write K/V of n tokens ...
//   commit(seq, those n token ids, their positions)
//                                    -> full blocks enter each group's prefix index
//   release_window(seq, next position) -> sliding-window groups free what no later query reads
//   free_sequence(seq) / preempt_sequence(seq)
// Commit comes after the K/V are written, never before: a block is shareable
// through the prefix index only once its K/V exist.
//
// Groups. A manager of one full-attention group (the constructors taking a
// block count) is the classic paged KV cache. Every group's table of a
// sequence has one entry per block of slots (table index i holds slots
// [i * block_size, (i + 1) * block_size)); a sliding-window group's leading
// entries become NULL (block_id()) once no later query reads them. Group 0
// is the main group: tenant quotas count its blocks, and block_table(seq)
// without a group, pool() and index() are its. Allocation is all or nothing
// across groups; a group without a takeable block of the class needed fails
// allocation like a full pool.
//
// Slots and positions. A sequence's KV slots are numbered 0..n_stored-1 in
// table order. Each stored slot keeps the position its token was computed at
// (its RoPE position), which is not its slot number once blocks were dropped
// from the middle (drop(), compact()). Positions strictly increase along the slots.
//
// Block ops. What the tensors must do follows from bookkeeping here (a
// copy-on-write, a block reopened by truncate(), a partly filled block freed,
// a cached block evicted, a block entering the cache, a compaction's gather);
// each is reported, in the order it happened, to the op listener
// (set_op_listener), which the owner of the tensors applies before its next
// writes. Ops carry global block ids (the group owning the id) and their
// group. Evictions are reported with the block's key, parent key and tokens
// while its bytes are still intact.
//
// Invariants (check_invariants() verifies all of them, group by group):
// - Block tables are append-only, except: copy-on-write replaces the entry
//   that holds the next write position (a partly filled block shared with
//   another sequence) by a private copy, in allocate(), before anything is
//   written into it; a sliding window turns leading entries NULL; drop(),
//   compact() and truncate() rewrite a table as they say.
// - A block's ref count equals the number of tables that hold it; a table holds a
//   block at most once. Every group's table of a sequence has the same length.
// - Writes only go into blocks with ref 1 that are not in a prefix index.
// - Every block held by a sequence belongs to that sequence's tenant; blocks are
//   never shared across tenants (the tenant enters the first block's key).
// - Quotas: a tenant's used blocks of group 0 never grow past its quota through allocate().
// - Classes: the blocks at one table index are of one class in every group;
//   a sequence without class runs holds only class-0 blocks; a keyed block is
//   of the class its runs give its index, and that class is part of its key.
//
// KV classes (per-segment KV type). Every group's pool is split into the same
// classes (block_pool.h): class 0 holds the default KV type, classes 1..C-1
// other formats. A prompt may ask for a class over tokens [begin, end) of itself
// (sequence_options::classes, kv_class_run). The class of a table index is
// fixed when its blocks are taken; a table may mix classes:
// - A new table index is of class c when EVERY slot of it holds a token
//   inside runs of class c (adjacent runs of the same class count as one);
//   otherwise, straddling a run's edge or outside every run, it is of class 0
//   (default precision). Runs name tokens by their index in the sequence
//   (prompt, then generated), not by position: slots not stored yet take the
//   tokens fed next (token n_fed, n_fed + 1, ...), so a policy that renumbers
//   positions (positions=cache) does not move a part's type. Runs end inside
//   the prompt, so the blocks of generated tokens are of class 0.
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
//
// Tenants and quotas (group 0). A tenant's footprint is its used blocks plus
// its cached (ref-0, still indexed) blocks, and a quota bounds the footprint:
// a tenant at its quota that allocates evicts its OWN cached blocks of least
// worth first (the pool's eviction order, block_pool.h) and never anyone
// else's: its cached blocks of the class it needs are taken first, and if its
// footprint is still above the quota, its cached blocks of other classes are
// evicted, least worth first. These evictions count as eviction_reason::quota,
// those of a take from the class's queue as eviction_reason::capacity.
// A tenant below its quota takes from the class's free queue: free blocks
// first, then the cached block of that class of least worth, whoever
// owns it. With several classes a tenant at its quota whose own cache holds
// no block of the class it needs takes that block like a tenant below its
// quota and pays for it by evicting its own cached block of another class.
// allocate() fails (std::nullopt) when used + new blocks would exceed the quota.
// Lowering a quota drops the tenant's cached blocks beyond it, and a tenant
// still above its quota keeps no cache until it is back under. Other groups
// hold what a tenant's sequences need in them (a sliding window: at most a
// window per sequence) and are not counted.
//
// Side blocks (kv_side.h). Memory a sequence holds beyond its KV and that
// grows with its context (a retrieval index, policy statistics) is paid for
// in group-0 blocks of class 0, taken from the same pool as KV and held by the
// sequence outside its tables: never written, never keyed, counted as used
// (and in the tenant's quota), released with the sequence (free_sequence,
// preempt_sequence). So KV plus side memory stay within the pool's budget.
// With side_block_bytes() = B > 0, a sequence of charge c holds, from each
// allocate(seq, n) on, ceil(max(c.bytes_for(n_stored + n), measured) / B)
// side blocks, where measured is the last set_side_measured() (what the
// structures really hold, so a bound that proves short is still paid for).
// allocate() takes the side blocks it lacks with the KV blocks, all or
// nothing, so a sequence whose side memory does not fit fails like KV that
// does not fit (the scheduler waits or preempts) and check_request_fits counts
// them. Side blocks only grow while the sequence lives (truncate, drop and
// compact keep them: a high-water mark); a fork's child starts with none and
// takes its own at its first allocate. B = 0 (the default): nothing is charged.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kv/block_pool.h"
#include "kv/kv_gather.h"
#include "kv/kv_group.h"
#include "kv/kv_metrics.h"
#include "kv/kv_ops.h"
#include "kv/kv_side.h"
#include "kv/prefix_index.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

struct sequence_options {
  std::string_view tenant;      // "" is the default tenant, which shares the global cache
  std::string_view cache_salt;  // vLLM's cache_salt; "" for none
  bool lookup = true;           // take cached blocks of the prompt (false: compute it all, e.g. to score it)
  std::span<const kv_class_run> classes;  // none: every block of class 0. add_sequence copies them.
  side_charge side;             // the sequence's side memory bound (see "Side blocks"); none: nothing charged
  // The tokens are a chunk computed alone (CacheBlend reuse), not a prompt:
  // its keys live apart from every prompt's (an extra key of block 0).
  bool chunk = false;
  // With lookup: take at most this many cached blocks (a scoring request's
  // prompt scores cover that many, sched/prompt_score_cache.h).
  std::int32_t max_lookup_blocks = std::numeric_limits<std::int32_t>::max();
};

// The most KV groups one manager coordinates (per-group scratch is sized by it).
inline constexpr std::int32_t k_max_kv_groups = 4;

class kv_manager final : private kv_group_host {
 public:
  // One full-attention group of one class. REQUIRES: block_size > 0, n_blocks >= 0.
  kv_manager(std::int32_t block_size, std::int32_t n_blocks, bool enable_prefix_caching = true);
  // One full-attention group; class_blocks[c] blocks of class c (ids in class order, block_pool.h).
  // REQUIRES: block_size > 0, 1 <= class_blocks.size() <= k_max_kv_classes, every count >= 0.
  kv_manager(std::int32_t block_size, std::vector<std::int32_t> class_blocks, bool enable_prefix_caching = true);
  // Groups in this order, group 0 the main one; ids follow group order.
  // REQUIRES: 1 <= groups.size() <= k_max_kv_groups, every group with the same
  // number of classes (1 to k_max_kv_classes), a sliding window > 0 where the kind has one.
  kv_manager(std::int32_t block_size, std::vector<kv_group_config> groups, bool enable_prefix_caching = true);
  ~kv_manager();

  std::int32_t block_size() const { return block_size_; }
  // Blocks of group 0 (every class).
  std::int32_t n_blocks() const { return group0().n_blocks(); }
  bool prefix_caching_enabled() const { return prefix_caching_; }
  std::int32_t n_classes() const { return group0().pool().n_classes(); }
  // The class of a block of any group (fixed for its lifetime). REQUIRES: a valid id.
  std::int32_t block_class(block_id b) const { return group_of_block(b).class_of(b); }
  // What each class's blocks carry in their prefix keys: keys[c] names class
  // c's KV type (keys[0] is not used), so that a key names the type its K/V
  // were computed against whatever the class's number is in another process
  // (a persistent KV store across restarts). Default: the class number.
  // REQUIRES: no sequence yet, keys.size() == n_classes().
  void set_class_keys(std::vector<std::string> keys);

  // --- groups ------------------------------------------------------------------
  std::int32_t n_groups() const { return static_cast<std::int32_t>(groups_.size()); }
  const kv_group& group(std::int32_t g) const { return *groups_[static_cast<std::size_t>(g)]; }
  // The group owning a global block id. REQUIRES: 0 <= b < every group's blocks.
  std::int32_t group_of(block_id b) const { return group_of_block(b).id(); }
  // Whether some group is a sliding window (its tables turn NULL as windows move).
  bool has_sliding_window() const;

  // --- tenants ---------------------------------------------------------------
  // The id of a tenant, registered on first use. "" is tenant 0, the default.
  tenant_id tenant(std::string_view name);
  std::optional<tenant_id> find_tenant(std::string_view name) const;
  const std::string& tenant_name(tenant_id t) const override {
    return tenants_[static_cast<std::size_t>(t.value)].name;
  }
  // Limits the tenant's footprint in group 0 (used + cached blocks) to
  // max_blocks; std::nullopt lifts the limit. Cached blocks beyond a lowered
  // quota are evicted at once.
  status set_tenant_quota(std::string_view name, std::optional<std::int32_t> max_blocks);

  // --- sequences -------------------------------------------------------------
  // Registers a sequence with its prompt and takes the longest run of cached full
  // blocks of it that every group can serve (ref + 1 each; a sliding-window
  // group only the blocks its first query reads). Returns the number of prompt
  // tokens reused: a multiple of block_size, at most floor((n_prompt - 1) /
  // block_size) blocks, so the last prompt token is always computed. Never
  // allocates and never fails for capacity. Errors: seq already present, empty
  // prompt, class runs that are out of order, overlap, leave the prompt or name a
  // class the pool lacks.
  result<std::int32_t> add_sequence(seq_id seq, std::span<const token_id> prompt, const sequence_options& options = {});

  // Blocks allocate(seq, n_new_tokens) would take from the pools: appended
  // blocks plus one copy-on-write block when the next write lands in a shared
  // block, summed over groups.
  // REQUIRES (this and the three below): contains(seq), n_new_tokens >= 0.
  std::int32_t n_blocks_needed(seq_id seq, std::int32_t n_new_tokens) const;
  bool can_allocate(seq_id seq, std::int32_t n_new_tokens) const;
  // What stands in the way of allocate(seq, n_new_tokens): a pool (free +
  // evictable blocks of a class the new blocks need, in some group) or the
  // tenant's quota; none when it would succeed.
  alloc_blocker allocation_blocker(seq_id seq, std::int32_t n_new_tokens) const;
  // The (group, class) pools that allocate(seq, n_new_tokens) needs more
  // blocks of than they can supply now: bit g * k_max_kv_classes + c; 0 when
  // nothing is short, or with one group of one class.
  std::uint64_t short_classes(seq_id seq, std::int32_t n_new_tokens) const;
  // Whether seq holds a block of one of the (group, class) pools in mask (bits as short_classes).
  bool holds_class(seq_id seq, std::uint64_t mask) const;
  // Ensures every group's table has slots for n_new_tokens tokens beyond the
  // stored ones. Copy-on-write: when n_new_tokens > 0 and the block holding
  // the next write position is partly filled and shared (ref > 1) or cached,
  // it is replaced in this table by a fresh block and the copy is reported.
  // std::nullopt when a pool (after evicting cached blocks) or the tenant's
  // quota cannot supply the blocks; then nothing has changed. Call it before
  // every write; it is idempotent once slots exist.
  std::optional<allocation> allocate(seq_id seq, std::int32_t n_new_tokens);
  // Records that K/V of these tokens are now stored in the next slots, computed
  // at `positions` (a prompt chunk, a sampled token fed back, or blocks loaded
  // from elsewhere). Blocks that become full are keyed and registered in their
  // groups' prefix indexes, unless another block already holds that key or the
  // sequence went off chain: after a drop(), or at the first block whose
  // positions are not its slot numbers (a key names tokens at positions 0, 1,
  // 2, ...). Errors, with nothing changed: unknown seq, more tokens than
  // allocated slots, tokens that differ from the prompt at the same slots,
  // positions that do not increase past the last stored one, a write into a
  // shared or cached block (allocate() was skipped).
  status commit(seq_id seq, std::span<const token_id> tokens, std::span<const std::int32_t> positions);
  // The same with consecutive positions after the last stored one (0 for none).
  status commit(seq_id seq, std::span<const token_id> tokens);
  // Frees whole blocks from anywhere in the tables (eviction policies): the
  // blocks at these table indices leave every group's table, the slots after
  // them move up, and their positions stay. Only full blocks may be dropped.
  // Blocks the sequence fills from now on are not registered in the prefix
  // index: their K/V were computed without the dropped tokens. Errors, with
  // nothing changed: unknown seq, an index out of range or repeated, a block not full.
  status drop(seq_id seq, std::span<const std::int32_t> block_indices);
  // Token-granular eviction: the sequence keeps c.n_slots slots, slots
  // [c.first, c.n_slots) rewritten by the backend from the gather's sources
  // (slots of the tables before). Blocks past the new end are released; a
  // rewritten block that is shared with another table, or cached under a key,
  // is first replaced by a fresh block (its kept leading slots copied), or, when
  // cached and only this sequence holds it and the pool has no free block,
  // leaves the prefix index. A sliding-window group rewrites only the blocks
  // the next query reads (the others become NULL; a kept slot whose source
  // it no longer holds is out of its window, so nothing reads it). Reports,
  // group by group: copies (and evictions of the blocks they take), one gather
  // op, then releases. The sequence goes off chain. Errors, with nothing changed:
  // unknown seq, a range or positions that do not fit, and resource_exhausted
  // when a block needs a fresh copy and a pool or the quota has none.
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
  // [0, n_stored], or a sliding window that already freed blocks the next
  // query after the kept slots would read.
  status truncate(seq_id seq, std::int32_t n_slots);
  // For n > 1 completions: child shares every block of parent (ref + 1) and copies
  // its tokens, tenant and class runs. The shared partial block is copied on first write.
  // Errors: unknown parent, existing child, parent holding slots past its stored
  // tokens (fork between commit and the next allocate).
  status fork(seq_id parent, seq_id child);
  // Releases every block of every table, deepest first, so cached blocks of a
  // chain are evicted deepest first. Errors: unknown seq.
  status free_sequence(seq_id seq);
  // free_sequence, counted as a preemption (the scheduler will re-add the sequence
  // with prompt + generated tokens; the prefix cache makes that cheap).
  status preempt_sequence(seq_id seq);
  // The sequence's next query sits at position next_position or later:
  // sliding-window groups free the leading blocks it will not read (they
  // stay cached for prefix hits while their pool does not need them). No-op
  // without sliding windows. Returns how many blocks were freed. Errors: unknown seq.
  result<std::int32_t> release_window(seq_id seq, std::int64_t next_position);

  bool contains(seq_id seq) const { return seqs_.contains(seq); }
  std::size_t n_sequences() const { return seqs_.size(); }
  // REQUIRES (all below): contains(seq).
  // Group 0's table, or group g's (NULL entries where a sliding window freed them).
  std::span<const block_id> block_table(seq_id seq) const { return block_table(seq, 0); }
  std::span<const block_id> block_table(seq_id seq, std::int32_t g) const;
  std::int32_t n_stored_tokens(seq_id seq) const;
  // The token of every stored slot, then the prompt tokens not stored yet.
  std::span<const token_id> tokens(seq_id seq) const;
  // [n_stored_tokens]: the position each stored slot was computed at.
  std::span<const std::int32_t> positions(seq_id seq) const;
  tenant_id tenant_of(seq_id seq) const;

  // --- pool --------------------------------------------------------------------
  // Blocks an allocation could take now from group 0: free + evictable cached
  // (vLLM's get_num_free_blocks). Not kv_metrics::n_blocks_free, which excludes cached.
  std::int32_t n_takeable_blocks() const { return group0().pool().n_takeable(); }
  // The same for class cls. REQUIRES: 0 <= cls < n_classes().
  std::int32_t n_takeable_blocks(std::int32_t cls) const { return group0().pool().n_takeable(cls); }
  // Whether some group has no takeable block of any class left (nothing new can start).
  bool any_group_exhausted() const;
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
  // The most tokens one step computes for a sequence (a prompt chunk): a
  // sliding-window group holds at most a window plus that per sequence, which
  // check_request_fits counts. Default: unbounded (a whole request).
  void set_max_step_tokens(std::int32_t n) { max_step_tokens_ = n; }
  // Whether a request could ever run: the blocks for n_completions sequences of
  // prompt + max new tokens (full prompt blocks shared) against each group's
  // pool, each class's share of it (blocks classed by the rule of "KV
  // classes", slot i at position i) and the tenant's quota. An error the user
  // can act on when not: invalid_argument for bad class runs,
  // resource_exhausted naming the group or class that is too small.
  // Side memory (side: each completion's charge) counts in group 0's pool and the quota.
  status check_request_fits(std::int32_t n_prompt_tokens, std::int32_t n_max_new_tokens,
                            std::string_view tenant = {}, std::int32_t n_completions = 1,
                            std::span<const kv_class_run> classes = {}, const side_charge& side = {}) const;

  // --- side blocks (see "Side blocks") -------------------------------------------
  // The bytes one side block stands for (a group-0 block's K/V bytes); 0: side
  // memory is not charged. REQUIRES: bytes >= 0.
  void set_side_block_bytes(std::int64_t bytes) { side_block_bytes_ = bytes; }
  std::int64_t side_block_bytes() const { return side_block_bytes_; }
  // Blocks that charge holds at n_tokens (0 when nothing is charged).
  std::int32_t side_blocks_for(const side_charge& charge, std::int64_t n_tokens) const;
  // What the sequence's side structures hold now (the runner's report); the
  // next allocate() takes blocks for it if it exceeds the bound. Errors: unknown seq.
  status set_side_measured(seq_id seq, std::int64_t bytes);
  // REQUIRES: contains(seq).
  std::int32_t n_side_blocks(seq_id seq) const;
  // Drops every cached (ref-0) block from the prefix indexes (vLLM's
  // reset_prefix_cache). Returns how many; each counts as an eviction
  // (eviction_reason::admin, as are the tenant's below).
  std::int32_t evict_cached_blocks();
  // The same for one tenant's cached blocks only (an admin erasing a tenant's
  // KV); 0 for a tenant never seen. Blocks its running sequences hold stay.
  std::int32_t evict_cached_blocks(std::string_view tenant);

  kv_metrics metrics() const;
  // Restarts the peak of used blocks from the current value.
  void reset_peak();

  // Group 0's pool and prefix index.
  const block_pool& pool() const { return group0().pool(); }
  const prefix_index& index() const { return group0().index(); }

  // Recomputes everything from scratch (O(blocks + table entries)): each
  // group's pool and index against the tables, prefix keys (with the block's
  // class), class runs and the class of every table index, tenant ownership and
  // quotas, stored-token accounting, positions.
  status check_invariants() const;

 private:
  struct sequence {
    tenant_id tenant;
    std::string first_extras;       // extra keys of block 0
    std::vector<kv_class_run> classes;  // sorted, non-overlapping
    std::array<std::vector<block_id>, k_max_kv_groups> tables;  // [group][table index]
    std::vector<std::uint8_t> block_classes;  // [table index]: the class of its blocks in every group
    std::vector<token_id> tokens;   // [slot]: stored tokens, then the prompt tokens not stored yet
    std::vector<std::int32_t> positions;  // [n_stored]
    std::int32_t n_stored = 0;      // slots whose K/V are stored
    std::int64_t n_fed = 0;         // tokens committed in the sequence's life: the index of the next one
    // Keys of the leading full blocks whose contents the plain chain names:
    // every full block until the sequence goes off chain; none without prefix caching.
    std::vector<block_key> keys;
    // The slots no longer hold what the plain chain of keys names (blocks were
    // dropped, or a position is not its slot number): keys stop growing.
    bool off_chain = false;
    // A compaction on a sliding window leaves slots whose K/V it no longer
    // held (out of its window): their positions are at most this. A rollback
    // (truncate) must not bring one back into a window.
    std::int64_t window_dead_upto = INT64_MIN;
    side_charge side;                    // its side memory bound
    std::int64_t side_measured = 0;      // what its side structures last held
    std::vector<block_id> side_blocks;   // group 0, class 0: held for side memory, outside the tables
    std::size_t n_table() const { return block_classes.size(); }
  };
  struct tenant_state {
    std::string name;
    std::optional<std::int32_t> quota_blocks;
  };
  // Per group: what an allocation takes (the copy-on-write block first, then appended blocks).
  struct group_demand {
    class_demand d;
    std::vector<std::int32_t> order;  // the class of each block, in the order taken (side blocks last)
    bool cow = false;
    std::int32_t n_side = 0;          // group 0: the last n_side of order are side blocks
  };
  using demands = std::array<group_demand, k_max_kv_groups>;

  kv_group& group0() { return *groups_.front(); }
  const kv_group& group0() const { return *groups_.front(); }
  const kv_group& group_of_block(block_id b) const;
  void emit(kv_op op) override;
  const sequence& seq_at(seq_id seq) const;
  sequence& seq_at(seq_id seq);
  // The extra keys of table index i of s: tenant and salt for block 0, the block's class.
  std::string extras_of(const sequence& s, std::size_t block_index) const;
  block_key chain_key(const sequence& s, std::size_t block_index, block_key parent, std::string_view extras) const;
  static std::string first_block_extras(const sequence_options& options);
  // Errors for class runs that are out of order, overlap, leave [0, n_prompt) or name a missing class.
  status check_class_runs(std::span<const kv_class_run> runs, std::size_t n_prompt) const;
  // Keys, parents, extras and classes of prompt's first max_blocks full blocks (as prefix_probe views).
  struct probe_data {
    std::vector<block_key> keys, parents;
    std::vector<std::string> extras;
    std::vector<std::uint8_t> classes;
  };
  probe_data probe_of(std::span<const token_id> prompt, std::string_view first_extras,
                      std::span<const kv_class_run> runs, std::size_t max_blocks) const;
  // The most leading blocks of a probe every group serves (each group's answer, until they agree).
  std::int32_t longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const;
  // Whether the next write of s in group g lands in a partly filled block
  // that it may not write: shared with another table, or cached under a key.
  bool needs_cow(const sequence& s, std::int32_t g, std::int32_t n_new_tokens) const;
  std::int32_t n_appended_blocks(const sequence& s, std::int32_t n_new_tokens) const;
  // The class of table index block_index when appended now (see "KV classes"). REQUIRES: block_index >= table size.
  std::int32_t new_block_class(const sequence& s, std::size_t block_index) const;
  // What allocate(s, n_new_tokens) takes from each group.
  demands demand(const sequence& s, std::int32_t n_new_tokens) const;
  alloc_blocker take_blocker(tenant_id t, const demands& d) const;
  // Side blocks that hold `bytes` (0 when nothing is charged).
  std::int32_t side_blocks_of(std::int64_t bytes) const;
  // Takes d's blocks of group g for s (a tenant at its quota pays with its own cache in group 0).
  std::vector<block_id> take(const sequence& s, std::int32_t g, const group_demand& d);
  // Copy-on-write in group g of the block holding s's next write position; fresh is its replacement.
  block_copy copy_on_write(sequence& s, std::int32_t g, block_id fresh);
  void evict_over_quota(tenant_id t);
  status check_compaction(const sequence& s, const kv_compaction& c) const;
  // Cuts s's tables and slots to its first n_slots (truncate(), and compact() of the tail).
  void shrink(sequence& s, std::int32_t n_slots);
  status check_sequence(seq_id id, const sequence& s) const;
  // compact() of one group: its fresh blocks and gather op (kv_compact.cpp).
  struct group_rewrite;
  group_rewrite plan_rewrite(const sequence& s, std::int32_t g, const kv_compaction& c,
                             std::int64_t next_position) const;
  void apply_rewrite(sequence& s, std::int32_t g, group_rewrite& r, const kv_compaction& c);

  std::int32_t block_size_;
  bool prefix_caching_;
  std::int32_t max_step_tokens_ = INT32_MAX;
  std::int64_t side_block_bytes_ = 0;
  std::vector<std::string> class_keys_;  // [class]: its extra key value ("" for class 0)
  std::vector<std::unique_ptr<kv_group>> groups_;
  std::unordered_map<seq_id, sequence> seqs_;
  std::vector<tenant_state> tenants_;  // [tenant id]
  std::unordered_map<std::string, tenant_id> tenant_ids_;

  std::function<void(const kv_op&)> op_listener_;
  std::int64_t n_query_tokens_ = 0;
  std::int64_t n_hit_tokens_ = 0;
  std::int64_t n_query_blocks_ = 0;
  std::int64_t n_hit_blocks_ = 0;
  std::int64_t n_preemptions_ = 0;
  std::int64_t n_cow_copies_ = 0;
};

}  // namespace pagoda
