// Property test: long random sequences of operations on one kv_manager (add with
// shared prefixes, salts and tenants; allocate + commit of prompt chunks and
// decode tokens at increasing positions, with gaps; fork; free; preemption and
// re-add; drop of blocks from the middle; truncate of the tail; compaction
// (token-granular eviction: kept slots gathered to the front); allocation
// under pressure, which evicts; quota changes; cache resets; speculative
// verification steps), checking after every operation:
// - kv_manager::check_invariants() (counts add up, ref counts = table
//   memberships, tables valid and unique, index <-> hashed blocks, keys chain,
//   positions increase),
// - simulated tensors, changed only by the writes of committed tokens and by
//   the block ops the manager reports (copy, truncate, release, evict): every
//   stored token of every sequence reads back, with its position, from the slot
//   its block table names, and every cached block holds the tokens the prefix
//   index claims for it (so sharing, reuse, copy-on-write, drop and truncate
//   never hand out wrong KV, and a compaction's gather finds its sources
//   intact and never writes a block another table or the cache reads); slots
//   a truncate or release gives up are
//   poisoned, so a stale read is caught; an evicted block's reported tokens are
//   the ones its slots still hold (bytes intact when the eviction is reported),
// - a failed allocate changed nothing,
// and at the end, with every sequence gone, no block is leaked.
// KV-group scenarios add a sliding-window group beside the full one (or make
// the only group a window, every layer sliding): the simulated tensors cover
// every group's blocks (ids are global), every table is written, and every
// token the next query of a sequence can see reads back from the window
// group's table; drops and compactions run on windows too.
// KV-class scenarios split every group's pool into block classes and give
// prompts random class runs (some shared with their prefix, so class blocks
// are hit): every block an allocate takes is of the class a brute-force
// reading of the rule gives (a copy: its source's class), the same in every
// group, per-class counts add up, and check_request_fits agrees with a
// per-class count.
// A verification step replays scheduler::commit_verified's calls (allocate
// 1 + k slots, write all, commit the verified prefix, truncate to it), with k
// up to block_size + 2 so the rejected tail crosses block boundaries: no slot
// still holds a rejected draft afterwards, no block that held one is indexed,
// hashed or reported as cached (what the commit hook and the store see), the
// sequence stores exactly the verified tokens, and its tables hold no block
// past them.
// Sealed scenarios run a real int4 storage beside the simulated tensors
// (kv_sealed_shadow.h), holding a verification's blocks as the runner does:
// every block cached or evicted holds the bytes plain decoding stores for
// its tokens, rolled-back ones included (compaction, which requantizes by
// design, is left out there).
// Shared-layout scenarios (cross-layer sharing, MiniCache) run a real storage
// of three model layers, the upper two merged into one KV layer
// (kv_merged_shadow.h), through every op, compactions included: each cached
// or evicted block, and every block of one sequence after each op, holds per
// slot and head either the merge of its two layers' rows with the upper
// layer's ratios, or the lower layer's rows with the upper layer's own kept
// apart, and layer 0's own rows.
#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_manager.h"
#include "kv_merged_shadow.h"
#include "kv_sealed_shadow.h"

namespace pagoda {
namespace {

struct scenario {
  std::int32_t block_size;
  std::int32_t n_blocks;  // group 0's; with classes: their sum
  bool prefix_caching;
  std::int32_t window_tokens = 0;  // > 0: a sliding window
  std::int32_t window_blocks = 0;  // > 0: a window group of that many blocks per class beside a full group; 0: group 0 slides
  std::vector<std::int32_t> classes = {};  // group 0's blocks of each KV class; empty: one class
  bool sealed = false;  // a sealed int4 storage beside the simulated tensors (one group, one class)
  cache_eviction eviction = cache_eviction::lru;  // every group's (seeds of the second round: lfu)
  bool merged = false;  // a MiniCache storage beside the simulated tensors (one group, one class)
};

scenario scenario_for(std::uint32_t seed) {
  static const scenario k_scenarios[] = {{4, 48, true},
                                         {1, 96, true},
                                         {3, 64, true},
                                         {16, 24, true},
                                         {4, 48, false},
                                         {4, 48, true, 9, 20},
                                         {3, 64, true, 5, 12},
                                         {4, 52, true, 0, 0, {32, 12, 8}},
                                         {3, 60, true, 0, 0, {40, 20}},
                                         {4, 48, false, 0, 0, {30, 18}},
                                         {4, 40, true, 9, 0},
                                         {3, 52, true, 7, 10, {32, 20}},
                                         {4, 48, true, 0, 0, {}, true},
                                         {3, 64, true, 0, 0, {}, true},
                                         {4, 48, true, 0, 0, {}, false, cache_eviction::lru, true},
                                         {3, 60, true, 0, 0, {}, false, cache_eviction::lru, true}};
  scenario sc = k_scenarios[seed % std::size(k_scenarios)];
  if ((seed / std::size(k_scenarios)) % 2 == 1) sc.eviction = cache_eviction::lfu;
  return sc;
}

std::vector<kv_group_config> groups_of(const scenario& sc) {
  kv_group_config main;
  main.class_blocks = sc.classes.empty() ? std::vector<std::int32_t>{sc.n_blocks} : sc.classes;
  main.eviction = sc.eviction;
  if (sc.window_tokens > 0 && sc.window_blocks == 0) {
    main.kind = kv_group_kind::sliding_window;
    main.window_tokens = sc.window_tokens;
  }
  if (sc.window_blocks == 0) return {main};
  kv_group_config window;
  window.kind = kv_group_kind::sliding_window;
  window.window_tokens = sc.window_tokens;
  window.class_blocks.assign(main.class_blocks.size(), sc.window_blocks);
  window.eviction = sc.eviction;
  return {main, window};
}

std::int32_t total_blocks(const scenario& sc) {
  std::int32_t n = 0;
  for (const kv_group_config& g : groups_of(sc))
    for (const std::int32_t c : g.class_blocks) n += c;
  return n;
}

struct live_seq {
  std::int64_t n_fed = 0;  // tokens committed in the sequence's life: the index of the next one
  std::int64_t next_position = 0;  // where its next query sits (drops and compactions do not move it)
  sequence_options options;
  std::string tenant, salt;  // owned storage behind options
  std::vector<kv_class_run> runs;
  std::size_t n_prompt = 0;
  std::size_t max_tokens = 0;
  // options views point into the strings and runs: refresh them after a move or copy.
  void refresh() {
    options.tenant = tenant;
    options.cache_salt = salt;
    options.classes = runs;
  }
};

// The class rule read directly: the class of the run holding each position
// (0 outside every run); the block's class when they all agree, else 0.
std::int32_t rule_class(std::span<const kv_class_run> runs, std::span<const std::int64_t> positions) {
  std::int32_t cls = -1;
  for (const std::int64_t p : positions) {
    std::int32_t c = 0;
    for (const kv_class_run& r : runs)
      if (r.begin <= p && p < r.end) c = r.cls;
    if (c == 0 || (cls >= 0 && c != cls)) return 0;
    cls = c;
  }
  return std::max(cls, 0);
}

// The most tokens op_step computes at once for a sequence.
std::int32_t k_max_step(std::int32_t block_size) { return 2 * block_size; }

class harness {
 public:
  harness(std::uint32_t seed, const scenario& sc)
      : rng_(seed),
        bs_(sc.block_size),
        m_(sc.block_size, groups_of(sc), sc.prefix_caching),
        kv_(static_cast<std::size_t>(total_blocks(sc)) * static_cast<std::size_t>(sc.block_size), k_no_token),
        pos_(kv_.size(), -1),
        tentative_(kv_.size(), false) {
    if (sc.sealed) shadow_.emplace(sc.block_size, total_blocks(sc));
    if (sc.merged) merged_.emplace(sc.block_size, total_blocks(sc), std::max(1, sc.block_size / 2));
    m_.set_op_listener([this](const kv_op& op) { apply(op); });
    m_.set_max_step_tokens(k_max_step(bs_));
    // A few shared prefixes from a tiny vocabulary, so prompts overlap often.
    for (int p = 0; p < 4; ++p) {
      std::vector<token_id> prefix(static_cast<std::size_t>(uniform(0, 4 * bs_ + 2)));
      for (auto& t : prefix) t = static_cast<token_id>(uniform(0, 5));
      prefixes_.push_back(prefix);
    }
  }

