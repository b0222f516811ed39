// The retrieval selector's automatic index, background build and sampled
// recall (retrieval.h, retrieval_build.h).
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <set>

#include <gtest/gtest.h>

#include "attention/gather_attention.h"
#include "policy/retrieval.h"
#include "retrieval_test_util.h"

namespace pagoda {
namespace {

// Small integers: every q.k is exact in float whatever the order of the sums,
// so the exact path, the exact index and the reference rank identically
// (ties to the smaller slot everywhere).
void integral(std::vector<float>& x) {
  for (float& v : x) v = std::round(4.0f * v);
}

sequence integral_sequence(int capacity) {
  sequence s("f16", capacity);
  integral(s.k);
  return s;
}

std::vector<float> integral_query(const sequence& s, unsigned seed) {
  auto q = gaussian(static_cast<std::size_t>(s.n_rep) * s.head_dim, seed);
  integral(q);
  return q;
}

std::set<std::int32_t> slots_of(const std::vector<slot_range>& ranges) {
  std::set<std::int32_t> out;
  for (const slot_range& r : ranges)
    for (std::int32_t x = r.begin; x < r.end; ++x) out.insert(x);
  return out;
}

// What a selection must hold whatever is indexed: the sinks, the window past
// the sealed blocks, and each row's exact top-k over the live sealed keys
// where it falls between the two (retrieval.h: index part and exact part
// together never miss one).
std::set<std::int32_t> must_read(const sequence& s, const retrieval_params& p, int h, const std::vector<float>& q) {
  const int bs = s.block_size, sealed = s.n / bs * bs;
  const int first = 0;  // these tests have no dead slots
  const int window_begin = std::max(first, std::min(s.n - p.recent, sealed));
  const int sink_end = std::min(first + p.sinks, window_begin);
  std::set<std::int32_t> want;
  for (int x = first; x < sink_end; ++x) want.insert(x);
  for (int x = window_begin; x < s.n; ++x) want.insert(x);
  const paged_kv_view kv = s.kview();
  std::vector<float> keys(static_cast<std::size_t>(sealed) * s.head_dim);
  for (int b = 0; b < sealed; b += bs) decode_kv_rows(kv, h, b, bs, &keys[static_cast<std::size_t>(b) * s.head_dim]);
  const auto slots = iota_slots(sealed);
  for (int r = 0; r < s.n_rep; ++r) {
    std::vector<std::int32_t> top;
    exact_top_k(&q[static_cast<std::size_t>(r) * s.head_dim], keys.data(), slots.data(), sealed, s.head_dim,
                p.resolve_k(s.n), top);
    for (std::int32_t t : top)
      if (t >= sink_end && t < window_begin) want.insert(t);
  }
  return want;
}

std::vector<slot_range> select_ranges(retrieval_selector& sel, const sequence& s, int h, const std::vector<float>& q) {
  const paged_kv_view kv = s.kview();
  std::vector<slot_range> out;
  EXPECT_TRUE(sel.select(query(s, kv, h, q, 1), out));
  return out;
}

// The copy grows a few blocks per on_layer_written (as over a decode's
// steps): told again until every sealed key of layer is copied.
void settle(retrieval_selector& sel, const sequence& s, int layer = 0) {
  while (sel.sealed_end(layer) < s.n / s.block_size * s.block_size)
    sel.on_layer_written(layer, s.kview(), std::span(s.pos).first(s.n), s.n);
}

retrieval_params base_params() {
  retrieval_params p;
  p.k_tokens = 5;
  p.sinks = 4;
  p.recent = 8;
  p.background = false;
  return p;
}

// index=auto: the exact top-k below auto_min (no index, the same selection as
// index=exact), IVF-PQ from there (every live sealed key in the index, the
// copy released where the index holds it).
TEST(retrieval_build, auto_picks_exact_below_auto_min_and_ivfpq_from_it) {
  retrieval_params p = base_params();
  p.index = retrieval_index_kind::auto_;
  p.auto_min = 512;
  p.ivfpq = ivfpq_params{16, 4, 4, 16, 256};  // 16 lists, 4 x 4-bit codes, every list visited, trained on 256
  retrieval_params e = base_params();
  e.index = retrieval_index_kind::exact;
  sequence sa = integral_sequence(1200), se = integral_sequence(1200);
  retrieval_selector sel(p, 1, sa.n_kv_heads, sa.head_dim), exact(e, 1, se.n_kv_heads, se.head_dim);
  for (int step = 0; step < 31; ++step) {  // 496 slots, sealed 496 < 512
    sa.write(16, sel);
    se.write(16, exact);
  }
  for (int h = 0; h < sa.n_kv_heads; ++h) {
    EXPECT_EQ(sel.index_size(0, h), 0);
    for (unsigned seed : {1u, 2u, 3u}) {
      const auto q = integral_query(sa, seed + 10 * h);
      EXPECT_EQ(select_ranges(sel, sa, h, q), select_ranges(exact, se, h, q)) << "h " << h << " seed " << seed;
    }
    EXPECT_NE(sel.key_rows_of(0, h).chunks, nullptr);
  }
  EXPECT_EQ(sel.recall().searches, 0u);
  sa.write(100, sel);  // 596 slots: 592 sealed, past auto_min
  se.write(100, exact);
  ASSERT_TRUE(sel.error_status().ok()) << sel.error_status().message();
  for (int h = 0; h < sa.n_kv_heads; ++h) {
    EXPECT_EQ(sel.index_size(0, h), 592);
    EXPECT_EQ(sel.indexed_end(0, h), 592);
    EXPECT_EQ(sel.key_rows_of(0, h).chunks, nullptr);  // chunks 0 and 1 released: tiles serve gather
    const auto q = integral_query(sa, 7 + h);
    const std::set<std::int32_t> got = slots_of(select_ranges(sel, sa, h, q));
    for (int x : {0, 1, 2, 3, 588, 595}) EXPECT_TRUE(got.count(x)) << x;  // sinks, window
    EXPECT_LE(got.size(), 4u + 8u + 2u * 5u);
  }
  EXPECT_EQ(sel.recall().searches, 2u);
  EXPECT_LT(sel.memory_bytes(), exact.memory_bytes());
}

// More candidates outside any index than exact_max: the step reads
// everything (full attention is cheaper than the exact top-k there), unless
// the index kind is exact.
TEST(retrieval_build, past_exact_max_outside_the_index_reads_everything) {
  sequence s = integral_sequence(300);
  retrieval_params p = base_params();
  p.exact_max = 100;
  p.auto_min = 1 << 20;
  retrieval_params e = p;
  e.index = retrieval_index_kind::exact;
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim), exact(e, 1, s.n_kv_heads, s.head_dim);
  s.write(100, sel);  // 96 sealed: 84 candidates, exact
  exact.on_layer_written(0, s.kview(), std::span(s.pos).first(s.n), s.n);
  const auto q = integral_query(s, 3);
  const paged_kv_view kv = s.kview();
  std::vector<slot_range> out;
  EXPECT_TRUE(sel.select(query(s, kv, 0, q, 1), out));
  s.write(100, sel);  // 192 sealed: 180 candidates
  exact.on_layer_written(0, s.kview(), std::span(s.pos).first(s.n), s.n);
  const paged_kv_view kv2 = s.kview();
  EXPECT_FALSE(sel.select(query(s, kv2, 0, q, 1), out));
  EXPECT_TRUE(exact.select(query(s, kv2, 0, q, 1), out));
}

// Grown one token at a time with the builder on its thread, every selection
// holds the exact top-k (the index part and the exact part never drop a
// slot between them); once built, the selection equals that of a selector
// that indexed the same keys in one go.
TEST(retrieval_build, grown_block_by_block_equals_from_scratch_and_loses_no_slot) {
  retrieval_params p = base_params();
  p.index = retrieval_index_kind::hnsw;  // an index from the first block...
  p.make_index = make_exact_index;       // ...that is exact
  p.background = true;
  sequence s = integral_sequence(420);
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
  for (int step = 0; s.n < 420; ++step) {
    s.write(step % 7 == 0 ? 9 : 1, sel);
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const auto q = integral_query(s, static_cast<unsigned>(step * 2 + h));
      const std::set<std::int32_t> got = slots_of(select_ranges(sel, s, h, q));
      for (std::int32_t x : must_read(s, p, h, q)) ASSERT_TRUE(got.count(x)) << "slot " << x << " at " << s.n;
    }
  }
  sel.wait_built();
  retrieval_params scratch_p = p;
  scratch_p.background = false;
  sequence t = integral_sequence(420);
  retrieval_selector scratch(scratch_p, 1, t.n_kv_heads, t.head_dim);
  t.write(420, scratch);  // copies 128 slots: a long prompt is copied a few blocks a step
  EXPECT_EQ(scratch.sealed_end(0), 128);
  settle(scratch, t);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(sel.indexed_end(0, h), 416);
    EXPECT_EQ(sel.index_size(0, h), 416);
    for (unsigned seed : {40u, 41u, 42u}) {
      const auto q = integral_query(s, seed + h);
      EXPECT_EQ(select_ranges(sel, s, h, q), select_ranges(scratch, t, h, q));
    }
  }
}

