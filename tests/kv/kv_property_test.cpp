// Property test: long random sequences of operations on one kv_manager (add with
// shared prefixes, salts and tenants; allocate + commit of prompt chunks and
// decode tokens; fork; free; preemption and re-add; allocation under pressure,
// which evicts; quota changes; cache resets), checking after every operation:
// - kv_manager::check_invariants() (counts add up, ref counts = table
//   memberships, tables valid and unique, index <-> hashed blocks, keys chain),
// - simulated tensors: every stored token of every sequence reads back from the
//   slot its block table names, and every cached block holds the tokens the
//   prefix index claims for it (so sharing, reuse and copy-on-write never hand
//   out wrong KV),
// - a failed allocate changed nothing,
// and at the end, with every sequence gone, no block is leaked.
#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_manager.h"

namespace pagoda {
namespace {

struct scenario {
  std::int32_t block_size;
  std::int32_t n_blocks;
  bool prefix_caching;
};

scenario scenario_for(std::uint32_t seed) {
  static const scenario k_scenarios[] = {{4, 48, true}, {1, 96, true}, {3, 64, true}, {16, 24, true}, {4, 48, false}};
  return k_scenarios[seed % std::size(k_scenarios)];
}

struct live_seq {
  sequence_options options;
  std::string tenant, salt;  // owned storage behind options
  std::size_t n_prompt = 0;
  std::size_t max_tokens = 0;
};

class harness {
 public:
  harness(std::uint32_t seed, const scenario& sc)
      : rng_(seed),
        bs_(sc.block_size),
        m_(sc.block_size, sc.n_blocks, sc.prefix_caching),
        kv_(static_cast<std::size_t>(sc.n_blocks) * static_cast<std::size_t>(sc.block_size), k_no_token) {
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
      if (r < 18) {
        op_add();
      } else if (r < 70) {
        op_step();
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
    EXPECT_EQ(km.n_blocks_free + km.n_blocks_cached, km.n_blocks_total);
    EXPECT_EQ(m_.n_free_blocks(), km.n_blocks_total);
    EXPECT_EQ(km.n_preemptions, n_preemptions_);
    EXPECT_EQ(km.n_cow_copies, n_copies_);
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

  token_id& slot(block_id b, std::int64_t i) {
    return kv_[static_cast<std::size_t>(b.value) * static_cast<std::size_t>(bs_) + static_cast<std::size_t>(i)];
  }

  void op_add() {
    if (seqs_.size() >= 16) return;
    std::vector<token_id> prompt = prefixes_[static_cast<std::size_t>(uniform(0, 3))];
    const int n_suffix = uniform(1, 2 * bs_);
    for (int i = 0; i < n_suffix; ++i) prompt.push_back(static_cast<token_id>(uniform(0, 5)));
    static const char* const k_tenants[] = {"", "", "t1", "t2"};
    static const char* const k_salts[] = {"", "", "", "s"};
    live_seq s;
    s.tenant = k_tenants[uniform(0, 3)];
    s.salt = k_salts[uniform(0, 3)];
    s.n_prompt = prompt.size();
    s.max_tokens = prompt.size() + static_cast<std::size_t>(uniform(1, 3 * bs_));
    add(seq_id(next_id_++), std::move(s), prompt);
  }

  void add(seq_id id, live_seq s, std::span<const token_id> prompt) {
    s.options.tenant = s.tenant;
    s.options.cache_salt = s.salt;
    const auto cached = m_.add_sequence(id, prompt, s.options);
    ASSERT_TRUE(cached.ok()) << cached.error().message();
    ASSERT_EQ(*cached % bs_, 0);
    ASSERT_LE(*cached, static_cast<std::int32_t>((prompt.size() - 1) / static_cast<std::size_t>(bs_)) * bs_);
    ASSERT_EQ(m_.n_stored_tokens(id), *cached);
    if (!m_.prefix_caching_enabled()) {
      ASSERT_EQ(*cached, 0);
    }
    n_hit_tokens_ += *cached;
    auto [it, inserted] = seqs_.emplace(id, std::move(s));
    ASSERT_TRUE(inserted);
    // options views point into the moved strings: refresh them.
    it->second.options.tenant = it->second.tenant;
    it->second.options.cache_salt = it->second.salt;
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
    // Every block taken is new to the used set (a copy's source stays used by its other holders).
    ASSERT_EQ(m_.metrics().n_blocks_used - before.n_blocks_used, needed);
    ASSERT_EQ(a->n_new_blocks + static_cast<std::int32_t>(a->copies.size()), needed);
    ASSERT_LE(a->copies.size(), 1u);
    for (const block_copy& c : a->copies) {
      ++n_copies_;
      for (std::int32_t i = 0; i < c.n_tokens; ++i) slot(c.dst, i) = slot(c.src, i);
    }
    // The model writes K/V of the n tokens at their slots.
    std::vector<token_id> written;
    const auto table = m_.block_table(*id);
    for (int i = 0; i < n; ++i) {
      const std::size_t pos = n_stored + static_cast<std::size_t>(i);
      const token_id t = pos < n_known ? m_.tokens(*id)[pos] : static_cast<token_id>(uniform(0, 5));
      slot(table[pos / static_cast<std::size_t>(bs_)], static_cast<std::int64_t>(pos % static_cast<std::size_t>(bs_))) = t;
      written.push_back(t);
    }
    const status st = m_.commit(*id, written);
    ASSERT_TRUE(st.ok()) << st.message();
    (void)s;
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
    auto& cs = seqs_.at(child);
    cs.options.tenant = cs.tenant;
    cs.options.cache_salt = cs.salt;
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
    live_seq s = seqs_.at(*id);
    seqs_.erase(*id);
    ASSERT_TRUE(m_.preempt_sequence(*id).ok());
    ++n_preemptions_;
    s.max_tokens = std::max(s.max_tokens, all.size() + 1);
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
    const status st = m_.check_request_fits(n_prompt, n_new);
    const bool fits = (n_prompt + n_new + bs_ - 1) / bs_ <= m_.n_blocks();
    ASSERT_EQ(st.ok(), fits) << st.message();
  }

  void verify() {
    const status st = m_.check_invariants();
    ASSERT_TRUE(st.ok()) << "op " << op_ << ": " << st.message();
    const kv_metrics km = m_.metrics();
    ASSERT_EQ(km.n_blocks_free + km.n_blocks_used + km.n_blocks_cached, km.n_blocks_total);
    ASSERT_EQ(static_cast<std::size_t>(km.n_sequences), seqs_.size());
    // Every stored token reads back from the slot its table names.
    for (const auto& [id, s] : seqs_) {
      const auto table = m_.block_table(id);
      const auto tokens = m_.tokens(id);
      const std::int32_t n_stored = m_.n_stored_tokens(id);
      for (std::int32_t p = 0; p < n_stored; ++p) {
        ASSERT_EQ(slot(table[static_cast<std::size_t>(p / bs_)], p % bs_), tokens[static_cast<std::size_t>(p)])
            << "op " << op_ << " seq " << id.value << " position " << p;
      }
    }
    // Every indexed block holds what the index says (cached ones included).
    for (std::int32_t b = 0; b < m_.n_blocks(); ++b) {
      if (!m_.index().contains(block_id(b))) continue;
      const auto held = m_.index().tokens_of(block_id(b));
      for (std::int32_t i = 0; i < bs_; ++i) {
        ASSERT_EQ(slot(block_id(b), i), held[static_cast<std::size_t>(i)]) << "op " << op_ << " block " << b;
      }
    }
  }

  std::mt19937 rng_;
  std::int32_t bs_;
  kv_manager m_;
  std::vector<token_id> kv_;  // simulated tensors: [n_blocks][block_size] token ids
  std::vector<std::vector<token_id>> prefixes_;
  std::map<seq_id, live_seq> seqs_;
  std::int64_t next_id_ = 1;
  int op_ = 0;
  std::int64_t n_preemptions_ = 0;
  std::int64_t n_copies_ = 0;
  std::int64_t n_hit_tokens_ = 0;
  std::int64_t n_allocate_failures_ = 0;
};

class kv_property : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(kv_property, random_operations_keep_every_invariant) {
  const std::uint32_t seed = GetParam();
  const scenario sc = scenario_for(seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " block_size " << sc.block_size << " n_blocks "
                                    << sc.n_blocks << " prefix_caching " << sc.prefix_caching);
  harness h(seed, sc);
  h.run(5000);
}

INSTANTIATE_TEST_SUITE_P(seeds, kv_property, ::testing::Range(1u, 21u));

}  // namespace
}  // namespace pagoda