  void run(int n_ops) {
    for (op_ = 0; op_ < n_ops; ++op_) {
      const int r = uniform(0, 99);
      static const char* const k_names[] = {"add", "step", "verify", "drop", "truncate", "compact", "fork", "finish", "preempt", "quota", "evict", "fits"};
      const int thresholds[] = {16, 56, 62, 66, 68, 70, 78, 88, 95, 98, 99, 100};
      for (int k = 0; k < 12; ++k)
        if (r < thresholds[k]) {
          op_name_ = k_names[k];
          break;
        }
      if (r < 16) {
        op_add();
      } else if (r < 56) {
        op_step();
      } else if (r < 62) {
        op_verify();
      } else if (r < 66) {
        op_drop();
      } else if (r < 68) {
        op_truncate();
      } else if (r < 70) {
        op_compact();
      } else if (r < 78) {
        op_fork();
      } else if (r < 88) {
        op_finish();
      } else if (r < 95) {
        op_preempt(random_seq());
      } else if (r < 98) {
        op_quota();
      } else if (r < 99) {
        m_.evict_cached_blocks();
      } else {
        op_fits();
      }
      verify();
      if (::testing::Test::HasFatalFailure()) return;
    }
    // Everything ends: nothing may be leaked.
    while (!seqs_.empty()) {
      ASSERT_TRUE(m_.free_sequence(seqs_.begin()->first).ok());
      seqs_.erase(seqs_.begin());
      verify();
      if (::testing::Test::HasFatalFailure()) return;
    }
    const kv_metrics km = m_.metrics();
    EXPECT_EQ(km.n_blocks_used, 0);
    EXPECT_EQ(km.n_stored_tokens, 0);
    for (const kv_group_usage& g : km.groups) {
      EXPECT_EQ(g.n_used, 0);
      EXPECT_EQ(g.n_stored_tokens, 0);
      EXPECT_EQ(g.n_free + g.n_cached, g.n_blocks);
    }
    EXPECT_EQ(km.n_blocks_free + km.n_blocks_cached, km.n_blocks_total);
    EXPECT_EQ(m_.n_takeable_blocks(), km.n_blocks_total);
    for (std::int32_t c = 0; c < m_.n_classes(); ++c) EXPECT_EQ(m_.n_takeable_blocks(c), m_.pool().class_size(c));
    EXPECT_EQ(km.n_preemptions, n_preemptions_);
    EXPECT_EQ(km.n_cow_copies, n_copies_);
    EXPECT_EQ(km.n_evictions, n_evict_ops_);
    EXPECT_EQ(km.n_prefix_hit_tokens, n_hit_tokens_);
    for (const tenant_kv_usage& t : km.tenants) EXPECT_EQ(t.n_used_blocks, 0) << t.name;
    // The run must have exercised what it claims to.
    EXPECT_GT(n_allocate_failures_, 0);
    if (m_.prefix_caching_enabled()) {
      EXPECT_GT(km.n_evictions, 0);
      EXPECT_GT(n_hit_tokens_, 0);
    }
    if (bs_ > 1) {
      EXPECT_GT(n_copies_, 0);  // a block of one token is never partly filled
      EXPECT_GT(n_truncate_ops_, 0);
    }
    EXPECT_GT(n_truncates_, 0);
    if (m_.n_classes() > 1) {
      EXPECT_GT(n_class_blocks_, 0);
      if (m_.prefix_caching_enabled()) {
        EXPECT_GT(n_class_hits_, 0);
      }
    }
    EXPECT_GT(n_drops_, 0);
    if (!shadow_) {
      EXPECT_GT(n_compactions_, 0);
    }
    if (merged_) {
      EXPECT_GT(merged_->n_retained_checked(), 0);
      EXPECT_GT(merged_->n_merged_checked(), 0);
      ::testing::Test::RecordProperty("merged_slots_checked", static_cast<int>(merged_->n_merged_checked()));
      ::testing::Test::RecordProperty("retained_slots_checked", static_cast<int>(merged_->n_retained_checked()));
    }
    if (shadow_) {
      EXPECT_GT(shadow_->n_compared(), 0);
      EXPECT_GT(shadow_->n_rollbacks_compared(), 0) << "no block rolled back inside was compared";
      ::testing::Test::RecordProperty("sealed_rollbacks_compared", static_cast<int>(shadow_->n_rollbacks_compared()));
    }
    if (!m_.has_sliding_window()) {  // the engine refuses speculation beside a window
      EXPECT_GT(n_verifies_, 0);
      EXPECT_GT(n_rejected_blocks_, 0);  // a rejected tail reached past the last kept block
    }
    if (m_.has_sliding_window()) {
      EXPECT_GT(n_window_checked_, 0);
      const kv_group_usage& w = km.groups.back();
      EXPECT_GT(w.n_freed_out_of_window, 0);
      if (m_.prefix_caching_enabled()) {
        EXPECT_GT(w.n_evictions, 0);  // the window's cached blocks made room for new ones
      }
    }
    ::testing::Test::RecordProperty("allocate_failures", static_cast<int>(n_allocate_failures_));
    ::testing::Test::RecordProperty("preemptions", static_cast<int>(km.n_preemptions));
    ::testing::Test::RecordProperty("evictions", static_cast<int>(km.n_evictions));
    ::testing::Test::RecordProperty("cow_copies", static_cast<int>(km.n_cow_copies));
    ::testing::Test::RecordProperty("hit_tokens", static_cast<int>(km.n_prefix_hit_tokens));
    ::testing::Test::RecordProperty("peak_used", km.n_blocks_used_peak);
  }