// An exact index whose first add() (the builder's private build: no lock is
// held there) waits at a gate the test opens, and tells the test when a build
// is inside it: the test then acts while a build is in flight, with no timing
// involved.
struct gate_state {
  std::mutex mu;
  std::condition_variable cv;
  bool closed = false;
  int entered = 0;
};
gate_state& gate() {
  static gate_state g;
  return g;
}

class gated_index final : public key_index {
 public:
  explicit gated_index(int head_dim) : inner_(make_exact_index(head_dim)) {}
  status add(const float* keys, const std::int32_t* slots, int n) override {
    if (inner_->size() > 0) return inner_->add(keys, slots, n);
    gate_state& g = gate();
    std::unique_lock lock(g.mu);
    ++g.entered;
    g.cv.notify_all();
    g.cv.wait(lock, [&] { return !g.closed; });
    return inner_->add(keys, slots, n);
  }
  void search(const float* q, int k, std::vector<std::int32_t>& out) const override { inner_->search(q, k, out); }
  void remove_from(std::int32_t slot) override { inner_->remove_from(slot); }
  void clear() override { inner_->clear(); }
  int size() const override { return inner_->size(); }
  std::size_t memory_bytes() const override { return inner_->memory_bytes(); }

 private:
  std::unique_ptr<key_index> inner_;
};
std::unique_ptr<key_index> make_gated_index(int head_dim) { return std::make_unique<gated_index>(head_dim); }

