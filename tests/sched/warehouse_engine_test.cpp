// The engine with a KV warehouse behind its pool (stories260K): prefixes
// survive a restart through the disk tier and cross engines through Redis,
// with the same greedy tokens as a cold run, typed blocks (another KV class)
// too; tenants stay apart in every tier; damaged entries and a dead Redis
// only cost recomputation; a stuck tier never stops the engine's steps; a KV
// mirror's blocks are stored and loaded with the cache's.
#include <condition_variable>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <set>

#include <gtest/gtest.h>

#include "common/requests.h"
#include "common/synth_model.h"
#include "sched/engine_setup.h"
#include "store/redis_util.h"
#include "store/warehouse.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;
using test::greedy_request;
using test::stories;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pagoda_wh_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

// One "server": an engine and its warehouse (as pagoda serve wires them).
struct node {
  std::unique_ptr<kv_warehouse> warehouse;
  std::unique_ptr<engine_core> core;

  explicit node(const engine_config& c, const llama_model& model = stories()) {
    auto cc = make_engine_core_config(model, c);
    EXPECT_TRUE(cc.ok()) << cc.error().message();
    cc->max_model_len = 512;
    auto w = make_warehouse(c, model);
    EXPECT_TRUE(w.ok()) << w.error().message();
    warehouse = std::move(*w);
    core = std::move(*engine_core::create(model, *cc));
    if (warehouse) attach_warehouse(*core, *warehouse);
  }
  ~node() {
    core.reset();
    if (warehouse) warehouse->close();
  }

  struct answer {
    std::vector<token_id> tokens;
    request_usage usage;
  };
  answer run(request r) {
    const std::string id = r.id;
    EXPECT_TRUE(core->add_request(std::move(r)).ok());
    answer a;
    std::vector<engine_event> ev;
    while (core->has_work()) {
      ev.clear();
      core->step(ev);
      for (const engine_event& e : ev) {
        EXPECT_TRUE(e.error.empty()) << e.error;
        a.tokens.insert(a.tokens.end(), e.tokens.begin(), e.tokens.end());
        if (e.request_finished) a.usage = e.usage;
      }
    }
    ev.clear();
    core->step(ev);  // the last block ops (commit hook) run
    if (warehouse) warehouse->flush();
    return a;
  }
};

engine_config config(const std::string& disk, const std::string& redis = "") {
  engine_config c;
  c.model_path = test::stories_path();
  c.kv_cache_dtype = "f32";
  c.max_num_seqs = 8;
  c.max_kv_tokens = 8192;
  c.kv_store_path = disk;
  c.kv_store_size_gib = 0.25;
  c.kv_store_remote = redis;
  return c;
}

std::string long_prompt() {
  return "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
         "friends. One day, she saw a big red ball in the park and wanted to play with it all day long";
}

TEST(warehouse_engine, a_restart_keeps_prefixes_on_disk) {
  const std::string dir = temp_dir("restart");
  const request r = greedy_request("a", long_prompt(), 24);
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  ASSERT_GE(n_blocks, 2);
  node::answer cold;
  {
    node n(config(""));
    cold = n.run(r);
  }
  {
    node first(config(dir));
    const node::answer a = first.run(r);
    EXPECT_EQ(a.tokens, cold.tokens);
    EXPECT_GE(first.warehouse->counters().written, n_blocks);
  }
  node second(config(dir));  // a new process, in effect: an empty pool, the same directory
  const node::answer b = second.run(r);
  EXPECT_EQ(b.tokens, cold.tokens);
  EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
  EXPECT_EQ(second.core->stats().n_loaded_tokens, n_blocks * 16);
  EXPECT_EQ(second.warehouse->counters().loads, n_blocks);
  fs::remove_all(dir);
}

