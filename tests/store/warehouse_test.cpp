// The warehouse over in-memory tiers: write-through on a background thread
// with a bounded queue, batched; read-through across tiers with verification
// and promotion to the nearer tier, only of prefetched blocks, held until
// released; asynchronous lookups in tiers without an index; tenant isolation
// and erasure. The engine-thread calls are checked to answer while a tier is
// stuck (a gate no call of theirs may wait on).
#include "store/warehouse.h"

#include <condition_variable>
#include <future>
#include <mutex>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

constexpr std::uint64_t k_layout = 0x1a1a;  // the layout fingerprint of the test's blocks

// A tier whose calls can be held at a gate (a stuck disk or network), made to
// fail, or made to look like Redis (no index). Counts its calls.
class gated_store final : public block_store {
 public:
  explicit gated_store(std::unique_ptr<block_store> inner, bool indexed = true)
      : inner_(std::move(inner)), indexed_(indexed) {}
  enum call { put_call, count_call, get_call, erase_call, n_calls };
  // Calls of this kind wait at the gate until open(c).
  void close(call c) {
    std::lock_guard lock(mu_);
    closed_[c] = true;
  }
  void open(call c) {
    std::lock_guard lock(mu_);
    closed_[c] = false;
    cv_.notify_all();
  }
  // Waits until a call of this kind is waiting at its gate.
  void wait_until_stuck(call c) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stuck_[c] > 0; });
  }
  int calls(call c) {
    std::lock_guard lock(mu_);
    return calls_[c];
  }
  bool refuse = false;      // puts fail (a full disk)
  bool fail_reads = false;  // gets and lookups fail (a dead server)

  const char* tier() const override { return inner_->tier(); }
  bool indexed() const override { return indexed_; }
  result<std::optional<std::vector<std::byte>>> get(const store_key& k) override {
    pass(get_call);
    if (fail_reads) return error(errc::io_error, "down");
    return inner_->get(k);
  }
  result<std::size_t> count_present(std::span<const store_key> keys) override {
    pass(count_call);
    if (fail_reads) return error(errc::io_error, "down");
    return inner_->count_present(keys);
  }
  status put(const store_key& k, std::span<const std::byte> v) override {
    const store_entry e{k, v};
    return put_many(std::span<const store_entry>(&e, 1));
  }
  status put_many(std::span<const store_entry> entries) override {
    pass(put_call);
    if (refuse) return error(errc::resource_exhausted, "full");
    std::lock_guard lock(mu_);
    batch_sizes.push_back(entries.size());
    return inner_->put_many(entries);
  }
  status erase(const store_key& k) override {
    pass(erase_call);
    return inner_->erase(k);
  }
  result<std::size_t> erase_tenant(std::uint64_t t) override { return inner_->erase_tenant(t); }
  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    return inner_->for_each(fn);
  }
  store_tier_stats stats() override { return inner_->stats(); }

  std::vector<std::size_t> batch_sizes;  // of every put_many that reached the inner tier

 private:
  void pass(call c) {
    std::unique_lock lock(mu_);
    ++calls_[c];
    ++stuck_[c];
    cv_.notify_all();
    cv_.wait(lock, [&] { return !closed_[c]; });
    --stuck_[c];
  }
  std::unique_ptr<block_store> inner_;
  bool indexed_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_[n_calls] = {};
  int stuck_[n_calls] = {};
  int calls_[n_calls] = {};
};

struct block_data {
  block_key key;
  std::vector<token_id> tokens;
  std::vector<std::byte> bytes;
  cached_block view(std::string_view tenant) const { return {k_layout, key, key - 1, tenant, tokens, bytes}; }
  stored_block_ref ref() const { return {k_layout, key}; }
};

block_data make_block(block_key key, std::size_t n = 4096) {
  block_data b{key, {}, std::vector<std::byte>(n)};
  for (int i = 0; i < 16; ++i) b.tokens.push_back(static_cast<token_id>(key * 16 + static_cast<block_key>(i)));
  for (std::size_t i = 0; i < n; ++i) b.bytes[i] = static_cast<std::byte>((key * 31 + i * 7) & 0xff);
  return b;
}

