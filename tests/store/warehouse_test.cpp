// The warehouse over in-memory tiers: write-through on a background thread
// with a bounded queue, read-through across tiers with verification, promotion
// to the nearer tier, tenant isolation and erasure.
#include "store/warehouse.h"

#include <condition_variable>
#include <future>
#include <mutex>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

// A tier that holds puts until opened (to fill the write queue), or refuses them.
class gated_store final : public block_store {
 public:
  explicit gated_store(std::unique_ptr<block_store> inner) : inner_(std::move(inner)) {}
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void close() {
    std::lock_guard lock(mu_);
    open_ = false;
  }
  bool refuse = false;
  const char* tier() const override { return inner_->tier(); }
  result<std::optional<std::vector<std::byte>>> get(const store_key& k) override { return inner_->get(k); }
  result<std::size_t> count_present(std::span<const store_key> keys) override { return inner_->count_present(keys); }
  status put(const store_key& k, std::span<const std::byte> v) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
    if (refuse) return error(errc::resource_exhausted, "full");
    return inner_->put(k, v);
  }
  status erase(const store_key& k) override { return inner_->erase(k); }
  result<std::size_t> erase_tenant(std::uint64_t t) override { return inner_->erase_tenant(t); }
  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    return inner_->for_each(fn);
  }
  store_tier_stats stats() override { return inner_->stats(); }

 private:
  std::unique_ptr<block_store> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
};

struct block_data {
  block_key key;
  std::vector<token_id> tokens;
  std::vector<std::byte> bytes;
  cached_block view(std::string_view tenant) const { return {key, key - 1, tenant, tokens, bytes}; }
};

block_data make_block(block_key key, std::size_t n = 4096) {
  block_data b{key, {}, std::vector<std::byte>(n)};
  for (int i = 0; i < 16; ++i) b.tokens.push_back(static_cast<token_id>(key * 16 + static_cast<block_key>(i)));
  for (std::size_t i = 0; i < n; ++i) b.bytes[i] = static_cast<std::byte>((key * 31 + i * 7) & 0xff);
  return b;
}

TEST(warehouse, writes_through_and_reads_back_verified) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(make_memory_store());
  tiers.push_back(make_memory_store());
  kv_warehouse w(std::move(tiers), {});
  std::vector<block_data> blocks;
  std::vector<block_key> keys;
  for (block_key k = 1; k <= 5; ++k) {
    blocks.push_back(make_block(k));
    keys.push_back(k);
    w.write(blocks.back().view("t"));
  }
  w.flush();
  EXPECT_EQ(w.counters().written, 5);
  for (const auto& t : w.tiers()) EXPECT_EQ(t->stats().entries, 5);
  EXPECT_EQ(w.n_available("t", keys), 5);
  keys.push_back(99);
  EXPECT_EQ(w.n_available("t", keys), 5);
  w.prefetch("t", std::span(keys).first(5));
  for (int i = 0; i < 200 && !w.settled("t", std::span(keys).first(5)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(w.settled("t", std::span(keys).first(5)));
  std::vector<std::byte> out(4096);
  for (const block_data& b : blocks) {
    ASSERT_EQ(w.read("t", b.key, out), 0);  // the first tier has it
    EXPECT_EQ(out, b.bytes);
  }
  EXPECT_EQ(w.read("t", 99, out), -1);
  EXPECT_EQ(w.counters().loads, 5);
  EXPECT_EQ(w.counters().load_misses, 1);
  // Writing what is stored everywhere is skipped.
  w.write(blocks[0].view("t"));
  w.flush();
  EXPECT_EQ(w.counters().already_stored, 1);
}

TEST(warehouse, tenants_never_see_each_others_blocks_and_erase_reaches_every_tier) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(make_memory_store());
  tiers.push_back(make_memory_store());
  kv_warehouse w(std::move(tiers), {});
  const block_data a = make_block(7), b = make_block(8);
  w.write(a.view("alice"));
  w.write(b.view("bob"));
  w.flush();
  const block_key ka[] = {7}, kb[] = {8};
  EXPECT_EQ(w.n_available("alice", ka), 1);
  EXPECT_EQ(w.n_available("bob", ka), 0);
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("bob", 7, out), -1);
  EXPECT_EQ(*w.erase_tenant("alice"), 2u);  // one entry in each tier
  EXPECT_EQ(w.n_available("alice", ka), 0);
  EXPECT_EQ(w.n_available("bob", kb), 1);
}