// Chunk reuse (CacheBlend): a chunk's blocks are stored like any cached
// block, so after a restart a prompt holding the chunk elsewhere loads them
// from disk (the chunk computes only its extra token) and gives the same
// tokens as before; another model on the same directory never loads them
// (the store's fingerprint names the model).
TEST(warehouse_engine, reused_chunks_survive_a_restart_and_never_cross_models) {
  const std::string dir = temp_dir("chunks");
  const std::vector<token_id> doc = stories().vocab().encode(long_prompt(), false);
  const int n_chunk = static_cast<int>(doc.size()) / 16 * 16;
  ASSERT_GE(n_chunk, 32);
  auto rag = [&](const std::string& id, const std::string& intro) {
    std::vector<token_id> prompt = stories().vocab().encode(intro, true);
    prompt_segment s;
    s.begin = static_cast<std::int32_t>(prompt.size());
    prompt.insert(prompt.end(), doc.begin(), doc.end());
    s.end = static_cast<std::int32_t>(prompt.size());
    s.reuse_chunk = true;
    s.recompute = 0.0f;
    const std::vector<token_id> q = stories().vocab().encode(" The end. Then", false);
    prompt.insert(prompt.end(), q.begin(), q.end());
    request r = test::greedy_ids(id, prompt, 12);
    r.segments = {s};
    return r;
  };
  const request r = rag("a", "Read this story.");
  node::answer first;
  {
    node n(config(dir));
    first = n.run(r);
    EXPECT_EQ(first.usage.reused_chunk_tokens, n_chunk);
  }
  {
    node second(config(dir));
    const node::answer b = second.run(rag("b", "Read this story."));
    EXPECT_EQ(b.tokens, first.tokens);
    EXPECT_EQ(b.usage.reused_chunk_tokens, n_chunk);
    EXPECT_EQ(second.core->stats().n_loaded_tokens, n_chunk) << "the chunk's blocks came from disk";
    EXPECT_EQ(second.core->stats().n_computed_prompt_tokens, 1 + static_cast<std::int64_t>(r.prompt.size()) - n_chunk);
    // Elsewhere in another prompt: the same chunk, from the pool now.
    const node::answer c = second.run(rag("c", "Here is a tale for you."));
    EXPECT_EQ(c.usage.reused_chunk_tokens, n_chunk);
  }
  // Another model (a synth with stories260K's shapes but other weights) on the same directory.
  synth_options o = test::f32_synth_options("tiny256", 2);
  auto other = test::load_synth(o, "wh_chunks_other");
  ASSERT_TRUE(other);
  std::vector<token_id> ids;
  for (int i = 0; i < 120; ++i) ids.push_back(static_cast<token_id>((i * 13 + 5) % other->hparams().n_vocab));
  request x = test::greedy_ids("x", ids, 4);
  prompt_segment s;
  s.begin = 8;
  s.end = 100;
  s.reuse_chunk = true;
  x.segments = {s};
  {
    node writer(config(dir), *other);
    writer.run(x);
  }
  {  // one owner of the directory at a time, as servers are (the store's lock)
    node reader(config(dir), *other);
    x.id = "y";
    reader.run(x);
    EXPECT_GT(reader.core->stats().n_loaded_tokens, 0) << "the same model loads its chunk from disk";
  }
  // stories260K on the same tokens (ids valid in both vocabularies): nothing loads.
  node stories_node(config(dir));
  x.id = "z";
  stories_node.run(x);
  EXPECT_EQ(stories_node.core->stats().n_loaded_tokens, 0);
  fs::remove_all(dir);
}

// Shared KV layers (--kv-share) hold other bytes than unshared ones: blocks
// one writes, the other never loads (the layout's fingerprint names the
// sharing), and an engine with the same sharing does.
TEST(warehouse_engine, shared_and_unshared_caches_never_meet) {
  const std::string dir = temp_dir("kv_share");
  const request r = greedy_request("a", long_prompt(), 24);
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  engine_config shared = config(dir);
  shared.kv_share = "reuse:from=1";
  node::answer cold_plain, cold_shared;
  {
    node n(config(""));
    cold_plain = n.run(r);
  }
  {
    engine_config c = shared;
    c.kv_store_path.clear();
    node n(c);
    cold_shared = n.run(r);
  }
  ASSERT_NE(cold_plain.tokens, cold_shared.tokens) << "sharing changed nothing: the test checks nothing";
  {
    node writer(shared);
    EXPECT_EQ(writer.run(r).tokens, cold_shared.tokens);
    EXPECT_GE(writer.warehouse->counters().written, n_blocks);
  }
  {
    node plain(config(dir));  // the same directory, no sharing: computes, loads nothing
    const node::answer a = plain.run(r);
    EXPECT_EQ(a.tokens, cold_plain.tokens);
    EXPECT_EQ(a.usage.cached_tokens, 0);
    EXPECT_EQ(plain.warehouse->counters().loads, 0);
  }
  {
    // Another map with as many KV layers (reuse:from=0 pairs (0, 1), (2, 3)): loads nothing either.
    engine_config c = shared;
    c.kv_share = "reuse:from=0";
    engine_config cold = c;
    cold.kv_store_path.clear();
    node fresh(cold);
    const node::answer expected = fresh.run(r);
    node other(c);
    const node::answer a = other.run(r);
    EXPECT_EQ(a.tokens, expected.tokens);
    EXPECT_EQ(a.usage.cached_tokens, 0);
    EXPECT_EQ(other.warehouse->counters().loads, 0);
  }
  node again(shared);  // the same sharing: loads what the writer stored
  const node::answer b = again.run(r);
  EXPECT_EQ(b.tokens, cold_shared.tokens);
  EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
  fs::remove_all(dir);
}