std::vector<stored_block_ref> refs_of(std::initializer_list<block_key> keys) {
  std::vector<stored_block_ref> r;
  for (const block_key k : keys) r.push_back({k_layout, k});
  return r;
}

std::vector<std::unique_ptr<block_store>> memory_tiers(int n) {
  std::vector<std::unique_ptr<block_store>> tiers;
  for (int i = 0; i < n; ++i) tiers.push_back(make_memory_store());
  return tiers;
}

// Flips a byte in the middle of tier's entry under sk; returns the damaged entry.
std::vector<std::byte> damage(block_store& tier, const store_key& sk) {
  auto stored = **tier.get(sk);
  stored[stored.size() / 2] ^= std::byte{1};
  EXPECT_TRUE(tier.erase(sk).ok());
  EXPECT_TRUE(tier.put(sk, stored).ok());
  return stored;
}

// Runs `calls` (the engine thread's) on a thread while g's calls of kind c
// wait at their closed gate, then opens it: whether they answered without
// waiting for the tier, and returned true.
::testing::AssertionResult answers_while_stuck(gated_store& g, gated_store::call c,
                                               const std::function<bool()>& calls) {
  g.wait_until_stuck(c);
  auto engine = std::async(std::launch::async, calls);
  const bool answered = engine.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  g.open(c);
  if (!answered) return ::testing::AssertionFailure() << "an engine-thread call waited for the stuck tier";
  if (!engine.get()) return ::testing::AssertionFailure() << "an engine-thread call answered wrong";
  return ::testing::AssertionSuccess();
}

// A warehouse whose first tier is a gated memory tier (g).
struct gated_warehouse {
  gated_store* g = nullptr;
  std::unique_ptr<kv_warehouse> w;
  explicit gated_warehouse(const warehouse_options& o = {}, std::function<void(gated_store&)> before = {}) {
    auto gate = std::make_unique<gated_store>(make_memory_store());
    g = gate.get();
    if (before) before(*g);  // before the warehouse's threads start
    std::vector<std::unique_ptr<block_store>> tiers;
    tiers.push_back(std::move(gate));
    w = std::make_unique<kv_warehouse>(std::move(tiers), o);
  }
};

TEST(warehouse, writes_through_and_reads_back_verified) {
  kv_warehouse w(memory_tiers(2), {});
  std::vector<block_data> blocks;
  std::vector<stored_block_ref> refs;
  for (block_key k = 1; k <= 5; ++k) {
    blocks.push_back(make_block(k));
    refs.push_back(blocks.back().ref());
    w.write(blocks.back().view("t"));
  }
  w.flush();
  EXPECT_EQ(w.counters().written, 5);
  for (const auto& t : w.tiers()) EXPECT_EQ(t->stats().entries, 5);
  EXPECT_EQ(w.n_available("t", refs), 5);
  refs.push_back({k_layout, 99});
  EXPECT_EQ(w.n_available("t", refs), 5);
  // Another layout (another KV class) is another entry.
  EXPECT_EQ(w.n_available("t", std::vector<stored_block_ref>{{k_layout + 1, 1}}), 0);
  const auto first5 = std::span(refs).first(5);
  w.prefetch("t", first5);
  w.quiesce();
  ASSERT_TRUE(w.settled("t", first5));
  std::vector<std::byte> out(4096);
  for (const block_data& b : blocks) {
    ASSERT_EQ(w.read("t", b.ref(), out), 0);  // the first tier has it
    EXPECT_EQ(out, b.bytes);
  }
  EXPECT_EQ(w.read("t", {k_layout, 99}, out), -1);
  EXPECT_EQ(w.counters().loads, 5);
  EXPECT_EQ(w.counters().load_misses, 1);
  w.release("t", first5);
  EXPECT_EQ(w.counters().held_bytes, 0);
  EXPECT_EQ(w.read("t", blocks[0].ref(), out), -1) << "released: no longer held";
  // Writing what is stored everywhere is skipped.
  w.write(blocks[0].view("t"));
  w.flush();
  EXPECT_EQ(w.counters().already_stored, 1);
}

