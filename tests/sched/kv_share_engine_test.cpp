// Cross-layer KV sharing through the engine (--kv-share, a declared CLA
// model): the layout and pool follow the layer map, and sharing works with
// batching, prefix caching, quantized KV and KV policies.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/requests.h"
#include "common/synth_model.h"
#include "model/kv_share.h"
#include "sched/engine_setup.h"
#include "store/store_key.h"

namespace pagoda {
namespace {

using test::greedy_request;
using test::stories;

engine_config options(const std::string& share, const std::string& dtype = "f32") {
  engine_config c;
  c.kv_cache_dtype = dtype;
  c.max_num_seqs = 32;
  c.max_kv_tokens = 16384;
  c.kv_share = share;
  return c;
}

std::unique_ptr<engine_core> engine(const engine_config& c, const llama_model& m = stories()) {
  auto cc = make_engine_core_config(m, c);
  EXPECT_TRUE(cc.ok()) << cc.error().message();
  if (!cc.ok()) return nullptr;
  cc->max_model_len = 512;
  auto e = engine_core::create(m, *cc);
  EXPECT_TRUE(e.ok()) << e.error().message();
  return e.ok() ? std::move(*e) : nullptr;
}

std::map<std::string, std::vector<token_id>> run(engine_core& e, const std::vector<request>& reqs) {
  for (const request& r : reqs) EXPECT_TRUE(e.add_request(r).ok());
  std::map<std::string, std::vector<token_id>> out;
  std::vector<engine_event> ev;
  for (int guard = 0; e.has_work() && guard < 100000; ++guard) {
    ev.clear();
    e.step(ev);
    EXPECT_TRUE(e.kv().check_invariants().ok());
    for (const engine_event& x : ev) out[x.request_id].insert(out[x.request_id].end(), x.tokens.begin(), x.tokens.end());
  }
  return out;
}

std::vector<request> shared_prefix_requests(int n) {
  std::vector<request> reqs;
  for (int i = 0; i < n; ++i)
    reqs.push_back(greedy_request("r" + std::to_string(i),
                                  "Once upon a time there was a little dog. The dog liked to play. Story " +
                                      std::to_string(i) + ": one day",
                                  32));
  return reqs;
}

// Requests batched together on `batched` give each request's tokens when it
// runs alone on a fresh engine of the same options; returns the batch's.
std::map<std::string, std::vector<token_id>> expect_batch_invariant(engine_core& batched, const engine_config& c,
                                                                    const std::vector<request>& reqs) {
  const auto together = run(batched, reqs);
  for (const request& r : reqs) {
    auto single = engine(c);
    EXPECT_EQ(run(*single, {r}).at(r.id), together.at(r.id)) << c.kv_share << " " << c.kv_cache_dtype << " " << r.id;
  }
  return together;
}

TEST(kv_share_engine, from_past_the_last_layer_is_the_unshared_engine) {
  const int n = stories().hparams().n_layer;
  auto a = make_kv_layout(stories(), options("none"));
  auto b = make_kv_layout(stories(), options("reuse:from=" + std::to_string(n)));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(b->layer_map.empty());
  EXPECT_EQ(layout_fingerprint(*a), layout_fingerprint(*b));
  const auto reqs = shared_prefix_requests(8);
  auto plain = engine(options("none"));
  auto past = engine(options("reuse:from=" + std::to_string(n)));
  ASSERT_TRUE(plain && past);
  EXPECT_EQ(run(*plain, reqs), run(*past, reqs));
}

// The layout has one KV layer per producer: bytes per token and the pool
// (a MiB budget buys that many more blocks) follow; the store's fingerprint
// names the sharing.
TEST(kv_share_engine, layout_and_pool_follow_the_map) {
  const int n = stories().hparams().n_layer;  // 5: reuse:from=1 pairs (1, 2), (3, 4)
  auto plain = make_kv_layout(stories(), options("none", "int8"));
  auto shared = make_kv_layout(stories(), options("reuse:from=1", "int8"));
  ASSERT_TRUE(plain.ok() && shared.ok()) << shared.error().message();
  EXPECT_EQ(shared->n_layers, 3);
  EXPECT_EQ(shared->n_model_layers(), n);
  EXPECT_EQ(shared->layer_map, (std::vector<std::int32_t>{0, 1, 1, 2, 2}));
  EXPECT_NEAR(shared->bytes_per_token() / plain->bytes_per_token(), 3.0 / 5.0, 1e-9);
  EXPECT_NE(layout_fingerprint(*plain), layout_fingerprint(*shared));
  kv_layout renamed = *shared;
  renamed.sharing = "minicache:from=1";
  EXPECT_NE(layout_fingerprint(renamed), layout_fingerprint(*shared)) << "one map, two sharings: other bytes";
  engine_config a = options("none", "int8"), b = options("reuse:from=1", "int8");
  a.max_kv_tokens = b.max_kv_tokens = 0;
  a.kv_cache_size_mib = b.kv_cache_size_mib = 8;
  auto ca = make_engine_core_config(stories(), a), cb = make_engine_core_config(stories(), b);
  ASSERT_TRUE(ca.ok() && cb.ok());
  EXPECT_NEAR(static_cast<double>(cb->n_blocks) / static_cast<double>(ca->n_blocks), 5.0 / 3.0, 0.05);
}

// 16 requests with shared prefixes batched together give each request's
// tokens when it runs alone, with int8 KV and prefix caching (the second
// wave hits the first's blocks), and under a KV policy.
TEST(kv_share_engine, batching_prefix_caching_quantized_kv_and_policies) {
  const auto reqs = shared_prefix_requests(16);
  for (const char* dtype : {"f32", "int8"}) {
    auto batched = engine(options("reuse:from=1", dtype));
    ASSERT_TRUE(batched);
    const auto together = run(*batched, reqs);
    auto single = engine(options("reuse:from=1", dtype));
    for (const request& r : reqs) {
      const auto alone = run(*single, {r});
      EXPECT_EQ(alone.at(r.id), together.at(r.id)) << dtype << " " << r.id;
    }
    EXPECT_GT(single->kv_stats().n_prefix_hit_tokens, 0) << dtype << ": no prefix hit";
    auto unshared = engine(options("none", dtype));
    EXPECT_NE(run(*unshared, reqs), together) << dtype << ": sharing changed nothing";
  }
  engine_config p = options("reuse:from=1", "int8");
  p.kv_policy = "h2o:budget=32";
  auto policed = engine(p);
  ASSERT_TRUE(policed);
  const auto out = run(*policed, reqs);
  for (const request& r : reqs) EXPECT_EQ(out.at(r.id).size(), 32u) << r.id;
  EXPECT_GT(policed->stats().n_policy_compactions, 0);
  EXPECT_EQ(policed->kv_stats().n_blocks_used, 0);
}

// Speculation over shared layers: early exit through the model's first
// layers and the int4 mirror (a group of the same KV layers) draft, and
// greedy outputs stay the shared engine's own.
TEST(kv_share_engine, speculation_over_shared_layers_keeps_outputs_exact) {
  const auto reqs = shared_prefix_requests(12);
  auto plain = engine(options("reuse:from=1"));
  ASSERT_TRUE(plain);
  const auto expected = run(*plain, reqs);
  for (const char* speculative : {"early-exit:k=3,layers=3", "self:view=int4,k=3"}) {
    engine_config c = options("reuse:from=1");
    c.speculative = speculative;
    auto spec = engine(c);
    ASSERT_TRUE(spec) << speculative;
    EXPECT_EQ(run(*spec, reqs), expected) << speculative;
    const std::string name = std::string(speculative).substr(0, std::string(speculative).find(':'));
    EXPECT_GT(spec->stats().spec_decode.at(name).n_accepted_tokens, 0) << speculative;
    EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << speculative;
  }
}

TEST(kv_share_engine, a_declared_cla_model_runs_and_takes_no_other_sharing) {
  synth_options o = test::f32_synth_options("tiny256", 4);
  o.cla = 2;
  auto cla = test::load_synth(o, "kv_share_engine_cla2");
  ASSERT_TRUE(cla);
  auto layout = make_kv_layout(*cla, options("none"));
  ASSERT_TRUE(layout.ok()) << layout.error().message();
  EXPECT_EQ(layout->n_layers, 2);
  EXPECT_EQ(layout->sharing, "declared");
  auto e = engine(options("none"), *cla);
  ASSERT_TRUE(e);
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) {
    std::vector<token_id> prompt;
    for (int j = 0; j < 40; ++j) prompt.push_back(static_cast<token_id>(3 + (j * 31 + i) % 500));
    reqs.push_back(test::greedy_ids("c" + std::to_string(i), prompt, 16));
  }
  const auto out = run(*e, reqs);
  for (const request& r : reqs) EXPECT_EQ(out.at(r.id).size(), 16u);
  auto other = make_kv_layout(*cla, options("reuse:from=0"));
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.error().message().find("declares its own KV sharing"), std::string::npos) << other.error().message();
}