 private:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  std::optional<seq_id> random_seq() {
    if (seqs_.empty()) return std::nullopt;
    auto it = seqs_.begin();
    std::advance(it, uniform(0, static_cast<int>(seqs_.size()) - 1));
    return it->first;
  }

  std::size_t at(block_id b, std::int64_t i) const {
    return static_cast<std::size_t>(b.value) * static_cast<std::size_t>(bs_) + static_cast<std::size_t>(i);
  }
  token_id& slot(block_id b, std::int64_t i) { return kv_[at(b, i)]; }

  // The tensors' side of the block ops.
  static constexpr token_id k_poison = -7;
  const kv_group& group_of(block_id b) const { return m_.group(m_.group_of(b)); }

  void apply(const kv_op& op) {
    if ((shadow_ || merged_) && (op.kind == kv_op_kind::cache || op.kind == kv_op_kind::evict)) {
      // A full block the cache keeps or gives up: its bytes hold its tokens.
      std::vector<std::int32_t> positions;
      for (std::int32_t i = 0; i < bs_; ++i) positions.push_back(pos_[at(op.block, i)]);
      if (shadow_) EXPECT_TRUE(shadow_->holds_plain_bytes(op.block, op.tokens, positions)) << "op " << op_ << " (" << op_name_ << ")";
      if (merged_) EXPECT_TRUE(merged_->holds(op.block, op.tokens, positions)) << "op " << op_ << " (" << op_name_ << ")";
    }
    if (shadow_) shadow_->apply(op);
    if (merged_) merged_->apply(op);
    switch (op.kind) {
      case kv_op_kind::copy:
        ++n_copies_;
        for (std::int32_t i = 0; i < op.n_tokens; ++i) {
          kv_[at(op.block, i)] = kv_[at(op.src, i)];
          pos_[at(op.block, i)] = pos_[at(op.src, i)];
          tentative_[at(op.block, i)] = tentative_[at(op.src, i)];
        }
        break;
      case kv_op_kind::truncate:
        ++n_truncate_ops_;
        for (std::int32_t i = op.n_tokens; i < bs_; ++i) poison(op.block, i);
        break;
      case kv_op_kind::release:
        for (std::int32_t i = 0; i < bs_; ++i) poison(op.block, i);
        break;
      case kv_op_kind::evict:
        ++n_evict_ops_;
        EXPECT_EQ(op.tokens.size(), static_cast<std::size_t>(bs_));
        for (std::int32_t i = 0; i < bs_ && i < static_cast<std::int32_t>(op.tokens.size()); ++i)
          EXPECT_EQ(kv_[at(op.block, i)], op.tokens[static_cast<std::size_t>(i)]) << "evicted block " << op.block.value;
        for (std::int32_t i = 0; i < bs_; ++i) EXPECT_FALSE(tentative_[at(op.block, i)]) << "evicted block " << op.block.value << " held a rejected draft";
        for (std::int32_t i = 0; i < bs_; ++i) poison(op.block, i);
        break;
      case kv_op_kind::gather: {
        // Sources are read before anything is written (in place), and no
        // rewritten block may be read by another table or the cache. A source
        // of -1 (a window no longer holds it) leaves a dead slot.
        const kv_gather& g = *op.gather;
        EXPECT_EQ(g.group, op.group);
        std::vector<std::pair<token_id, std::int32_t>> moved;  // gathers run between steps: nothing is tentative
        for (std::size_t i = 0; i < tentative_.size(); ++i) EXPECT_FALSE(tentative_[i]) << "gather beside a tentative slot";
        for (int i = 0; i < g.n; ++i) {
          const std::int32_t src = g.sources[static_cast<std::size_t>(i)];
          if (src < 0) {
            moved.emplace_back(k_poison, -1);
            continue;
          }
          const block_id b = g.src_table[static_cast<std::size_t>(src / bs_)];
          EXPECT_TRUE(b.valid()) << "gather reads slot " << src << " of a NULL entry";
          moved.emplace_back(slot(b, src % bs_), pos_[at(b, src % bs_)]);
        }
        for (int i = 0; i < g.n; ++i) {
          const std::int32_t d = g.first + i;
          const block_id b = g.dst_table[static_cast<std::size_t>(d / bs_)];
          EXPECT_EQ(m_.group_of(b), op.group);
          EXPECT_EQ(group_of(b).ref_count(b), 1) << "gather writes shared block " << b.value;
          EXPECT_FALSE(group_of(b).is_hashed(b)) << "gather writes cached block " << b.value;
          slot(b, d % bs_) = moved[static_cast<std::size_t>(i)].first;
          pos_[at(b, d % bs_)] = moved[static_cast<std::size_t>(i)].second;
        }
        break;
      }
      case kv_op_kind::cache:
        // Committed to the prefix cache: its slots hold exactly the tokens named.
        EXPECT_EQ(op.tokens.size(), static_cast<std::size_t>(bs_));
        for (std::int32_t i = 0; i < bs_ && i < static_cast<std::int32_t>(op.tokens.size()); ++i)
          EXPECT_EQ(kv_[at(op.block, i)], op.tokens[static_cast<std::size_t>(i)]) << "cached block " << op.block.value;
        // What the commit hook would hand the store: never a rejected draft.
        for (std::int32_t i = 0; i < bs_; ++i)
          EXPECT_FALSE(tentative_[at(op.block, i)]) << "op " << op_ << ": cached block " << op.block.value << " holds a rejected draft at slot " << i;
        for (const block_id b : rejected_blocks_) EXPECT_NE(b, op.block) << "op " << op_ << ": a block that held a rejected draft was cached";
        break;
    }
  }