TEST(warehouse, tenants_never_see_each_others_blocks_and_erase_reaches_every_tier) {
  kv_warehouse w(memory_tiers(2), {});
  const block_data a = make_block(7), b = make_block(8);
  w.write(a.view("alice"));
  w.write(b.view("bob"));
  w.flush();
  const auto ka = refs_of({7}), kb = refs_of({8});
  EXPECT_EQ(w.n_available("alice", ka), 1);
  EXPECT_EQ(w.n_available("bob", ka), 0);
  w.prefetch("bob", ka);
  w.quiesce();
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("bob", a.ref(), out), -1);
  w.release("bob", ka);
  EXPECT_EQ(*w.erase_tenant("alice"), 2u);  // one entry in each tier
  EXPECT_EQ(w.n_available("alice", ka), 0);
  EXPECT_EQ(w.n_available("bob", kb), 1);
}

// A damaged entry is never served: it is counted, erased, and the next tier
// answers if it holds a good copy.
TEST(warehouse, a_corrupt_entry_is_a_miss_and_the_next_tier_answers) {
  kv_warehouse w(memory_tiers(2), {});
  const block_data b = make_block(3);
  w.write(b.view(""));
  w.flush();
  const store_key sk = w.key_of("", b.ref());
  const std::vector<std::byte> stored = damage(*w.tiers()[0], sk);
  const auto refs = refs_of({3});
  const auto load = [&](std::vector<std::byte>& out) {
    w.prefetch("", refs);
    w.quiesce();
    const int tier = w.read("", b.ref(), out);
    w.release("", refs);
    return tier;
  };
  std::vector<std::byte> out(4096);
  ASSERT_EQ(load(out), 1);  // from the second tier
  EXPECT_EQ(out, b.bytes);
  EXPECT_EQ(w.counters().corrupt, 1);
  EXPECT_EQ(w.counters().loads_by_tier[1], 1);
  // The bad copy is gone from the first tier, replaced by the good one (promotion).
  EXPECT_TRUE(check_block_record(**w.tiers()[0]->get(sk), sk).ok());
  // Corrupt everywhere: a miss.
  for (const auto& t : w.tiers()) {
    ASSERT_TRUE(t->erase(sk).ok());
    ASSERT_TRUE(t->put(sk, stored).ok());
  }
  EXPECT_EQ(load(out), -1);
  EXPECT_EQ(w.counters().corrupt, 3);
}

// The engine thread's calls, all while a tier is stuck in the fetcher's erase
// of a corrupt entry: they answer (the erase ran under the warehouse's mutex
// once, and every one of them waited for it).
TEST(warehouse, a_corrupt_entry_is_erased_outside_the_engines_lock) {
  gated_warehouse gw;
  gated_store* g = gw.g;
  kv_warehouse& w = *gw.w;
  const block_data b = make_block(4), other = make_block(5);
  w.write(b.view(""));
  w.flush();
  const store_key sk = w.key_of("", b.ref());
  damage(*w.tiers()[0], sk);
  g->close(gated_store::erase_call);
  const auto refs = refs_of({4});
  w.prefetch("", refs);
  ASSERT_TRUE(answers_while_stuck(*g, gated_store::erase_call, [&] {
    std::vector<std::byte> out(4096);
    w.write(other.view(""));
    const int n = w.n_available("", refs);
    const bool settled = w.settled("", refs);
    const int tier = w.read("", b.ref(), out);
    return n == 1 && !settled && tier == -1;
  }));
  w.quiesce();
  EXPECT_TRUE(w.settled("", refs));
  EXPECT_EQ(w.counters().corrupt, 1);
  w.release("", refs);
}