// MiniCache (--kv-share minicache) blocks carry the reader's side data to
// the disk tier and back: after a restart, a prompt served from disk gives
// the tokens the same prompt gives served from the in-memory prefix cache
// (the same split of the prompt: merged outputs depend on it), in f32 and in
// sealed int4; a minicache of another retain, and reuse over the same pairs,
// load nothing from that directory.
TEST(warehouse_engine, minicache_blocks_carry_their_side_data_through_the_disk_tier) {
  for (const char* dtype : {"f32", "int4"}) {
    SCOPED_TRACE(dtype);
    const std::string dir = temp_dir(std::string("minicache_") + dtype);
    const request r = greedy_request("a", long_prompt(), 24);
    const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
    engine_config merged = config(dir);
    merged.kv_cache_dtype = dtype;
    merged.kv_share = "minicache:from=1,retain=0.25";
    node::answer warm;
    {
      node writer(merged);
      writer.run(r);
      warm = writer.run(r);  // served from memory
      EXPECT_EQ(warm.usage.cached_tokens, n_blocks * 16);
      EXPECT_GE(writer.warehouse->counters().written, n_blocks);
    }
    for (const char* other : {"minicache:from=1,retain=0.125", "reuse:from=1"}) {
      engine_config c = merged;
      c.kv_share = other;
      node n(c);
      EXPECT_EQ(n.run(r).usage.cached_tokens, 0) << other;
      EXPECT_EQ(n.warehouse->counters().loads, 0) << other;
    }
    node again(merged);
    const node::answer b = again.run(r);  // served from disk
    EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
    EXPECT_EQ(again.core->stats().n_loaded_tokens, n_blocks * 16);
    EXPECT_EQ(b.tokens, warm.tokens);
    fs::remove_all(dir);
  }
}

// gemma2 (tests/data/oracle, window 32) with its sliding layer in a KV group
// of its own: both groups' blocks reach the disk tier, each under its own
// layout (same formats, other layers: they must not collide), and a restart
// loads the prefix in both groups: the same greedy tokens as a cold run
// keeping every position without a store.
TEST(warehouse_engine, window_group_blocks_store_and_load_in_every_group) {
  const std::string gguf = std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/gguf/gemma2-F32.gguf";
  auto model = *llama_model::load(gguf);
  const std::string dir = temp_dir("windows");
  auto cfg = [&](const std::string& disk, bool swa_full) {
    engine_config c = config(disk);
    c.model_path = gguf;
    c.max_num_seqs = 2;
    c.max_num_batched_tokens = 32;
    c.max_kv_tokens = 1024;
    c.swa_full = swa_full;
    return c;
  };
  request r;
  r.id = "g";
  for (int i = 0; i < 150; ++i) r.prompt.push_back(static_cast<token_id>(3 + (i * 37) % 500));
  r.max_tokens = 40;
  r.sampling = sampling_params::greedy();
  r.ignore_eos = true;
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  node::answer cold;
  {
    node n(cfg("", true), *model);
    EXPECT_EQ(n.core->config().groups.size(), 1u);
    cold = n.run(r);
  }
  ASSERT_EQ(cold.tokens.size(), 40u);
  {
    node first(cfg(dir, false), *model);
    ASSERT_EQ(first.core->config().groups.size(), 2u);
    EXPECT_EQ(first.run(r).tokens, cold.tokens);
    EXPECT_GE(first.warehouse->counters().written, n_blocks);
  }
  node second(cfg(dir, false), *model);
  ASSERT_EQ(second.core->config().groups.size(), 2u);
  const node::answer b = second.run(r);
  EXPECT_EQ(b.tokens, cold.tokens);
  EXPECT_EQ(second.core->stats().n_loaded_tokens, n_blocks * 16);
  fs::remove_all(dir);
}