  void poison(block_id b, std::int32_t i) {
    kv_[at(b, i)] = k_poison;
    tentative_[at(b, i)] = false;
  }

  void op_add() {
    if (seqs_.size() >= 16) return;
    std::vector<token_id> prompt = prefixes_[static_cast<std::size_t>(uniform(0, 3))];
    const std::size_t prefix_len = prompt.size();
    const int n_suffix = uniform(1, 2 * bs_);
    for (int i = 0; i < n_suffix; ++i) prompt.push_back(static_cast<token_id>(uniform(0, 5)));
    static const char* const k_tenants[] = {"", "", "t1", "t2"};
    static const char* const k_salts[] = {"", "", "", "s"};
    live_seq s;
    s.tenant = k_tenants[uniform(0, 3)];
    s.salt = k_salts[uniform(0, 3)];
    s.runs = random_runs(static_cast<std::int32_t>(prompt.size()), static_cast<std::int32_t>(prefix_len));
    s.n_prompt = prompt.size();
    s.max_tokens = prompt.size() + static_cast<std::size_t>(uniform(1, 3 * bs_));
    add(seq_id(next_id_++), std::move(s), prompt);
  }

  // No runs (with one class always), the whole shared prefix in class 1, a
  // run of the last class from inside the first block, or random runs.
  std::vector<kv_class_run> random_runs(std::int32_t n_prompt, std::int32_t n_prefix) {
    const std::int32_t n_classes = m_.n_classes();
    if (n_classes == 1) return {};
    std::vector<kv_class_run> runs;
    switch (uniform(0, 3)) {
      case 0:
        break;
      case 1:
        if (n_prefix > 0) runs.push_back({0, n_prefix, 1});
        break;
      case 2:
        runs.push_back({std::min(bs_ / 2, n_prompt - 1), n_prompt, static_cast<std::uint8_t>(n_classes - 1)});
        break;
      default:
        for (std::int32_t p = 0; p < n_prompt;) {
          const std::int32_t end = std::min(n_prompt, p + uniform(1, 3 * bs_));
          if (uniform(0, 2) > 0) runs.push_back({p, end, static_cast<std::uint8_t>(uniform(0, n_classes - 1))});
          p = end + uniform(0, bs_);
        }
    }
    return runs;
  }

  void add(seq_id id, live_seq s, std::span<const token_id> prompt) {
    s.refresh();
    const auto cached = m_.add_sequence(id, prompt, s.options);
    ASSERT_TRUE(cached.ok()) << cached.error().message();
    ASSERT_EQ(*cached % bs_, 0);
    ASSERT_LE(*cached, static_cast<std::int32_t>((prompt.size() - 1) / static_cast<std::size_t>(bs_)) * bs_);
    ASSERT_EQ(m_.n_stored_tokens(id), *cached);
    if (!m_.prefix_caching_enabled()) {
      ASSERT_EQ(*cached, 0);
    }
    n_hit_tokens_ += *cached;
    for (const block_id b : m_.block_table(id)) n_class_hits_ += b.valid() && m_.block_class(b) != 0 ? 1 : 0;
    s.n_fed = *cached;
    s.next_position = *cached;
    auto [it, inserted] = seqs_.emplace(id, std::move(s));
    ASSERT_TRUE(inserted);
    it->second.refresh();
  }

  void op_step() {
    const auto id = random_seq();
    if (!id) return;
    live_seq& s = seqs_.at(*id);
    const auto n_stored = static_cast<std::size_t>(m_.n_stored_tokens(*id));
    const std::size_t n_known = m_.tokens(*id).size();
    if (n_stored >= s.max_tokens) {
      op_finish_seq(*id);
      return;
    }
    // A prompt chunk of random size, or one decode token.
    const int n = n_stored < n_known ? std::min(uniform(1, 2 * bs_), static_cast<int>(n_known - n_stored)) : 1;

    const std::vector<block_id> table_before(m_.block_table(*id).begin(), m_.block_table(*id).end());
    const kv_metrics before = m_.metrics();
    const std::int32_t needed = m_.n_blocks_needed(*id, n);
    const bool could = m_.can_allocate(*id, n);
    const auto a = m_.allocate(*id, n);
    ASSERT_EQ(a.has_value(), could);
    if (!a) {
      ++n_allocate_failures_;
      const std::vector<block_id> table_after(m_.block_table(*id).begin(), m_.block_table(*id).end());
      ASSERT_EQ(table_after, table_before);
      const kv_metrics after = m_.metrics();
      ASSERT_EQ(after.n_blocks_used, before.n_blocks_used);
      ASSERT_EQ(after.n_blocks_cached, before.n_blocks_cached);
      ASSERT_EQ(after.n_evictions, before.n_evictions);
      ASSERT_EQ(after.n_stored_tokens, before.n_stored_tokens);
      // What a scheduler does: preempt someone (maybe this one) to make room.
      if (uniform(0, 1) == 0) op_preempt(random_seq());
      return;
    }
    // Every block taken is new to the used set (a copy's source stays used by
    // its other holders, or cached). The copy itself arrived as a block op.
    // Every group appends as many entries; each copies at most once.
    const kv_metrics after = m_.metrics();
    std::int32_t grown = 0;
    for (std::size_t g = 0; g < after.groups.size(); ++g) grown += after.groups[g].n_used - before.groups[g].n_used;
    ASSERT_GE(grown, needed - static_cast<std::int32_t>(a->copies.size()));
    ASSERT_LE(grown, needed);
    // A window's NULL partial block (compacted out of its window) takes a fresh block without a copy.
    const std::int32_t refills = needed - a->n_new_blocks * m_.n_groups() - static_cast<std::int32_t>(a->copies.size());
    ASSERT_GE(refills, 0);
    ASSERT_LE(refills, m_.has_sliding_window() ? m_.n_groups() : 0);
    ASSERT_LE(a->copies.size(), static_cast<std::size_t>(m_.n_groups()));
    check_new_classes(*id, table_before, *a);
    // The model writes K/V of the n tokens at their slots, at increasing
    // positions (sometimes with gaps, as after a position shift).
    std::vector<token_id> written;
    std::vector<std::int32_t> positions;
    const auto stored_pos = m_.positions(*id);
    // Positions continue where the sequence's queries are, past dropped tokens too.
    const std::int64_t after_stored = stored_pos.empty() ? 0 : stored_pos.back() + 1;
    std::int32_t next_pos = static_cast<std::int32_t>(std::max<std::int64_t>(after_stored, s.next_position));
    const bool consecutive = next_pos == after_stored;  // commit's own positions would do
    const bool gaps = uniform(0, 3) == 0;
    for (int i = 0; i < n; ++i) {
      const std::size_t p = n_stored + static_cast<std::size_t>(i);
      const token_id t = p < n_known ? m_.tokens(*id)[p] : static_cast<token_id>(uniform(0, 5));
      const auto off = static_cast<std::int64_t>(p % static_cast<std::size_t>(bs_));
      for (std::int32_t g = 0; g < m_.n_groups(); ++g) {  // every group's layers
        const block_id b = m_.block_table(*id, g)[p / static_cast<std::size_t>(bs_)];
        ASSERT_TRUE(b.valid()) << "op " << op_ << ": a write into a NULL entry of group " << g;
        slot(b, off) = t;
        pos_[at(b, off)] = next_pos;
        if (shadow_) shadow_->write(b, static_cast<std::int32_t>(off), t, next_pos);
        if (merged_) merged_->write(b, static_cast<std::int32_t>(off), t, next_pos);
      }
      written.push_back(t);
      positions.push_back(next_pos);
      next_pos += gaps ? uniform(1, 3) : 1;
    }
    const status st = gaps || !consecutive ? m_.commit(*id, written, positions) : m_.commit(*id, written);
    ASSERT_TRUE(st.ok()) << st.message();
    s.n_fed += n;
    s.next_position = positions.back() + 1;
    // The scheduler gives up what the next query cannot see (sometimes late).
    if (m_.has_sliding_window() && uniform(0, 3) > 0) {
      ASSERT_TRUE(m_.release_window(*id, s.next_position).ok());
    }
  }