TEST(kv_share_engine, bad_specs_name_the_parameter) {
  const llama_hparams& hp = stories().hparams();
  struct bad {
    const char* spec;
    const char* says;
  };
  for (const bad& b : {bad{"reuse:from=9", "from=9: this model has 5 layers"}, bad{"reuse", "from=L is required"},
                       bad{"reuse:from=1,x=2", "unknown parameter 'x'"}, bad{"splice:from=1", "unknown sharing 'splice'"},
                       bad{"none:from=1", "takes no parameters"}}) {
    auto p = plan_kv_sharing(hp, b.spec);
    ASSERT_FALSE(p.ok()) << b.spec;
    EXPECT_NE(p.error().message().find(b.says), std::string::npos) << b.spec << ": " << p.error().message();
  }
  // Per-layer types that differ between a layer and the one whose KV it reads.
  engine_config c = options("reuse:from=1");
  c.kv_layer_types = "0-1:f16,2-:int8";
  auto l = make_kv_layout(stories(), c);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.error().message().find("their KV types differ"), std::string::npos) << l.error().message();
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// MiniCache through the engine: the same pairs as reuse, one KV layer each
// plus the upper layer's side data; from past the last layer is the unshared
// engine; batching is invariant when each prompt is prefilled in one step;
// prefix caching, int8 and sealed int4 KV and KV policies run; what it
// cannot give (speculation's exact outputs) is refused.
TEST(kv_share_engine, minicache_layout_batching_caching_and_refusals) {
  const int n = stories().hparams().n_layer;
  auto plain = make_kv_layout(stories(), options("none"));
  auto past = make_kv_layout(stories(), options("minicache:from=" + std::to_string(n)));
  ASSERT_TRUE(plain.ok() && past.ok()) << past.error().message();
  EXPECT_TRUE(past->layer_map.empty());
  EXPECT_TRUE(past->merge_reader.empty());
  EXPECT_EQ(layout_fingerprint(*plain), layout_fingerprint(*past));
  const auto reqs = shared_prefix_requests(16);
  {
    auto a = engine(options("none"));
    auto b = engine(options("minicache:from=" + std::to_string(n)));
    ASSERT_TRUE(a && b);
    EXPECT_EQ(run(*a, reqs), run(*b, reqs));
  }
  auto merged = make_kv_layout(stories(), options("minicache:from=1,retain=0.125", "int8"));
  ASSERT_TRUE(merged.ok()) << merged.error().message();
  EXPECT_EQ(merged->n_layers, 3);
  EXPECT_EQ(merged->merge_reader, (std::vector<std::int32_t>{-1, 2, 4}));
  EXPECT_EQ(merged->merge_retain, 2);
  EXPECT_EQ(merged->sharing, "minicache:from=1,t=0.6,retain=2");
  auto reused = make_kv_layout(stories(), options("reuse:from=1", "int8"));
  ASSERT_TRUE(reused.ok());
  EXPECT_NE(layout_fingerprint(*merged), layout_fingerprint(*reused));
  EXPECT_EQ(merged->bytes_per_block(), reused->bytes_per_block() + merged->merge_bytes_per_block(1) +
                                           merged->merge_bytes_per_block(2));
  EXPECT_LT(merged->bytes_per_token(), plain->bytes_per_token());

  // Prompts that share no block: a prefix hit would split a prompt into two
  // steps, and a merged pair's lower layer reads its own rows of a step's
  // earlier tokens unmerged (docs/kv-sharing.md), so hits may change tokens.
  std::vector<request> distinct;
  for (int i = 0; i < 16; ++i)
    distinct.push_back(greedy_request("d" + std::to_string(i),
                                      "Story " + std::to_string(i) + ". Once upon a time there was a little dog.", 32));
  for (const char* dtype : {"f32", "int8", "int4"}) {
    auto batched = engine(options("minicache:from=1", dtype));
    ASSERT_TRUE(batched);
    expect_batch_invariant(*batched, options("minicache:from=1", dtype), distinct);
    const auto together = run(*batched, reqs);
    // A second wave hits the first's merged blocks and finishes; nothing leaks.
    const auto again = run(*batched, reqs);
    for (const request& r : reqs) EXPECT_EQ(again.at(r.id).size(), 32u) << dtype << " " << r.id;
    EXPECT_GT(batched->kv_stats().n_prefix_hit_tokens, 0) << dtype;
    EXPECT_EQ(batched->kv_stats().n_blocks_used, 0) << dtype;
    auto reuse = engine(options("reuse:from=1", dtype));
    EXPECT_NE(run(*reuse, reqs), together) << dtype << ": minicache is reuse";
  }
  // KV policies: a sparse read, and policies that evict or fold tokens (their
  // compactions carry the side data with the slots).
  for (const char* policy : {"quest:budget=0.5,min_context=32", "h2o:budget=32", "snapkv:budget=24", "window:budget=32",
                             "window:budget=24,positions=cache", "merge:budget=32", "cluster:budget=32",
                             "pyramid:budget=32", "int4 h2o:budget=32", "int4 snapkv:budget=24"}) {
    // "int4 NAME": the policy over sealed int4 KV (compactions reseal the blocks they rewrite).
    const bool int4 = std::string(policy).rfind("int4 ", 0) == 0;
    engine_config c = options("minicache:from=1,retain=0.125", int4 ? "int4" : "f16");
    c.kv_policy = int4 ? policy + 5 : policy;
    auto e = engine(c);
    ASSERT_TRUE(e) << policy;
    const auto out = run(*e, reqs);
    for (const request& r : reqs) EXPECT_EQ(out.at(r.id).size(), 32u) << policy << " " << r.id;
    if (std::string(policy).rfind("quest", 0) != 0) {
      EXPECT_GT(e->stats().n_policy_compactions, 0) << policy;
    }
    EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << policy;
  }

  // Refused, each with its reason.
  auto e = engine(options("minicache:from=1"));
  ASSERT_TRUE(e);
  request r = reqs[0];
  engine_config speculative = options("minicache:from=1");
  speculative.speculative = "ngram:k=3";
  auto cc = make_engine_core_config(stories(), speculative);
  ASSERT_TRUE(cc.ok());
  auto refused = engine_core::create(stories(), *cc);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("plain decoding's tokens"), std::string::npos) << refused.error().message();
  r.speculative = "ngram:k=3";
  const status spec_st = e->add_request(r);
  ASSERT_FALSE(spec_st.ok());
  EXPECT_NE(spec_st.message().find("plain decoding's tokens"), std::string::npos) << spec_st.message();
  auto sealed = make_kv_layout(stories(), options("minicache:from=1", "int4"));
  ASSERT_TRUE(sealed.ok()) << sealed.error().message();
  EXPECT_TRUE(sealed->has_sealed());
  for (const char* bad : {"minicache:from=1,t=2", "minicache:from=1,retain=1.5", "minicache", "minicache:from=1,x=1"})
    EXPECT_FALSE(parse_kv_share_spec(bad).ok()) << bad;
}

}  // namespace
}  // namespace pagoda