// The write queue is bounded: while a tier is stuck, the engine's writes do
// not wait; what does not fit is dropped and counted, and close() drains the
// rest, in one batch.
TEST(warehouse, a_full_queue_drops_and_counts_and_shutdown_drains) {
  warehouse_options o;
  o.max_queue_blocks = 3;
  gated_warehouse gw(o, [](gated_store& g) { g.close(gated_store::put_call); });
  gated_store* g = gw.g;
  auto& w = gw.w;
  std::vector<block_data> blocks;
  for (block_key k = 1; k <= 6; ++k) blocks.push_back(make_block(k));
  w->write(blocks[0].view(""));
  g->wait_until_stuck(gated_store::put_call);  // the writer took it: the queue is empty again
  for (int i = 1; i < 6; ++i) w->write(blocks[static_cast<std::size_t>(i)].view(""));
  EXPECT_EQ(w->counters().queue_blocks, 3);
  EXPECT_EQ(w->counters().dropped, 2);
  g->open(gated_store::put_call);
  w->close();
  EXPECT_EQ(w->counters().written, 4);
  EXPECT_EQ(w->tiers()[0]->stats().entries, 4);
  EXPECT_EQ(w->counters().write_batches, 2);
  EXPECT_EQ(g->batch_sizes, (std::vector<std::size_t>{1, 3})) << "the writer takes everything queued at once";
}

// flush(tenant, refs) waits for those blocks only: not for a stuck write of
// another block, and it returns once its own are stored.
TEST(warehouse, a_keyed_flush_waits_for_its_own_blocks_only) {
  gated_warehouse gw({}, [](gated_store& g) { g.close(gated_store::put_call); });
  gated_store* g = gw.g;
  kv_warehouse& w = *gw.w;
  const block_data a = make_block(1), b = make_block(2);
  w.write(a.view("t"));
  w.write(b.view("t"));
  const auto other = refs_of({3}), mine = refs_of({2});
  w.flush("t", other);  // block 3 was never queued: nothing to wait for, whatever is stuck
  w.flush("u", mine);   // another tenant's block 2 neither
  auto done = std::async(std::launch::async, [&] { w.flush("t", mine); });
  g->open(gated_store::put_call);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const store_key sk[] = {w.key_of("t", b.ref())};
  EXPECT_EQ(*w.tiers()[0]->count_present(sk), 1u);
}

// A tier that refuses writes (a full disk): the error is counted, the next
// tier still gets the block, and reads go on.
TEST(warehouse, a_refusing_tier_counts_errors_and_the_others_still_store) {
  std::vector<std::unique_ptr<block_store>> tiers;
  auto full = std::make_unique<gated_store>(make_memory_store());
  full->refuse = true;
  tiers.push_back(std::move(full));
  tiers.push_back(make_memory_store());
  kv_warehouse w(std::move(tiers), {});
  const block_data b = make_block(5);
  w.write(b.view(""));
  w.flush();
  EXPECT_EQ(w.counters().write_errors, 1);
  EXPECT_EQ(w.counters().written, 1);
  const auto refs = refs_of({5});
  w.prefetch("", refs);
  w.quiesce();
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("", b.ref(), out), 1);  // the refusing first tier has nothing
  w.release("", refs);
}

// read() never fetches: a block that was not prefetched is a miss, counted,
// without a call to any tier.
TEST(warehouse, a_block_not_prefetched_is_a_miss_not_a_fetch) {
  gated_warehouse gw;
  gated_store* g = gw.g;
  kv_warehouse& w = *gw.w;
  const block_data b = make_block(6);
  w.write(b.view(""));
  w.flush();
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("", b.ref(), out), -1);
  EXPECT_EQ(g->calls(gated_store::get_call), 0);
  EXPECT_EQ(w.counters().load_misses, 1);
}