  // A speculative verification step, in scheduler::commit_verified's calls:
  // slots for the last sampled token and k drafts, K/V written into all of
  // them, the verified prefix (the last token and the accepted drafts)
  // committed, the rest truncated. Only when the prompt is done, and not
  // beside a sliding window (the engine refuses speculation there). With the
  // sealed shadow, the drafts' blocks are held until the rollback is done.
  void op_verify() {
    const auto id = random_seq();
    if (!id || m_.has_sliding_window()) return;
    live_seq& s = seqs_.at(*id);
    const std::int32_t n_stored = m_.n_stored_tokens(*id);
    if (static_cast<std::size_t>(n_stored) != m_.tokens(*id).size()) return;  // still prefilling
    const int k = std::min(uniform(1, bs_ + 2), static_cast<int>(s.max_tokens) - n_stored - 1);
    if (k < 1) return;
    const int n = 1 + k;
    const kv_metrics before = m_.metrics();
    const std::vector<block_id> table_before(m_.block_table(*id).begin(), m_.block_table(*id).end());
    const auto a = m_.allocate(*id, n);
    if (!a) {
      ++n_allocate_failures_;
      ASSERT_EQ(std::vector<block_id>(m_.block_table(*id).begin(), m_.block_table(*id).end()), table_before);
      ASSERT_EQ(m_.metrics().n_blocks_used, before.n_blocks_used);
      return;
    }
    check_new_classes(*id, table_before, *a);
    const int n_keep = 1 + uniform(0, k);  // the last token and the accepted drafts
    const auto stored_pos = m_.positions(*id);
    const std::int64_t after_stored = stored_pos.empty() ? 0 : stored_pos.back() + 1;
    const auto first_pos = static_cast<std::int32_t>(std::max<std::int64_t>(after_stored, s.next_position));
    std::vector<token_id> tokens;
    std::vector<std::int32_t> positions;
    rejected_blocks_.clear();
    for (int i = 1; i < n && shadow_; ++i)  // the drafts' blocks, as the runner holds them
      shadow_->hold(m_.block_table(*id)[static_cast<std::size_t>((n_stored + i) / bs_)]);
    for (int i = 0; i < n; ++i) {
      const token_id t = static_cast<token_id>(uniform(0, 5));
      const std::int64_t p = n_stored + i;
      for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
        const block_id b = m_.block_table(*id, g)[static_cast<std::size_t>(p / bs_)];
        ASSERT_TRUE(b.valid()) << "op " << op_ << ": a draft written into a NULL entry of group " << g;
        slot(b, p % bs_) = t;
        pos_[at(b, p % bs_)] = first_pos + i;
        tentative_[at(b, p % bs_)] = i >= n_keep;
        if (shadow_) shadow_->write(b, static_cast<std::int32_t>(p % bs_), t, first_pos + i);
        if (merged_) merged_->write(b, static_cast<std::int32_t>(p % bs_), t, first_pos + i);
        if (i >= n_keep && (rejected_blocks_.empty() || rejected_blocks_.back() != b)) rejected_blocks_.push_back(b);
      }
      tokens.push_back(t);
      positions.push_back(first_pos + i);
    }
    const std::size_t n_keep_z = static_cast<std::size_t>(n_keep);
    status st = m_.commit(*id, std::span(tokens).first(n_keep_z), std::span(positions).first(n_keep_z));
    ASSERT_TRUE(st.ok()) << st.message();
    st = m_.truncate(*id, m_.n_stored_tokens(*id));
    ASSERT_TRUE(st.ok()) << st.message();
    if (shadow_) shadow_->end_holds();  // the runner's next step: after the rollback ops
    s.n_fed += n_keep;
    s.next_position = positions[n_keep_z - 1] + 1;
    ++n_verifies_;
    if ((n_stored + n - 1) / bs_ > (n_stored + n_keep - 1) / bs_) ++n_rejected_blocks_;
    // The sequence holds the verified tokens alone, and no block past them.
    ASSERT_EQ(m_.n_stored_tokens(*id), n_stored + n_keep) << "op " << op_;
    const auto held = m_.tokens(*id);
    ASSERT_TRUE(std::equal(tokens.begin(), tokens.begin() + n_keep, held.end() - n_keep)) << "op " << op_;
    for (std::int32_t g = 0; g < m_.n_groups(); ++g)
      ASSERT_EQ(m_.block_table(*id, g).size(), static_cast<std::size_t>((n_stored + n_keep + bs_ - 1) / bs_))
          << "op " << op_ << " group " << g;
    // Every rejected slot was given up (rewound or released)...
    for (std::size_t i = 0; i < tentative_.size(); ++i)
      ASSERT_FALSE(tentative_[i]) << "op " << op_ << ": block " << i / static_cast<std::size_t>(bs_) << " slot "
                                  << i % static_cast<std::size_t>(bs_) << " still holds a rejected draft";
    // ...and no block that held one is indexed or hashed (apply() saw no cache op for it).
    for (const block_id b : rejected_blocks_) {
      const kv_group& grp = group_of(b);
      ASSERT_FALSE(grp.index().contains(block_id(b.value - grp.first_block()))) << "op " << op_ << " block " << b.value;
      ASSERT_FALSE(grp.is_hashed(b)) << "op " << op_ << " block " << b.value;
    }
    // No block leaked: each group's used blocks are exactly the ones some table holds.
    const kv_metrics after = m_.metrics();
    for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
      std::vector<std::int32_t> in_tables;
      for (const auto& [other, unused] : seqs_)
        for (const block_id b : m_.block_table(other, g))
          if (b.valid()) in_tables.push_back(b.value);
      std::sort(in_tables.begin(), in_tables.end());
      in_tables.erase(std::unique(in_tables.begin(), in_tables.end()), in_tables.end());
      ASSERT_EQ(after.groups[static_cast<std::size_t>(g)].n_used, static_cast<std::int32_t>(in_tables.size()))
          << "op " << op_ << " group " << g;
    }
    rejected_blocks_.clear();
  }