// A damaged entry is never served: it is counted, erased, and the next tier
// answers if it holds a good copy.
TEST(warehouse, a_corrupt_entry_is_a_miss_and_the_next_tier_answers) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(make_memory_store());
  tiers.push_back(make_memory_store());
  kv_warehouse w(std::move(tiers), {});
  const block_data b = make_block(3);
  w.write(b.view(""));
  w.flush();
  const store_key sk = make_store_key(w.space(), "", 3);
  auto stored = **w.tiers()[0]->get(sk);
  stored[stored.size() / 2] ^= std::byte{1};
  ASSERT_TRUE(w.tiers()[0]->erase(sk).ok());
  ASSERT_TRUE(w.tiers()[0]->put(sk, stored).ok());
  std::vector<std::byte> out(4096);
  ASSERT_EQ(w.read("", 3, out), 1);  // from the second tier
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
  EXPECT_EQ(w.read("", 3, out), -1);
  EXPECT_EQ(w.counters().corrupt, 3);
}

// The write queue is bounded: while a tier is stuck, the engine's writes do
// not wait; what does not fit is dropped and counted, and close() drains the rest.
TEST(warehouse, a_full_queue_drops_and_counts_and_shutdown_drains) {
  std::vector<std::unique_ptr<block_store>> tiers;
  auto gate = std::make_unique<gated_store>(make_memory_store());
  gated_store* g = gate.get();
  tiers.push_back(std::move(gate));
  warehouse_options o;
  o.max_queue_blocks = 3;
  g->close();
  auto w = std::make_unique<kv_warehouse>(std::move(tiers), o);
  std::vector<block_data> blocks;
  for (block_key k = 1; k <= 6; ++k) blocks.push_back(make_block(k));
  w->write(blocks[0].view(""));
  // The writer takes it and waits in the stuck tier; the queue is empty again.
  for (int i = 0; i < 400 && w->counters().queue_blocks != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; i < 6; ++i) w->write(blocks[static_cast<std::size_t>(i)].view(""));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500)) << "write() waited for the tier";
  EXPECT_EQ(w->counters().queue_blocks, 3);
  EXPECT_EQ(w->counters().dropped, 2);
  g->open();
  w->close();
  EXPECT_EQ(w->counters().written, 4);
  EXPECT_EQ(w->tiers()[0]->stats().entries, 4);
}

// flush(tenant, keys) waits for those blocks only: not for a stuck write of
// another block, and it returns once its own are stored.
TEST(warehouse, a_keyed_flush_waits_for_its_own_blocks_only) {
  std::vector<std::unique_ptr<block_store>> tiers;
  auto gate = std::make_unique<gated_store>(make_memory_store());
  gated_store* g = gate.get();
  tiers.push_back(std::move(gate));
  g->close();
  kv_warehouse w(std::move(tiers), {});
  const block_data a = make_block(1), b = make_block(2);
  w.write(a.view("t"));
  w.write(b.view("t"));
  const block_key other[] = {3}, mine[] = {2};
  w.flush("t", other);  // block 3 was never queued: nothing to wait for, whatever is stuck
  w.flush("u", mine);   // another tenant's block 2 neither
  auto done = std::async(std::launch::async, [&] { w.flush("t", mine); });
  g->open();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const store_key sk[] = {make_store_key(w.space(), "t", 2)};
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
  std::vector<std::byte> out(4096);
  EXPECT_EQ(w.read("", 5, out), 1);  // the refusing first tier has nothing
}

}  // namespace
}  // namespace pagoda
