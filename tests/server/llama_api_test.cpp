// llama.cpp's /props and /slots in its shapes, and CORS (--cors-origin):
// the origin's header on every reply to an allowed page (errors and streams
// too), OPTIONS preflights answered 204, and none of it without the flag.
#include <thread>

#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::test {
namespace {

constexpr const char* k_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, she "
    "saw a big red ball in the park.";

httplib::Headers bearer(const std::string& key) { return {{"Authorization", "Bearer " + key}}; }

json get_json(httplib::Client& c, const std::string& path, const httplib::Headers& headers = {}) {
  auto res = c.Get(path, headers);
  EXPECT_TRUE(res) << path;
  if (!res) return json();
  EXPECT_EQ(res->status, 200) << path << ": " << res->body;
  return json::parse(res->body, nullptr, false);
}

TEST(llama_api, props_in_llama_cpp_shape) {
  const std::string jinja =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
      "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  auto model = stories_with_chat_template(jinja);
  server_setup setup = default_setup();
  setup.engine = engine_config_for(*model, 1024, 3);
  setup.api.served_model_name = "tiny";
  setup.http.version = "9.8.7";
  test_server s(setup, *model);
  auto c = s.client();
  const json p = get_json(*c, "/props");
  ASSERT_TRUE(p.is_object()) << p.dump();
  EXPECT_EQ(p["total_slots"], 3);
  EXPECT_EQ(p["model_alias"], "tiny");
  EXPECT_EQ(p["model_path"], setup.api.model_path);
  EXPECT_EQ(p["chat_template"], jinja);
  EXPECT_EQ(p["chat_format"], "chatml");
  EXPECT_EQ(p["build_info"], "pagoda 9.8.7");
  EXPECT_EQ(p["is_sleeping"], false);
  const json& g = p["default_generation_settings"];
  EXPECT_EQ(g["n_ctx"], setup.engine.max_model_len);
  EXPECT_EQ(g["is_processing"], false);
  // What a request that sets nothing gets (vLLM's defaults), seed "random".
  EXPECT_EQ(g["params"]["temperature"], 1.0);
  EXPECT_EQ(g["params"]["top_p"], 1.0);
  EXPECT_EQ(g["params"]["top_k"], 0);
  EXPECT_EQ(g["params"]["seed"], 4294967295u);
  EXPECT_EQ(c->Post("/props", "{}", "application/json")->status, 405);
}

// /slots while a request runs: one entry, with its request id, prompt, the
// tokens it found cached and the KV it holds; none once it ended.
TEST(llama_api, slots_show_the_running_sequence_and_its_kv) {
  server_setup setup = default_setup();
  setup.step_gate = true;
  setup.engine.max_num_seqs = 2;
  test_server s(setup);
  auto c = s.client();
  EXPECT_EQ(get_json(*c, "/slots"), json::array());
  // A first run of the prompt leaves its blocks in the prefix cache.
  ASSERT_EQ(post_json(*c, "/v1/completions", json{{"prompt", k_story}, {"max_tokens", 1}}.dump()).status, 200);
  ASSERT_TRUE(wait_idle(s));

  s.gate().close();
  http_reply reply;
  thread_joiner j{&s.gate()};
  j.threads.emplace_back([&] {
    reply = post_json(*s.client(), "/v1/completions",
                      json{{"prompt", k_story}, {"max_tokens", 40}, {"ignore_eos", true}, {"temperature", 0.5},
                           {"seed", 1234}}.dump());
  });
  ASSERT_TRUE(poll_until([&] { return s.gate().n_held() == 1; }));
  const std::int64_t steps = s.snapshot().n_steps;
  s.gate().let_through(2);  // its prompt and a decode token; held in the next step
  ASSERT_TRUE(poll_until([&] { return s.snapshot().n_steps >= steps + 2 && s.gate().n_held() == 1; }))
      << "steps " << steps << " -> " << s.snapshot().n_steps << ", held " << s.gate().n_held();
  const json slots = get_json(*c, "/slots");
  ASSERT_EQ(slots.size(), 1u) << slots.dump();
  const json& e = slots[0];
  const int n_prompt = e["n_prompt_tokens"].get<int>();
  EXPECT_GT(n_prompt, 30);
  EXPECT_TRUE(e["id_task"].get<std::string>().starts_with("cmpl-")) << e.dump();
  EXPECT_EQ(e["is_processing"], true);
  EXPECT_EQ(e["n_ctx"], setup.engine.max_model_len);
  const int n_cache = e["n_prompt_tokens_cache"].get<int>();
  EXPECT_GE(n_cache, setup.engine.kv.block_size) << "the earlier run's blocks";
  EXPECT_EQ(e["n_prompt_tokens_processed"].get<int>() + n_cache, n_prompt) << "the rest computed";
  EXPECT_FLOAT_EQ(e["params"]["temperature"].get<float>(), 0.5f);
  EXPECT_EQ(e["params"]["seed"], 1234);
  EXPECT_EQ(e["params"]["max_tokens"], 40);
  const int n_decoded = e["next_token"]["n_decoded"].get<int>();
  EXPECT_GE(n_decoded, 1);
  EXPECT_EQ(e["next_token"]["n_remain"], 40 - n_decoded);
  const int cached = e["kv"]["tokens_cached"].get<int>(), blocks = e["kv"]["blocks"].get<int>();
  const int block_size = setup.engine.kv.block_size;
  EXPECT_GE(cached, n_prompt);
  EXPECT_GE(blocks * block_size, cached) << "its blocks hold its tokens";
  EXPECT_LT((blocks - 1) * block_size, cached + block_size) << "and at most one block more";
  // One of two sequence slots is taken: fail_on_no_slot still answers.
  EXPECT_EQ(c->Get("/slots?fail_on_no_slot=1")->status, 200);
  s.gate().open();
  for (std::thread& t : j.threads) t.join();
  EXPECT_EQ(reply.status, 200) << reply.body;
  ASSERT_TRUE(wait_idle(s));
  EXPECT_EQ(get_json(*c, "/slots"), json::array());
}

// fail_on_no_slot=1 answers 503 while every sequence slot runs; a tenant's
// key sees only its own tenant's sequences, the admin key all of them.
TEST(llama_api, slots_by_tenant_and_when_full) {
  server_setup setup = default_setup();
  setup.step_gate = true;
  setup.engine.max_num_seqs = 1;
  setup.kv_store = true;
  setup.admin_key = "sk-admin";
  ASSERT_TRUE(setup.keys.add("sk-alice", "alice").ok());
  ASSERT_TRUE(setup.keys.add("sk-bob", "bob").ok());
  test_server s(setup);
  auto c = s.client();
  EXPECT_EQ(c->Get("/slots")->status, 401);
  EXPECT_EQ(c->Get("/props")->status, 401);
  s.gate().close();
  thread_joiner j{&s.gate()};
  j.threads.emplace_back([&] {
    post_json(*s.client(), "/v1/completions", json{{"prompt", k_story}, {"max_tokens", 8}}.dump(), bearer("sk-alice"));
  });
  ASSERT_TRUE(poll_until([&] { return s.gate().n_held() == 1; }));
  const std::int64_t steps = s.snapshot().n_steps;
  s.gate().let_through(1);
  ASSERT_TRUE(poll_until([&] { return s.snapshot().n_steps >= steps + 1 && s.gate().n_held() == 1; }));
  EXPECT_EQ(get_json(*c, "/slots", bearer("sk-alice")).size(), 1u);
  EXPECT_EQ(get_json(*c, "/slots", bearer("sk-bob")).size(), 0u) << "alice's request is not bob's to see";
  EXPECT_EQ(get_json(*c, "/slots", bearer("sk-admin")).size(), 1u);
  auto full = c->Get("/slots?fail_on_no_slot=1", bearer("sk-bob"));
  ASSERT_TRUE(full);
  EXPECT_EQ(full->status, 503) << full->body;
  EXPECT_EQ(get_json(*c, "/props", bearer("sk-bob"))["total_slots"], 1);
}

TEST(llama_api, cors_headers_for_allowed_origins_only) {
  server_setup setup = default_setup();
  setup.http.cors_origins = {"http://app.example:3000", "https://other.example"};
  test_server s(setup);
  auto c = s.client();
  auto allow = [](const httplib::Result& r) { return r ? r->get_header_value("Access-Control-Allow-Origin") : "?"; };

  auto ok = c->Get("/health", {{"Origin", "http://app.example:3000"}});
  EXPECT_EQ(allow(ok), "http://app.example:3000");
  EXPECT_EQ(ok->get_header_value("Vary"), "Origin");
  EXPECT_EQ(allow(c->Get("/health", {{"Origin", "https://other.example"}})), "https://other.example");
  auto foreign = c->Get("/health", {{"Origin", "http://evil.example"}});
  ASSERT_TRUE(foreign);
  EXPECT_EQ(foreign->status, 200);
  EXPECT_FALSE(foreign->has_header("Access-Control-Allow-Origin"));
  auto no_origin = c->Get("/health");
  EXPECT_FALSE(no_origin->has_header("Access-Control-Allow-Origin"));

  // Errors and streams carry it too: a page must be able to read them.
  const httplib::Headers from_app = {{"Origin", "http://app.example:3000"}};
  auto bad = c->Post("/v1/completions", from_app, R"({"prompt": "Once", "max_tokens": -1})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(allow(bad), "http://app.example:3000");
  auto streamed = c->Post("/v1/completions", from_app, R"({"prompt": "Once", "max_tokens": 4, "stream": true})",
                          "application/json");
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200);
  EXPECT_EQ(allow(streamed), "http://app.example:3000");
  auto missing = c->Get("/nowhere", from_app);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(allow(missing), "http://app.example:3000");

  // The preflight a browser sends before a POST with JSON and a key.
  auto pre = c->Options("/v1/chat/completions", {{"Origin", "http://app.example:3000"},
                                                 {"Access-Control-Request-Method", "POST"},
                                                 {"Access-Control-Request-Headers", "authorization, content-type, x-stainless-os"}});
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);
  EXPECT_EQ(allow(pre), "http://app.example:3000");
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Methods").find("POST"), std::string::npos);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Headers"), "authorization, content-type, x-stainless-os");
  EXPECT_FALSE(pre->has_header("Content-Length")) << "a 204 has no body";
  EXPECT_TRUE(pre->body.empty());
  // Anything but plain header names is not echoed.
  auto odd = c->Options("/v1/completions", {{"Origin", "http://app.example:3000"},
                                            {"Access-Control-Request-Headers", "x-a; evil=1"}});
  EXPECT_EQ(odd->get_header_value("Access-Control-Allow-Headers"), "Authorization, Content-Type");
}

TEST(llama_api, cors_any_origin_and_none_without_the_flag) {
  {
    server_setup setup = default_setup();
    setup.http.cors_origins = {"*"};
    test_server s(setup);
    auto r = s.client()->Get("/v1/models", {{"Origin", "http://anything.example"}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), "*");
  }
  test_server s(default_setup());
  auto c = s.client();
  auto r = c->Get("/v1/models", {{"Origin", "http://anything.example"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_FALSE(r->has_header("Access-Control-Allow-Origin"));
  auto pre = c->Options("/v1/completions", {{"Origin", "http://anything.example"}});
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 405) << "no preflight answers without --cors-origin";
  EXPECT_FALSE(pre->has_header("Access-Control-Allow-Origin"));
}

}  // namespace
}  // namespace pagoda::test