// The KV mirror of self:view=int4 (a group of the model's layers in int4):
// its blocks are stored beside the cache's under their own layout and a
// restart loads the prefix in both groups; the drafts then read loaded
// mirror blocks, and the greedy tokens are a cold plain run's.
TEST(warehouse_engine, kv_mirror_blocks_store_and_load_with_the_cache) {
  const std::string dir = temp_dir("mirror");
  const request r = greedy_request("m", long_prompt(), 32);
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  node::answer cold;
  {
    node n(config(""));
    cold = n.run(r);
  }
  auto cfg = [&] {
    engine_config c = config(dir);
    c.speculative = "self:k=3,view=int4";
    return c;
  };
  spec_decode_stats computed;
  {
    node first(cfg());
    ASSERT_EQ(first.core->config().groups.size(), 2u);
    EXPECT_EQ(first.run(r).tokens, cold.tokens);
    EXPECT_GE(first.warehouse->counters().written, 2 * n_blocks) << "both groups' blocks are stored";
    computed = first.core->stats().spec_decode.at("self");
  }
  node second(cfg());
  const node::answer b = second.run(r);
  EXPECT_EQ(b.tokens, cold.tokens);
  EXPECT_EQ(second.core->stats().n_loaded_tokens, n_blocks * 16);
  EXPECT_EQ(second.warehouse->counters().loads, 2 * n_blocks) << "the prefix loads in the cache and in its mirror";
  // The loaded mirror holds the bytes the first run computed: the same drafts, accepted alike.
  const spec_decode_stats& loaded = second.core->stats().spec_decode.at("self");
  EXPECT_GT(loaded.n_accepted_tokens, 0);
  EXPECT_EQ(loaded.n_draft_tokens, computed.n_draft_tokens);
  EXPECT_EQ(loaded.n_accepted_tokens, computed.n_accepted_tokens);
  fs::remove_all(dir);
}

TEST(warehouse_engine, tenants_stay_apart_across_a_restart) {
  const std::string dir = temp_dir("tenants");
  request a = greedy_request("a", long_prompt(), 8);
  a.tenant = "alice";
  request b = a;
  b.id = "b";
  b.tenant = "bob";
  {
    node n(config(dir));
    n.run(a);
  }
  node n(config(dir));
  EXPECT_EQ(n.run(b).usage.cached_tokens, 0) << "bob was served alice's KV";
  EXPECT_GT(n.run(a).usage.cached_tokens, 0);
  // Erasing alice leaves none of her entries; bob's are still there.
  EXPECT_GT(*n.warehouse->erase_tenant("alice"), 0u);
  int alice = 0, bob = 0;
  ASSERT_TRUE(n.warehouse->tiers()[0]
                  ->for_each([&](const store_key& k, std::span<const std::byte>) {
                    alice += k.tenant == tenant_hash("alice");
                    bob += k.tenant == tenant_hash("bob");
                    return true;
                  })
                  .ok());
  EXPECT_EQ(alice, 0);
  EXPECT_GT(bob, 0);
  fs::remove_all(dir);
}

TEST(warehouse_engine, a_damaged_entry_is_recomputed_not_served) {
  const std::string dir = temp_dir("corrupt");
  const request r = greedy_request("a", long_prompt(), 16);
  node::answer first;
  {
    node n(config(dir));
    first = n.run(r);
  }
  {
    // Flip a byte in the middle of every stored block.
    auto disk = *make_disk_store({dir, 1 << 28, 0});
    std::vector<std::pair<store_key, std::vector<std::byte>>> all;
    ASSERT_TRUE(disk->for_each([&](const store_key& k, std::span<const std::byte> v) {
                      all.emplace_back(k, std::vector<std::byte>(v.begin(), v.end()));
                      return true;
                    })
                    .ok());
    ASSERT_FALSE(all.empty());
    for (auto& [k, v] : all) {
      v[v.size() / 2] ^= std::byte{0x10};
      ASSERT_TRUE(disk->erase(k).ok());
      ASSERT_TRUE(disk->put(k, v).ok());
    }
  }
  node n(config(dir));
  const node::answer again = n.run(r);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.usage.cached_tokens, 0);
  EXPECT_GT(n.warehouse->counters().corrupt, 0);
  fs::remove_all(dir);
}