  // A copy is of its source's class; an appended block of the class the runs
  // give the tokens its slots take (the ones fed next: token n_fed, ...),
  // whatever their positions; the same in every group.
  void check_new_classes(seq_id id, const std::vector<block_id>& table_before, const allocation& a) {
    for (const block_copy& c : a.copies) ASSERT_EQ(m_.block_class(c.dst), m_.block_class(c.src)) << "op " << op_;
    const std::int64_t n_stored = m_.n_stored_tokens(id);
    const live_seq& s = seqs_.at(id);
    for (std::size_t i = table_before.size(); i < m_.block_table(id).size(); ++i) {
      std::vector<std::int64_t> tokens_at(static_cast<std::size_t>(bs_));
      for (std::int32_t k = 0; k < bs_; ++k)
        tokens_at[static_cast<std::size_t>(k)] = s.n_fed + static_cast<std::int64_t>(i) * bs_ + k - n_stored;
      const std::int32_t want = rule_class(s.runs, tokens_at);
      for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
        const block_id b = m_.block_table(id, g)[i];
        ASSERT_TRUE(b.valid());
        ASSERT_EQ(m_.block_class(b), want) << "op " << op_ << " seq " << id.value << " block " << i << " group " << g;
      }
      n_class_blocks_ += want != 0 ? 1 : 0;
    }
  }

  // A policy frees some full blocks from anywhere in the table.
  void op_drop() {
    const auto id = random_seq();
    if (!id) return;
    const std::int32_t n_full = m_.n_stored_tokens(*id) / bs_;
    if (n_full == 0) {
      const std::int32_t bad[] = {0};
      ASSERT_FALSE(m_.drop(*id, bad).ok());
      return;
    }
    std::vector<std::int32_t> picked;
    for (std::int32_t i = 0; i < n_full; ++i)
      if (uniform(0, 2) == 0) picked.push_back(i);
    std::shuffle(picked.begin(), picked.end(), rng_);
    const std::int32_t n_before = m_.n_stored_tokens(*id);
    const status st = m_.drop(*id, picked);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(m_.n_stored_tokens(*id), n_before - static_cast<std::int32_t>(picked.size()) * bs_);
    ++n_drops_;
  }

  // Speculation rolls back its tail (sometimes into a shared or cached block).
  void op_truncate() {
    const auto id = random_seq();
    if (!id) return;
    const std::int32_t n_stored = m_.n_stored_tokens(*id);
    ASSERT_FALSE(m_.truncate(*id, n_stored + 1).ok());
    const std::int32_t keep = std::max(0, n_stored - uniform(0, 2 * bs_));
    const std::vector<block_id> table_before(m_.block_table(*id).begin(), m_.block_table(*id).end());
    const status st = m_.truncate(*id, keep);
    if (m_.has_sliding_window() && st.code() == errc::out_of_range) {  // it would need window K/V already given up
      ASSERT_EQ(std::vector<block_id>(m_.block_table(*id).begin(), m_.block_table(*id).end()), table_before);
      ASSERT_EQ(m_.n_stored_tokens(*id), n_stored);
      return;
    }
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(m_.n_stored_tokens(*id), keep);
    seqs_.at(*id).n_fed -= n_stored - keep;
    seqs_.at(*id).next_position = keep > 0 ? m_.positions(*id)[static_cast<std::size_t>(keep) - 1] + 1 : 0;
    ++n_truncates_;
  }

  // A token-granular policy keeps a random subset of the stored slots (always
  // a leading run untouched, as sinks are), compacted to the front.
  void op_compact() {
    const auto id = random_seq();
    if (!id || shadow_) return;
    const std::int32_t n_stored = m_.n_stored_tokens(*id);
    if (n_stored < 2) return;
    std::vector<std::int32_t> keep;
    const std::int32_t lead = uniform(0, n_stored / 2);
    for (std::int32_t i = 0; i < n_stored; ++i)
      if (i < lead || uniform(0, 2) == 0) keep.push_back(i);
    if (keep.empty()) keep.push_back(n_stored - 1);
    std::int32_t first = 0;
    while (first < static_cast<std::int32_t>(keep.size()) && keep[static_cast<std::size_t>(first)] == first) ++first;
    kv_compaction c;
    c.first = first;
    c.n_slots = static_cast<std::int32_t>(keep.size());
    if (uniform(0, 1) == 0) c.next_position = seqs_.at(*id).next_position;  // else the manager's estimate
    c.gather = std::make_shared<kv_gather>();
    const auto tokens = m_.tokens(*id);
    const auto positions = m_.positions(*id);
    for (std::size_t i = static_cast<std::size_t>(first); i < keep.size(); ++i) {
      c.tokens.push_back(tokens[static_cast<std::size_t>(keep[i])]);
      c.positions.push_back(positions[static_cast<std::size_t>(keep[i])]);
      c.gather->sources.push_back(keep[i]);
    }
    const kv_metrics before = m_.metrics();
    const std::vector<block_id> table_before(m_.block_table(*id).begin(), m_.block_table(*id).end());
    const status st = m_.compact(*id, c);
    if (!st.ok()) {  // a shared block needed a copy and the pool had none: nothing changed
      ASSERT_EQ(st.code(), errc::resource_exhausted) << st.message();
      ASSERT_EQ(std::vector<block_id>(m_.block_table(*id).begin(), m_.block_table(*id).end()), table_before);
      ASSERT_EQ(m_.metrics().n_blocks_used, before.n_blocks_used);
      return;
    }
    ASSERT_EQ(m_.n_stored_tokens(*id), c.n_slots);
    ASSERT_EQ(m_.block_table(*id).size(), static_cast<std::size_t>((c.n_slots + bs_ - 1) / bs_));
    ++n_compactions_;
  }

  void op_fork() {
    const auto id = random_seq();
    if (!id || seqs_.size() >= 16) return;
    const std::int32_t n_stored = m_.n_stored_tokens(*id);
    const seq_id child(next_id_++);
    const status st = m_.fork(*id, child);
    // Refused only for a parent with no stored tokens yet... which has no blocks,
    // or that holds slots past them (never here: every allocate is committed).
    ASSERT_TRUE(st.ok()) << st.message();
    live_seq c = seqs_.at(*id);
    ASSERT_EQ(m_.n_stored_tokens(child), n_stored);
    seqs_.emplace(child, std::move(c));
    seqs_.at(child).refresh();
  }

  void op_finish() {
    if (const auto id = random_seq()) op_finish_seq(*id);
  }

  void op_finish_seq(seq_id id) {
    ASSERT_TRUE(m_.free_sequence(id).ok());
    seqs_.erase(id);
  }

  // Free, then re-add with everything known so far as the prompt.
  void op_preempt(std::optional<seq_id> id) {
    if (!id) return;
    const std::vector<token_id> all(m_.tokens(*id).begin(), m_.tokens(*id).end());
    if (all.empty()) {  // truncated to nothing: there is no prompt to come back with
      op_finish_seq(*id);
      return;
    }
    live_seq s = seqs_.at(*id);
    seqs_.erase(*id);
    ASSERT_TRUE(m_.preempt_sequence(*id).ok());
    ++n_preemptions_;
    s.max_tokens = std::max(s.max_tokens, all.size() + 1);
    // A truncate may have cut into the prompt: runs end inside the new one.
    const auto n_all = static_cast<std::int32_t>(all.size());
    std::erase_if(s.runs, [&](const kv_class_run& r) { return r.begin >= n_all; });
    for (kv_class_run& r : s.runs) r.end = std::min(r.end, n_all);
    add(*id, std::move(s), all);
  }

  void op_quota() {
    static const char* const k_names[] = {"t1", "t2"};
    const char* name = k_names[uniform(0, 1)];
    const int q = uniform(-1, m_.n_blocks());
    const std::optional<std::int32_t> quota = q < 2 ? std::nullopt : std::optional<std::int32_t>(q);
    ASSERT_TRUE(m_.set_tenant_quota(name, quota).ok());
  }

  void op_fits() {
    const int n_prompt = uniform(1, m_.n_blocks() * bs_);
    const int n_new = uniform(0, m_.n_blocks() * bs_);
    const std::vector<kv_class_run> runs = random_runs(n_prompt, uniform(0, n_prompt));
    const status st = m_.check_request_fits(n_prompt, n_new, "", 1, runs);
    const int n_blocks = (n_prompt + n_new + bs_ - 1) / bs_;
    const bool full0 = m_.group(0).kind() == kv_group_kind::full;
    bool fits = !full0 || n_blocks <= m_.n_blocks();
    // A sliding window holds at most its window, a step's blocks (at most
    // k_max_step tokens) and its open block.
    for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
      const kv_group& grp = m_.group(g);
      if (grp.kind() != kv_group_kind::sliding_window) continue;
      const int held = std::min(n_blocks, (grp.window_tokens() + bs_ - 1) / bs_ + (k_max_step(bs_) + bs_ - 1) / bs_ + 2);
      fits = fits && held <= grp.n_blocks();
    }
    std::vector<std::int32_t> per_class(static_cast<std::size_t>(m_.n_classes()), 0);
    for (int i = 0; i < n_blocks; ++i) {
      std::vector<std::int64_t> slots_at(static_cast<std::size_t>(bs_));
      std::iota(slots_at.begin(), slots_at.end(), static_cast<std::int64_t>(i) * bs_);
      ++per_class[static_cast<std::size_t>(rule_class(runs, slots_at))];
    }
    for (std::int32_t c = 0; c < m_.n_classes() && full0; ++c)
      fits = fits && per_class[static_cast<std::size_t>(c)] <= m_.pool().class_size(c);
    ASSERT_EQ(st.ok(), fits) << st.message();
  }

  void verify() {
    const status st = m_.check_invariants();
    ASSERT_TRUE(st.ok()) << "op " << op_ << " (" << op_name_ << "): " << st.message();
    const kv_metrics km = m_.metrics();
    ASSERT_EQ(km.n_blocks_free + km.n_blocks_used + km.n_blocks_cached, km.n_blocks_total);
    ASSERT_EQ(static_cast<std::size_t>(km.n_sequences), seqs_.size());
    ASSERT_EQ(km.classes.size(), static_cast<std::size_t>(m_.n_classes()));
    kv_class_usage sum;
    for (std::size_t c = 0; c < km.classes.size(); ++c) {
      const kv_class_usage& k = km.classes[c];
      ASSERT_EQ(k.n_used + k.n_cached + k.n_free, k.n_blocks) << "op " << op_ << " class " << c;
      ASSERT_EQ(m_.n_takeable_blocks(static_cast<std::int32_t>(c)), k.n_free + k.n_cached);
      sum = {sum.n_blocks + k.n_blocks, sum.n_used + k.n_used, sum.n_cached + k.n_cached, sum.n_free + k.n_free};
    }
    ASSERT_EQ(sum.n_blocks, km.n_blocks_total);
    ASSERT_EQ(sum.n_used, km.n_blocks_used);
    ASSERT_EQ(sum.n_cached, km.n_blocks_cached);
    ASSERT_EQ(sum.n_free, km.n_blocks_free);
    // Every stored token reads back from the slot its table names (group 0's,
    // when it keeps every position; verify_groups reads the others).
    for (const auto& [id, s] : seqs_) {
      if (m_.group(0).kind() != kv_group_kind::full) break;
      const auto table = m_.block_table(id);
      const auto tokens = m_.tokens(id);
      const auto positions = m_.positions(id);
      const std::int32_t n_stored = m_.n_stored_tokens(id);
      ASSERT_EQ(positions.size(), static_cast<std::size_t>(n_stored));
      for (std::int32_t p = 0; p < n_stored; ++p) {
        const block_id b = table[static_cast<std::size_t>(p / bs_)];
        ASSERT_EQ(slot(b, p % bs_), tokens[static_cast<std::size_t>(p)])
            << "op " << op_ << " seq " << id.value << " slot " << p;
        ASSERT_EQ(pos_[at(b, p % bs_)], positions[static_cast<std::size_t>(p)])
            << "op " << op_ << " seq " << id.value << " slot " << p;
      }
    }
    if (m_.n_groups() > 1 || m_.has_sliding_window()) verify_groups();
    if (merged_ && !seqs_.empty()) verify_merged(std::next(seqs_.begin(), op_ % static_cast<int>(seqs_.size()))->first);
    // Every indexed block of every group holds what the index says (cached ones included).
    for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
      const kv_group& grp = m_.group(g);
      for (std::int32_t b = 0; b < grp.n_blocks(); ++b) {
        if (!grp.index().contains(block_id(b))) continue;
        const auto held = grp.index().tokens_of(block_id(b));
        for (std::int32_t i = 0; i < bs_; ++i) {
          ASSERT_EQ(slot(block_id(b + grp.first_block()), i), held[static_cast<std::size_t>(i)])
              << "op " << op_ << " group " << g << " block " << b;
        }
      }
    }
  }

  // Every block of one sequence in the MiniCache storage: what its tokens'
  // rows in each layer make, merged or retained.
  void verify_merged(seq_id id) {
    const auto table = m_.block_table(id);
    const auto tokens = m_.tokens(id);
    const auto positions = m_.positions(id);
    const auto n_stored = static_cast<std::size_t>(m_.n_stored_tokens(id));
    for (std::size_t i = 0; i * static_cast<std::size_t>(bs_) < n_stored; ++i) {
      const std::size_t first = i * static_cast<std::size_t>(bs_);
      const std::size_t n = std::min(n_stored - first, static_cast<std::size_t>(bs_));
      ASSERT_TRUE(merged_->holds(table[i], tokens.subspan(first, n), positions.subspan(first, n)))
          << "op " << op_ << " (" << op_name_ << ") seq " << id.value << " block " << i;
    }
  }

  // Every group's table: a full group holds every stored token, a sliding
  // window every token the next query of the sequence sees (the others' blocks
  // may be NULL, or hold tokens nobody reads).
  void verify_groups() {
    for (const auto& [id, s] : seqs_) {
      const auto tokens = m_.tokens(id);
      const auto positions = m_.positions(id);
      const std::int64_t next = s.next_position;
      for (std::int32_t g = 0; g < m_.n_groups(); ++g) {
        const kv_group& grp = m_.group(g);
        const auto table = m_.block_table(id, g);
        for (std::size_t p = 0; p < positions.size(); ++p) {
          const bool windowed = grp.kind() == kv_group_kind::sliding_window;
          if (windowed && positions[p] <= next - grp.window_tokens()) continue;
          const block_id b = table[p / static_cast<std::size_t>(bs_)];
          ASSERT_TRUE(b.valid()) << "op " << op_ << " (" << op_name_ << ") seq " << id.value << " group " << g << " slot " << p << ": NULL";
          const auto off = static_cast<std::int64_t>(p % static_cast<std::size_t>(bs_));
          ASSERT_EQ(slot(b, off), tokens[p]) << "op " << op_ << " (" << op_name_ << ") seq " << id.value << " group " << g << " slot " << p;
          ASSERT_EQ(pos_[at(b, off)], positions[p]) << "op " << op_ << " seq " << id.value << " group " << g << " slot " << p;
          if (windowed) ++n_window_checked_;
        }
      }
    }
  }

  std::mt19937 rng_;
  std::int32_t bs_;
  kv_manager m_;
  std::vector<token_id> kv_;  // simulated tensors: [n_blocks][block_size] token ids
  std::vector<std::int32_t> pos_;  // [n_blocks][block_size]: the position each slot was written at
  std::vector<bool> tentative_;  // [n_blocks][block_size]: holds a rejected draft (until rewound or released)
  std::vector<block_id> rejected_blocks_;  // during op_verify: the blocks rejected drafts were written into
  std::optional<test::sealed_shadow> shadow_;  // sealed scenarios
  std::optional<test::merged_shadow> merged_;  // MiniCache scenarios
  std::vector<std::vector<token_id>> prefixes_;
  std::map<seq_id, live_seq> seqs_;
  std::int64_t next_id_ = 1;
  int op_ = 0;
  const char* op_name_ = "";
  std::int64_t n_preemptions_ = 0;
  std::int64_t n_copies_ = 0;
  std::int64_t n_hit_tokens_ = 0;
  std::int64_t n_allocate_failures_ = 0;
  std::int64_t n_evict_ops_ = 0;
  std::int64_t n_truncate_ops_ = 0;
  std::int64_t n_drops_ = 0;
  std::int64_t n_truncates_ = 0;
  std::int64_t n_compactions_ = 0;
  std::int64_t n_verifies_ = 0;
  std::int64_t n_rejected_blocks_ = 0;  // rejected drafts written into blocks past the last kept one
  std::int64_t n_class_blocks_ = 0;  // blocks of a class other than 0 taken by allocate
  std::int64_t n_class_hits_ = 0;    // of those, served again from the prefix cache
  std::int64_t n_window_checked_ = 0;  // tokens read back from a sliding window's table
};

class kv_property : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(kv_property, random_operations_keep_every_invariant) {
  const std::uint32_t seed = GetParam();
  const scenario sc = scenario_for(seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " block_size " << sc.block_size << " n_blocks "
                                    << sc.n_blocks << " prefix_caching " << sc.prefix_caching << " window "
                                    << sc.window_tokens << " window blocks " << sc.window_blocks << " classes "
                                    << sc.classes.size() << " eviction " << cache_eviction_name(sc.eviction) << " sealed " << sc.sealed
                                    << " merged " << sc.merged);
  harness h(seed, sc);
  h.run(5000);
}

INSTANTIATE_TEST_SUITE_P(seeds, kv_property, ::testing::Range(1u, 33u));

}  // namespace
}  // namespace pagoda
