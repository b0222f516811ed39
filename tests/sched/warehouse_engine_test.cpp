// The engine with a KV warehouse behind its pool (stories260K): prefixes
// survive a restart through the disk tier and cross engines through Redis,
// with the same greedy tokens as a cold run; tenants stay apart in every
// tier; damaged entries and a dead Redis only cost recomputation.
#include <filesystem>

#include <gtest/gtest.h>

#include "common/requests.h"
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
    auto w = make_warehouse(c, model, cc->kv);
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

// gemma2 (tests/data/oracle, window 32) with its sliding layer in window
// slots: blocks reach the disk tier with every layer, and a restart loads the
// prefix, window slots and all: the same greedy tokens as a cold run keeping
// every position without a store.
TEST(warehouse_engine, window_slots_store_and_load_every_layer) {
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

// Two engines with their own pools share one Redis: what one computed, the
// other loads; then Redis dies and both keep answering.
TEST(warehouse_engine, redis_is_shared_between_engines_and_its_death_costs_only_recomputation) {
  test::redis_server redis;
  const request r = greedy_request("a", long_prompt(), 20);
  const int n_blocks = static_cast<int>((r.prompt.size() - 1) / 16);
  node one(config("", redis.url())), two(config("", redis.url()));
  const node::answer a = one.run(r);
  const node::answer b = two.run(r);
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(b.usage.cached_tokens, n_blocks * 16);
  EXPECT_EQ(two.warehouse->counters().loads_by_tier[0], n_blocks);
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