// Defect 6: past 4,096 held entries, a prefetch dropped the fetched blocks
// that loading sequences had not read yet, and their reads then fetched
// synchronously on the engine thread. Now they are held until released: with
// the tier failing every read after the prefetch, each is still served.
TEST(warehouse, prefetched_blocks_stay_until_released_however_many) {
  warehouse_options o;
  o.max_queue_blocks = 8192;  // every block stored
  gated_warehouse gw(o);
  gated_store* g = gw.g;
  kv_warehouse& w = *gw.w;
  constexpr block_key n = 4200;
  std::vector<block_data> blocks;
  std::vector<stored_block_ref> refs;
  for (block_key k = 1; k <= n; ++k) {
    blocks.push_back(make_block(k, 64));
    refs.push_back(blocks.back().ref());
    w.write(blocks.back().view(""));
  }
  w.flush();
  w.prefetch("", refs);
  w.quiesce();
  ASSERT_TRUE(w.settled("", refs));
  const block_data late = make_block(n + 1, 64);
  w.write(late.view(""));
  w.flush();
  const auto late_ref = refs_of({n + 1});
  w.prefetch("", late_ref);  // another sequence's prefetch
  w.quiesce();
  g->fail_reads = true;  // from here any fetch fails: only what is held can be served
  const int gets = g->calls(gated_store::get_call);
  std::vector<std::byte> out(64);
  for (const block_data& b : blocks) {
    ASSERT_EQ(w.read("", b.ref(), out), 0) << "block " << b.key << " was dropped before its sequence read it";
    ASSERT_EQ(out, b.bytes);
  }
  EXPECT_EQ(g->calls(gated_store::get_call), gets) << "a read fetched on the engine thread";
  w.release("", refs);
  w.release("", late_ref);
  EXPECT_EQ(w.counters().held_bytes, 0);
}

// Memory is bounded by refusing new prefetches past max_prefetch_bytes (the
// blocks are computed instead), never by dropping held ones; a block two
// sequences prefetched stays until both release it.
TEST(warehouse, prefetches_past_the_byte_cap_are_refused_not_dropped) {
  warehouse_options o;
  o.max_prefetch_bytes = 3 * 4096;
  kv_warehouse w(memory_tiers(1), o);
  std::vector<block_data> blocks;
  for (block_key k = 1; k <= 6; ++k) {
    blocks.push_back(make_block(k));
    w.write(blocks.back().view(""));
  }
  w.flush();
  const auto a = refs_of({1, 2, 3}), b = refs_of({4, 5}), again = refs_of({1});
  w.prefetch("", a);
  w.prefetch("", b);  // past the cap: refused
  w.quiesce();
  EXPECT_EQ(w.counters().prefetch_refused, 2);
  EXPECT_TRUE(w.settled("", b));
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("", blocks[3].ref(), out), -1);
  w.prefetch("", again);  // held already: shared, whatever the cap
  for (int i = 0; i < 3; ++i) EXPECT_EQ(w.read("", blocks[static_cast<std::size_t>(i)].ref(), out), 0);
  w.release("", a);
  EXPECT_EQ(w.read("", blocks[0].ref(), out), 0) << "released by one holder, still held by the other";
  EXPECT_EQ(w.read("", blocks[1].ref(), out), -1);
  w.release("", b);
  w.release("", again);
  EXPECT_EQ(w.counters().held_bytes, 0);
  // Room again: the refused blocks can be prefetched now.
  w.prefetch("", b);
  w.quiesce();
  EXPECT_EQ(w.read("", blocks[4].ref(), out), 0);
  w.release("", b);
}