void open_gate() {
  {
    std::lock_guard lock(gate().mu);
    gate().closed = false;
  }
  gate().cv.notify_all();
}

// Closes the gate; opens it when the test is done with it or leaves early (a
// failed assertion), before the selector's destructor waits for its builder:
// declare it after the selector.
struct closed_gate {
  closed_gate() {
    std::lock_guard lock(gate().mu);
    gate().closed = true;
    gate().entered = 0;
  }
  ~closed_gate() { open_gate(); }
  void wait_inside() {
    std::unique_lock lock(gate().mu);
    gate().cv.wait(lock, [] { return gate().entered > 0; });
  }
};

retrieval_params gated_params() {
  retrieval_params p = base_params();
  p.index = retrieval_index_kind::hnsw;
  p.make_index = make_gated_index;
  p.background = true;
  return p;
}

// The built index equals a from-scratch one over the same keys, and holds
// only slots below n.
void expect_like_scratch(retrieval_selector& sel, const sequence& s) {
  retrieval_params p = gated_params();
  p.make_index = make_exact_index;
  p.background = false;
  sequence t = integral_sequence(static_cast<int>(s.pos.size()));
  retrieval_selector scratch(p, 1, t.n_kv_heads, t.head_dim);
  t.write(s.n, scratch);
  settle(scratch, t);
  settle(sel, s);
  sel.wait_built();
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(sel.indexed_end(0, h), s.n / 16 * 16);
    EXPECT_EQ(sel.index_size(0, h), s.n / 16 * 16);
    const auto q = integral_query(s, 90u + h);
    EXPECT_EQ(select_ranges(sel, s, h, q), select_ranges(scratch, t, h, q));
  }
}

// A rollback while the builder is inside a build of the prompt: the build is
// dropped when it would publish, nothing past the rollback is ever indexed,
// and the blocks left are indexed again by the next write. Until then the
// exact path serves them.
TEST(retrieval_build, rollback_with_a_build_in_flight) {
  const retrieval_params p = gated_params();
  sequence s = integral_sequence(300);
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
  closed_gate g;
  s.write(200, sel);  // seals [0, 192): one job
  g.wait_inside();  // the builder is adding head 0's keys to its private index
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(sel.indexed_end(0, h), 0);
    const auto q = integral_query(s, 5u + h);
    const std::set<std::int32_t> got = slots_of(select_ranges(sel, s, h, q));
    for (std::int32_t x : must_read(s, p, h, q)) ASSERT_TRUE(got.count(x)) << x;
  }
  s.n = 100;
  s.kv->truncate_block(s.table[6], 4);
  for (int b = 7; b < 13; ++b) s.kv->truncate_block(s.table[b], 0);
  sel.on_slots_changed(100, true);  // does not wait for the build
  open_gate();
  sel.wait_built();
  for (int h = 0; h < s.n_kv_heads; ++h) EXPECT_EQ(sel.index_size(0, h), 0) << "the dropped build published";
  s.write(50, sel);  // 150: [0, 144) indexed from scratch
  sel.wait_built();
  expect_like_scratch(sel, s);
  EXPECT_TRUE(sel.error_status().ok());
}