// Two engines with their own pools (config c, its Redis tier shared): what
// one computed for r, the other loads, every prompt block, with the same tokens.
void expect_shared_through_redis(const engine_config& c, const request& r) {
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  node one(c), two(c);
  const node::answer a = one.run(r);
  const node::answer b = two.run(r);
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
  EXPECT_EQ(two.core->stats().n_loaded_tokens, n_blocks * 16);
  EXPECT_EQ(two.warehouse->counters().loads_by_tier[0], n_blocks);
}

// Two engines share one Redis; then Redis dies and the next engine keeps answering.
TEST(warehouse_engine, redis_is_shared_between_engines_and_its_death_costs_only_recomputation) {
  test::redis_server redis;
  const request r = greedy_request("a", long_prompt(), 20);
  expect_shared_through_redis(config("", redis.url()), r);
  redis.stop(/*kill=*/true);
  request again = r;
  again.id = "b";
  again.prompt.push_back(again.prompt.back());  // a new prompt: not in either pool's cache beyond the shared part
  node three(config("", redis.url()));
  const node::answer c = three.run(again);
  EXPECT_EQ(c.tokens.size(), 20u);
  EXPECT_GT(three.warehouse->tier_stats()[0].errors, 0);
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// A typed segment: the prompt's first 40 tokens in int4 blocks (class 1),
// the rest in the default f32 ones: blocks of both layouts reach the store.
engine_config typed_config(const std::string& disk, const std::string& redis = "") {
  engine_config c = config(disk, redis);
  c.kv_segment_dtypes = {"int4:0.5"};
  return c;
}

request typed_request(const std::string& id) {
  request r = greedy_request(id, long_prompt(), 20);
  r.segments.push_back(prompt_segment{0, 40, "", "int4"});
  return r;
}

// Typed blocks are written through with their own layout and survive a
// restart through the disk tier: a second engine on the same directory
// loads every prompt block, int4 and f32, with the outputs of a cold run. A
// request without the segment keys other blocks and finds none of them.
TEST(warehouse_engine, typed_blocks_survive_a_restart_through_the_disk_tier) {
  const std::string dir = temp_dir("typed");
  const request r = typed_request("a");
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  ASSERT_GE(n_blocks, 3);
  node::answer cold;
  {
    node n(typed_config(""));
    cold = n.run(r);
    EXPECT_GT(n.core->kv_stats().classes.at(1).n_cached, 0) << "no int4 block was made";
  }
  {
    node first(typed_config(dir));
    EXPECT_EQ(first.run(r).tokens, cold.tokens);
    EXPECT_GE(first.warehouse->counters().written, n_blocks);
  }
  node second(typed_config(dir));
  const node::answer b = second.run(r);
  EXPECT_EQ(b.tokens, cold.tokens);
  EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
  EXPECT_EQ(second.core->stats().n_loaded_tokens, n_blocks * 16);
  EXPECT_EQ(second.warehouse->counters().loads, n_blocks);
  EXPECT_EQ(second.warehouse->counters().held_bytes, 0) << "prefetched blocks not released";
  request plain = greedy_request("p", long_prompt(), 4);
  EXPECT_EQ(second.run(plain).usage.cached_tokens, 0) << "f32 blocks found under int4 ones' keys";
  fs::remove_all(dir);
}

TEST(warehouse_engine, typed_blocks_reach_another_engine_through_redis) {
  test::redis_server redis;
  expect_shared_through_redis(typed_config("", redis.url()), typed_request("a"));
}

// A tier without an index (Redis-like) whose lookups and writes hang: every
// call waits at a gate the test opens.
class stuck_tier final : public block_store {
 public:
  stuck_tier() : inner_(make_memory_store()) {}
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Waits until n calls are stuck at the gate (or it is open: a test failing).
  void wait_stuck(int n) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stuck_ >= n || open_; });
  }
  const char* tier() const override { return "redis"; }
  bool indexed() const override { return false; }
  result<std::optional<std::vector<std::byte>>> get(const store_key& k) override {
    wait();
    return inner_->get(k);
  }
  result<std::size_t> count_present(std::span<const store_key> keys) override {
    wait();
    return inner_->count_present(keys);
  }
  status put(const store_key& k, std::span<const std::byte> v) override {
    wait();
    return inner_->put(k, v);
  }
  status erase(const store_key& k) override { return inner_->erase(k); }
  result<std::size_t> erase_tenant(std::uint64_t t) override { return inner_->erase_tenant(t); }
  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    return inner_->for_each(fn);
  }
  store_tier_stats stats() override { return inner_->stats(); }

 private:
  void wait() {
    std::unique_lock lock(mu_);
    ++stuck_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    --stuck_;
  }
  std::unique_ptr<block_store> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int stuck_ = 0;
};