// A tier without an index (Redis): n_available answers k_source_pending and
// asks in the background; the answer is remembered for lookup_ttl_us; a tier
// whose lookup fails holds nothing, answered at once; a lookup stuck past
// lookup_timeout_us counts as none. No call waits for the tier.
TEST(warehouse, lookups_in_a_tier_without_an_index_are_asynchronous) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(make_memory_store());
  auto gate = std::make_unique<gated_store>(make_memory_store(), /*indexed=*/false);
  gated_store* remote = gate.get();
  tiers.push_back(std::move(gate));
  manual_clock clock;
  warehouse_options o;
  o.clock = &clock;
  o.lookup_ttl_us = 2'000'000;
  o.lookup_timeout_us = 1'000'000;
  kv_warehouse w(std::move(tiers), o);
  std::vector<block_data> blocks;
  for (block_key k = 1; k <= 4; ++k) {
    blocks.push_back(make_block(k));
    w.write(blocks.back().view(""));
  }
  w.flush();
  const auto all = refs_of({1, 2, 3, 4, 5});
  ASSERT_TRUE(w.tiers()[0]->erase(w.key_of("", blocks[2].ref())).ok());  // disk: 1, 2; remote: 1..4
  ASSERT_TRUE(w.tiers()[0]->erase(w.key_of("", blocks[3].ref())).ok());
  // What this warehouse wrote to the remote tier it knows is there.
  EXPECT_EQ(w.n_available("", refs_of({1, 2, 3, 4})), 4);
  const int lookups_before = remote->calls(gated_store::count_call);  // the writer's own checks
  clock.advance_seconds(3);  // forgotten
  remote->close(gated_store::count_call);
  EXPECT_EQ(w.n_available("", all), k_source_pending);
  remote->wait_until_stuck(gated_store::count_call);
  EXPECT_EQ(w.n_available("", all), k_source_pending) << "asked while the lookup is in flight";
  EXPECT_EQ(w.n_available("", refs_of({1, 2})), 2) << "the disk alone answers";
  remote->open(gated_store::count_call);
  w.quiesce();
  EXPECT_EQ(w.n_available("", all), 4);
  EXPECT_EQ(remote->calls(gated_store::count_call) - lookups_before, 1) << "one lookup for all the asks";
  // Stuck past the timeout: none from that tier.
  clock.advance_seconds(3);
  remote->close(gated_store::count_call);
  EXPECT_EQ(w.n_available("", all), k_source_pending);
  remote->wait_until_stuck(gated_store::count_call);
  clock.advance_seconds(1.5);
  EXPECT_EQ(w.n_available("", all), 2);
  remote->open(gated_store::count_call);
  w.quiesce();
  // Down: a failed lookup makes the tier hold nothing until the answer ages out.
  clock.advance_seconds(3);
  remote->fail_reads = true;
  EXPECT_EQ(w.n_available("", all), k_source_pending);
  w.quiesce();
  EXPECT_EQ(w.n_available("", all), 2);
  EXPECT_EQ(w.n_available("", all), 2);
  remote->fail_reads = false;
  clock.advance_seconds(3);
  EXPECT_EQ(w.n_available("", all), k_source_pending);
  w.quiesce();
  EXPECT_EQ(w.n_available("", all), 4);
  EXPECT_GE(w.counters().lookups_pending, 4);
}

// While the writer is stuck inside a tier's put (a synced write that takes
// forever), every call the engine thread makes answers.
TEST(warehouse, a_stuck_write_never_holds_up_the_engine_thread) {
  gated_warehouse gw;
  kv_warehouse& w = *gw.w;
  const block_data a = make_block(1);
  w.write(a.view(""));
  w.flush();
  gw.g->close(gated_store::put_call);
  w.write(make_block(2).view(""));  // the writer takes it and hangs in the tier
  EXPECT_TRUE(answers_while_stuck(*gw.g, gated_store::put_call, [&] {
    const auto refs = refs_of({1, 2});
    std::vector<std::byte> out(4096);
    w.write(make_block(3).view(""));
    const int n = w.n_available("", refs);
    w.prefetch("", refs_of({1}));
    w.quiesce();
    const int tier = w.read("", a.ref(), out);
    w.release("", refs_of({1}));
    return n == 1 && tier == 0 && out == a.bytes;
  }));
}

}  // namespace
}  // namespace pagoda