// An index that lags behind the sealed blocks (the builder is busy with
// another layer) covers its part and the exact path the rest: no slot of the
// exact top-k is lost between them; once the builder catches up, the index
// holds everything.
TEST(retrieval_build, a_lagging_index_and_the_exact_tail_together_lose_no_slot) {
  const retrieval_params p = gated_params();
  sequence s = integral_sequence(300);
  retrieval_selector sel(p, 2, s.n_kv_heads, s.head_dim);
  s.write(200, sel);  // layer 0: [0, 192) indexed
  settle(sel, s);
  sel.wait_built();
  ASSERT_EQ(sel.indexed_end(0, 1), 192);
  closed_gate g;
  sel.on_layer_written(1, s.kview(), std::span(s.pos).first(s.n), s.n);  // layer 1's first build...
  g.wait_inside();                                                        // ...stays in flight
  s.write(60, sel);  // layer 0 seals [192, 256): queued behind it
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(sel.indexed_end(0, h), 192);
    for (unsigned seed : {70u, 71u, 72u, 73u}) {
      const auto q = integral_query(s, seed + 10 * h);
      const std::set<std::int32_t> got = slots_of(select_ranges(sel, s, h, q));
      for (std::int32_t x : must_read(s, p, h, q)) ASSERT_TRUE(got.count(x)) << "slot " << x;
    }
  }
  open_gate();
  sel.wait_built();
  expect_like_scratch(sel, s);
}

// A compaction (every slot's meaning changed) while a build is in flight:
// nothing of it is published, and the next write indexes everything again.
TEST(retrieval_build, compaction_with_a_build_in_flight) {
  const retrieval_params p = gated_params();
  sequence s = integral_sequence(300);
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
  closed_gate g;
  s.write(180, sel);
  g.wait_inside();
  sel.on_slots_changed(180, false);
  EXPECT_EQ(sel.sealed_end(0), 0);
  open_gate();
  sel.wait_built();
  for (int h = 0; h < s.n_kv_heads; ++h) {
    EXPECT_EQ(sel.indexed_end(0, h), 0);
    EXPECT_EQ(sel.index_size(0, h), 0);
  }
  s.write(20, sel);  // 200: the compacted slots are copied and indexed again
  sel.wait_built();
  expect_like_scratch(sel, s);
}

// An index that returns the keys of the LOWEST q.k: its sampled recall is
// low, an exact one's is 1; recall_every samples every Nth search.
class reversed_index final : public key_index {
 public:
  explicit reversed_index(int head_dim) : head_dim_(head_dim), inner_(make_exact_index(head_dim)) {}
  status add(const float* keys, const std::int32_t* slots, int n) override { return inner_->add(keys, slots, n); }
  void search(const float* q, int k, std::vector<std::int32_t>& out) const override {
    std::vector<float> neg(q, q + head_dim_);
    for (float& x : neg) x = -x;
    inner_->search(neg.data(), k, out);
  }
  void remove_from(std::int32_t slot) override { inner_->remove_from(slot); }
  void clear() override { inner_->clear(); }
  int size() const override { return inner_->size(); }
  std::size_t memory_bytes() const override { return inner_->memory_bytes(); }

 private:
  int head_dim_;
  std::unique_ptr<key_index> inner_;
};
std::unique_ptr<key_index> make_reversed_index(int head_dim) { return std::make_unique<reversed_index>(head_dim); }

TEST(retrieval_build, sampled_recall_counts_what_the_index_found) {
  for (auto make : {make_exact_index, make_reversed_index}) {
    retrieval_params p = base_params();
    p.index = retrieval_index_kind::hnsw;
    p.make_index = make;
    p.recall_every = 2;
    sequence s = integral_sequence(400);
    retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
    s.write(400, sel);
    for (int i = 0; i < 10; ++i) select_ranges(sel, s, i % 2, integral_query(s, 60u + i));
    const retrieval_recall r = sel.recall();
    EXPECT_EQ(r.searches, 10u);
    EXPECT_EQ(r.wanted, 5u * s.n_rep * p.k_tokens);  // searches 0, 2, 4, 6, 8
    if (make == make_exact_index) EXPECT_EQ(r.found, r.wanted);
    else EXPECT_LT(r.found * 10, r.wanted);
  }
}

}  // namespace
}  // namespace pagoda