// The engine thread never waits on the store: with the write-back and a
// lookup stuck in a tier, steps go on and requests finish. A request whose
// lookup is in flight waits (not admitted) without holding back the one
// behind it, and computes once the lookup has been out longer than the
// warehouse's timeout (the injected clock says when).
TEST(warehouse_engine, steps_go_on_while_the_store_is_stuck) {
  const request long_one = greedy_request("long", long_prompt(), 12);
  const request short_one = greedy_request("short", "Once upon", 40);  // no full prompt block: no lookup
  ASSERT_GE((long_one.prompt.size() - 1) / 16, 2u);
  ASSERT_LT(short_one.prompt.size(), 17u);
  std::map<std::string, std::vector<token_id>> cold;
  {
    node n(config(""));
    cold["long"] = n.run(long_one).tokens;
    cold["short"] = n.run(short_one).tokens;
  }
  manual_clock clock;
  std::vector<std::unique_ptr<block_store>> tiers;
  auto tier = std::make_unique<stuck_tier>();
  stuck_tier* stuck = tier.get();
  tiers.push_back(std::move(tier));
  warehouse_options o;
  o.clock = &clock;
  o.lookup_timeout_us = 1'000'000;
  kv_warehouse w(std::move(tiers), o);
  auto cc = *make_engine_core_config(stories(), config(""));
  auto core = std::move(*engine_core::create(stories(), cc));
  attach_warehouse(*core, w);

  std::map<std::string, std::vector<token_id>> got;
  std::set<std::string> finished;
  int n_steps = 0;
  const auto step = [&] {
    std::vector<engine_event> ev;
    if (core->step(ev)) ++n_steps;
    for (const engine_event& e : ev) {
      EXPECT_TRUE(e.error.empty()) << e.error;
      got[e.request_id].insert(got[e.request_id].end(), e.tokens.begin(), e.tokens.end());
      if (e.request_finished) finished.insert(e.request_id);
    }
  };
  // The engine runs on a thread of its own, so that a step stuck on the store
  // fails the test instead of hanging it.
  auto engine = std::async(std::launch::async, [&] {
    EXPECT_TRUE(core->add_request(long_one).ok());
    step();
    stuck->wait_stuck(1);  // its lookup hangs in the tier
    EXPECT_TRUE(core->add_request(short_one).ok());
    for (int i = 0; i < 10000 && !finished.contains("short"); ++i) step();
    stuck->wait_stuck(2);  // and so does the write-back of the short request's blocks
    return finished.contains("short") && !finished.contains("long");
  });
  const bool went_on = engine.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!went_on) stuck->open();
  ASSERT_TRUE(went_on) << "an engine step waited on the store";
  EXPECT_TRUE(engine.get()) << "the short request did not finish, or the long one ran before its lookup";
  EXPECT_EQ(got["short"], cold["short"]);
  EXPECT_GT(w.counters().lookups_pending, 0);
  EXPECT_GT(w.counters().queued, 0) << "the short request's blocks were not handed to the write-back";
  // Both stay stuck: past the lookup timeout the long request computes.
  clock.advance_seconds(1.5);
  auto rest = std::async(std::launch::async, [&] {
    for (int i = 0; i < 10000 && !finished.contains("long"); ++i) step();
    return finished.contains("long");
  });
  const bool done = rest.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  stuck->open();
  ASSERT_TRUE(done) << "an engine step waited on the store";
  EXPECT_TRUE(rest.get());
  EXPECT_EQ(got["long"], cold["long"]);
  EXPECT_EQ(core->stats().n_loaded_tokens, 0);
  core.reset();
  w.close();
}

}  // namespace
}  // namespace pagoda
