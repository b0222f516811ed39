// The HTTP server over loopback: response objects and the SSE wire format,
// disconnects freeing blocks, the waiting cap (429), keys and tenants,
// /v1/models, /health and /metrics. (The OpenAI SDK's view of the same
// server is in openai_sdk_test.cpp.)
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <map>

#include <gtest/gtest.h>

#include "server/hostile_util.h"
#include "server/server_util.h"

namespace pagoda::test {
namespace {

const char* k_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, she saw "
    "a big tree in the garden.";

std::string completion_body(const std::string& prompt, int max_tokens, json extra = json::object()) {
  json j = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
  j.update(extra);
  return j.dump();
}

// With an evicting KV policy the usage says how much of the context the KV
// keeps (budgets are exact: h2o:budget=16 keeps 16 of every completion's
// tokens); with full KV it says nothing of it.
TEST(server, usage_reports_the_tokens_an_evicting_policy_keeps) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply r = post_json(*c, "/v1/completions",
                           completion_body(k_story, 12, {{"ignore_eos", true}, {"n", 2}, {"kv_policy", "h2o:budget=16"}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& u = r.json_body["usage"];
  const int n_prompt = u["prompt_tokens"];
  ASSERT_GT(n_prompt, 16);
  // Each completion computed its prompt and 11 of its 12 tokens (the last is sampled, never computed).
  EXPECT_EQ(u["kv_tokens_seen"], 2 * (n_prompt + 11));
  EXPECT_EQ(u["kv_tokens_kept"], 2 * 16);
  http_reply full = post_json(*c, "/v1/completions", completion_body(k_story, 12, {{"ignore_eos", true}}));
  ASSERT_EQ(full.status, 200) << full.body;
  EXPECT_FALSE(full.json_body["usage"].contains("kv_tokens_kept")) << full.json_body["usage"];
}

// A sparse-read policy keeps everything and reads part of it: the usage says
// what fraction of the visible KV its attention read, per phase, and the
// fractions agree with /metrics' read counters for that policy; full KV (which
// reads all it sees) reports nothing of it.
TEST(server, usage_reports_what_a_sparse_read_policy_read) {
  server_setup setup = default_setup();
  setup.engine.kv.key_summaries = true;  // quest's block bounds
  test_server s(std::move(setup));
  auto c = s.client();
  const std::string prompt = std::string(k_story) + " " + k_story + " " + k_story + " " + k_story;
  http_reply r = post_json(*c, "/v1/completions",
                           completion_body(prompt, 24, {{"ignore_eos", true}, {"kv_policy", "quest:pages=2,min_context=32"}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& u = r.json_body["usage"];
  ASSERT_TRUE(u.contains("kv_read")) << u;
  const double decode = u["kv_read"]["decode_fraction"], prompt_read = u["kv_read"]["prompt_fraction"];
  EXPECT_FALSE(u.contains("kv_tokens_kept")) << u;  // it evicts nothing
  // Prompt chunks read everything; each decode step reads 2 of ~10 blocks plus the newest.
  EXPECT_EQ(prompt_read, 1.0);
  EXPECT_GT(decode, 0.1);
  EXPECT_LT(decode, 0.5);
  const double read = metric_value(s.port(), "pagoda:kv_read_tokens_total{policy=\"quest\",phase=\"decode\"}");
  const double visible = metric_value(s.port(), "pagoda:kv_visible_tokens_total{policy=\"quest\",phase=\"decode\"}");
  ASSERT_GT(visible, 0) << "the decode reads were not counted";
  EXPECT_NEAR(decode, read / visible, 1e-9);
  http_reply full = post_json(*c, "/v1/completions", completion_body(prompt, 8, {{"ignore_eos", true}}));
  ASSERT_EQ(full.status, 200) << full.body;
  EXPECT_FALSE(full.json_body["usage"].contains("kv_read")) << full.json_body["usage"];
}

TEST(server, completion_object) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply r = post_json(*c, "/v1/completions", completion_body("Once upon a time", 12, {{"ignore_eos", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& j = r.json_body;
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "stories260K");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_TRUE(j["created"].is_number_integer());
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_FALSE(j["choices"][0]["text"].get<std::string>().empty());
  const json& u = j["usage"];
  const int n_prompt = static_cast<int>(stories().vocab().encode("Once upon a time", true).size());
  EXPECT_EQ(u["prompt_tokens"], n_prompt);
  EXPECT_EQ(u["completion_tokens"], 12);
  EXPECT_EQ(u["total_tokens"], n_prompt + 12);
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 0);

  // The same greedy request twice: same text, and the second one's full prompt
  // blocks come from the cache. (Not k_story: that is what "Once upon a time"
  // just generated, and a finished sequence's blocks are cached too.)
  const std::string prompt = "The dog ran to the big park with his ball. He was very happy and wanted to play all day.";
  http_reply a = post_json(*c, "/v1/completions", completion_body(prompt, 8));
  http_reply b = post_json(*c, "/v1/completions", completion_body(prompt, 8));
  ASSERT_EQ(a.status, 200);
  ASSERT_EQ(b.status, 200);
  EXPECT_EQ(a.json_body["choices"][0]["text"], b.json_body["choices"][0]["text"]);
  EXPECT_EQ(a.json_body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const int cached = b.json_body["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, 0);
  EXPECT_EQ(cached % 16, 0);
}

TEST(server, chat_object_and_template_override) {
  server_setup setup = default_setup();
  setup.api.chat_template = "chatml";
  test_server s(setup);
  auto c = s.client();
  json body = {{"messages", {{{"role", "system"}, {"content", "Be kind."}}, {{"role", "user"}, {"content", "Once"}}}},
               {"max_tokens", 4},
               {"temperature", 0}};
  http_reply r = post_json(*c, "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json& j = r.json_body;
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_string());
  // The prompt is the ChatML rendering, tokenized.
  const std::string rendered =
      "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce<|im_end|>\n<|im_start|>assistant\n";
  const tokenizer& v = stories().vocab();
  EXPECT_EQ(j["usage"]["prompt_tokens"], v.encode(rendered, v.add_bos_default(), true).size());
}

TEST(server, chat_template_from_the_model) {
  // A ChatML template in the GGUF: recognised at startup and applied.
  auto model = stories_with_chat_template(
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
      "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}");
  ASSERT_NE(model, nullptr);
  std::string warning;
  auto ctx = server::make_api_context(*model, 512, default_setup().api, &warning);
  ASSERT_TRUE(ctx.ok());
  EXPECT_EQ(ctx->chat, server::chat_format::chatml);
  EXPECT_TRUE(warning.empty());
  server_setup setup = default_setup();
  setup.engine = engine_config_for(*model);
  test_server s(setup, *model);
  auto c = s.client();
  json body = {{"messages", {{{"role", "user"}, {"content", "Once"}}}}, {"max_tokens", 2}, {"temperature", 0}};
  http_reply r = post_json(*c, "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const tokenizer& v = model->vocab();
  EXPECT_EQ(r.json_body["usage"]["prompt_tokens"],
            v.encode("<|im_start|>user\nOnce<|im_end|>\n<|im_start|>assistant\n", v.add_bos_default(), true).size());

  // A template of no known family: plain, with a warning; the override wins over both.
  auto odd = stories_with_chat_template("{{ messages[0]['content'] }}");
  ASSERT_NE(odd, nullptr);
  ctx = server::make_api_context(*odd, 512, default_setup().api, &warning);
  ASSERT_TRUE(ctx.ok());
  EXPECT_EQ(ctx->chat, server::chat_format::plain);
  EXPECT_FALSE(warning.empty());
  server::api_options forced = default_setup().api;
  forced.chat_template = "gemma";
  EXPECT_EQ(server::make_api_context(*odd, 512, forced, nullptr)->chat, server::chat_format::gemma);
  forced.chat_template = "jinja2";
  EXPECT_FALSE(server::make_api_context(*odd, 512, forced, nullptr).ok());
}

// Gemma 2/3, Phi-3 and Qwen3 templates in the GGUF are recognised at startup
// like the others (excerpts of their Jinja with the markers).
TEST(server, chat_templates_of_gemma_phi3_qwen3_from_the_model) {
  const std::pair<const char*, server::chat_format> cases[] = {
      {"{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
       "'\\n\\n' -%}{%- endif -%}{{ '<start_of_turn>' + role + '\\n' }}{{ '<end_of_turn>\\n' }}",
       server::chat_format::gemma},
      {"{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\\n' + "
       "message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
       "{% else %}{{ eos_token }}{% endif %}",
       server::chat_format::phi3},
      {"{{- '<|im_start|>' + message.role + '\\n' + content }}{%- if add_generation_prompt %}{{- "
       "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- "
       "'<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
       server::chat_format::qwen3},
  };
  for (const auto& [jinja, expected] : cases) {
    auto model = stories_with_chat_template(jinja);
    ASSERT_NE(model, nullptr);
    std::string warning;
    auto ctx = server::make_api_context(*model, 512, default_setup().api, &warning);
    ASSERT_TRUE(ctx.ok());
    EXPECT_EQ(ctx->chat, expected) << server::chat_format_name(ctx->chat) << " for " << jinja;
    EXPECT_TRUE(warning.empty());
  }
}

TEST(server, streaming_wire_format) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply plain = post_json(*c, "/v1/completions", completion_body(k_story, 10, {{"ignore_eos", true}}));
  ASSERT_EQ(plain.status, 200);

  auto res = c->Post("/v1/completions",
                     completion_body(k_story, 10,
                                     {{"ignore_eos", true}, {"stream", true}, {"stream_options", {{"include_usage", true}}}}),
                     "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  std::vector<std::string> events = sse_data(res->body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (std::size_t i = 0; i + 2 < events.size(); ++i) {
    json j = json::parse(events[i]);
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_TRUE(j["usage"].is_null());  // null on every chunk but the usage one
    text += j["choices"][0]["text"].get<std::string>();
  }
  json last = json::parse(events[events.size() - 3]);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 10);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], plain.json_body["usage"]["prompt_tokens"]);
  EXPECT_EQ(text, plain.json_body["choices"][0]["text"]);

  // Chat: a role delta first, then content deltas, no usage without include_usage.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
               {"max_tokens", 5}, {"temperature", 0}, {"stream", true}, {"n", 2}};
  res = c->Post("/v1/chat/completions", chat.dump(), "application/json");
  ASSERT_TRUE(res);
  events = sse_data(res->body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string texts[2];
  int finished = 0;
  for (std::size_t i = 0; i + 1 < events.size(); ++i) {
    json j = json::parse(events[i]);
    EXPECT_EQ(j["object"], "chat.completion.chunk");
    EXPECT_FALSE(j.contains("usage"));
    const json& ch = j["choices"][0];
    int idx = ch["index"];
    ASSERT_TRUE(idx == 0 || idx == 1);
    if (i < 2) {
      EXPECT_EQ(ch["delta"]["role"], "assistant");
    }
    if (ch["delta"].contains("content")) texts[idx] += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) ++finished;
  }
  EXPECT_EQ(finished, 2);
  EXPECT_EQ(texts[0], texts[1]);  // greedy: both completions agree
}

TEST(server, logprobs_shapes) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply r = post_json(*c, "/v1/completions", completion_body("Once upon a time", 3, {{"logprobs", 2}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& lp = r.json_body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u);
  ASSERT_EQ(lp["token_logprobs"].size(), 3u);
  ASSERT_EQ(lp["top_logprobs"].size(), 3u);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
  EXPECT_LE(lp["token_logprobs"][0].get<double>(), 0.0);
  EXPECT_EQ(lp["text_offset"][0], 0);
  // Greedy: the chosen token is the most likely one.
  EXPECT_NEAR(lp["token_logprobs"][0].get<double>(), lp["top_logprobs"][0][lp["tokens"][0].get<std::string>()].get<double>(), 1e-6);

  json chat = {{"messages", {{{"role", "user"}, {"content", "Once"}}}}, {"max_tokens", 2}, {"logprobs", true},
               {"top_logprobs", 3}, {"temperature", 0}};
  r = post_json(*c, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json& content = r.json_body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_TRUE(content[0]["token"].is_string());
  EXPECT_TRUE(content[0]["bytes"].is_array());
  EXPECT_EQ(content[0]["top_logprobs"].size(), 3u);
}

// logit_bias +100 on one token makes greedy decoding repeat it; tokens named
// by id (return_tokens_as_token_ids) show it, and the chosen token's logprob
// is exactly its own entry among the alternatives.
TEST(server, logit_bias_and_token_ids) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply r = post_json(*c, "/v1/completions",
                           completion_body("Once upon a time", 6,
                                           {{"logit_bias", {{"77", 100}}}, {"ignore_eos", true}, {"logprobs", 3},
                                            {"return_tokens_as_token_ids", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& lp = r.json_body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(lp["tokens"][i], "token_id:77");
    const json& top = lp["top_logprobs"][i];
    EXPECT_EQ(top.size(), 3u);
    for (const auto& [name, l] : top.items()) EXPECT_EQ(name.rfind("token_id:", 0), 0u) << name;
    // The logprobs are the model's own (raw, vLLM's default): biased, token 77
    // would have a probability of ~1.
    EXPECT_LT(lp["token_logprobs"][i].get<double>(), std::log(0.5)) << lp.dump();
  }
  // Without the bias, the chosen token is the likeliest and its two numbers are one.
  r = post_json(*c, "/v1/completions",
                completion_body("Once upon a time", 6, {{"logprobs", 2}, {"return_tokens_as_token_ids", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& plain = r.json_body["choices"][0]["logprobs"];
  for (std::size_t i = 0; i < plain["tokens"].size(); ++i) {
    const std::string tok = plain["tokens"][i].get<std::string>();
    ASSERT_TRUE(plain["top_logprobs"][i].contains(tok)) << plain.dump();
    EXPECT_EQ(plain["token_logprobs"][i].get<double>(), plain["top_logprobs"][i][tok].get<double>());
  }
  // Chat: the same in its shape.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Once"}}}}, {"max_tokens", 3}, {"logprobs", true},
               {"top_logprobs", 2}, {"temperature", 0}, {"return_tokens_as_token_ids", true}};
  r = post_json(*c, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  for (const json& e : r.json_body["choices"][0]["logprobs"]["content"]) {
    EXPECT_EQ(e["token"].get<std::string>().rfind("token_id:", 0), 0u);
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);
    EXPECT_EQ(e["top_logprobs"][0]["logprob"].get<double>(), e["logprob"].get<double>());
  }
}

// Greedy decoding with frequency and presence penalties, checked against the
// returned raw logprobs: at every step the chosen token has the highest
// penalised score (raw logprob - frequency x count - presence) of all the
// alternatives listed, counting the tokens generated before it.
TEST(server, penalties_pick_the_best_penalised_token) {
  test_server s(default_setup());
  auto c = s.client();
  const double freq = 0.7, presence = 0.4;
  http_reply plain = post_json(*c, "/v1/completions", completion_body(k_story, 40, {{"ignore_eos", true}}));
  http_reply r = post_json(*c, "/v1/completions",
                           completion_body(k_story, 40,
                                           {{"frequency_penalty", freq}, {"presence_penalty", presence}, {"logprobs", 20},
                                            {"ignore_eos", true}, {"return_tokens_as_token_ids", true}}));
  ASSERT_EQ(plain.status, 200) << plain.body;
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.json_body["choices"][0]["text"], plain.json_body["choices"][0]["text"]);
  const json& lp = r.json_body["choices"][0]["logprobs"];
  std::map<std::string, int> counts;
  ASSERT_EQ(lp["tokens"].size(), 40u);
  auto score = [&](const std::string& tok, double raw) {
    const int n = counts.contains(tok) ? counts[tok] : 0;
    return raw - freq * n - (n > 0 ? presence : 0.0);
  };
  int n_penalised_steps = 0;
  for (std::size_t i = 0; i < 40; ++i) {
    const std::string tok = lp["tokens"][i].get<std::string>();
    const double chosen = score(tok, lp["token_logprobs"][i].get<double>());
    double best_raw = -1e30;
    std::string best_raw_tok;
    for (const auto& [alt, l] : lp["top_logprobs"][i].items()) {
      EXPECT_GE(chosen, score(alt, l.get<double>()) - 1e-4) << "step " << i << ": " << tok << " vs " << alt;
      if (l.get<double>() > best_raw) best_raw = l.get<double>(), best_raw_tok = alt;
    }
    n_penalised_steps += best_raw_tok != tok;
    ++counts[tok];
  }
  EXPECT_GT(n_penalised_steps, 0);  // the penalties changed some choices
  // repetition_penalty is accepted and changes the greedy text of a repetitive story.
  r = post_json(*c, "/v1/completions", completion_body(k_story, 40, {{"repetition_penalty", 1.5}, {"ignore_eos", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.json_body["choices"][0]["text"], plain.json_body["choices"][0]["text"]);
  // A value that passes validation works (it used to fail in the engine with
  // the internal request id in its message): top_p 5e-324 keeps the top token.
  r = post_json(*c, "/v1/completions", completion_body("Once upon a time", 4, {{"top_p", 5e-324}, {"temperature", 1}}));
  ASSERT_EQ(r.status, 200) << r.body;
  http_reply g = post_json(*c, "/v1/completions", completion_body("Once upon a time", 4));
  EXPECT_EQ(r.json_body["choices"][0]["text"], g.json_body["choices"][0]["text"]);
  // Out of range: a 400 naming the field.
  r = post_json(*c, "/v1/completions", completion_body(k_story, 4, {{"presence_penalty", 2.5}}));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.json_body["error"]["param"], "presence_penalty");
}

TEST(server, disconnect_cancels_and_frees_blocks) {
  test_server s(default_setup());
  const std::string long_request = completion_body(k_story, 400, {{"ignore_eos", true}});
  // The client sends the request and hangs up while it runs. stories260K
  // generates 400 tokens in a few tens of milliseconds, so on a loaded
  // machine the request can finish before the hang-up is seen: each mode
  // tries until one request is cut short. Every try must free its blocks.
  int aborted = 0;
  for (bool stream : {false, true}) {
    json body = json::parse(long_request);
    body["stream"] = stream;
    const std::string payload = body.dump();
    const std::string http = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                             std::to_string(payload.size()) + "\r\n\r\n" + payload;
    bool cut_short = false;
    for (int attempt = 0; attempt < 10 && !cut_short; ++attempt) {
      const std::int64_t generated_before = s.snapshot().n_generated_tokens;
      int fd = raw_connect(s.port());
      ASSERT_GE(fd, 0);
      ASSERT_EQ(send(fd, http.data(), http.size(), MSG_NOSIGNAL), static_cast<ssize_t>(http.size()));
      // Wait until the request holds blocks, then hang up.
      bool running = false;
      for (int i = 0; i < 2000 && !running; ++i) {
        running = s.snapshot().kv.n_blocks_used > 0;
        if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      ASSERT_TRUE(running);
      close(fd);
      ASSERT_TRUE(wait_idle(s, 10000)) << "stream=" << stream;
      engine_snapshot snap = s.snapshot();
      EXPECT_EQ(snap.kv.n_blocks_used, 0);
      cut_short = snap.n_generated_tokens - generated_before < 400;  // stopped before the end
    }
    EXPECT_TRUE(cut_short) << "stream=" << stream << ": no request was cut short by its hang-up in 10 tries";
    aborted += cut_short;
  }
  auto m = s.metrics();
  // A try whose hang-up lands after its last token may still end as an abort.
  EXPECT_GE(metric(m, "pagoda:request_success_total{finished_reason=\"abort\"}"), aborted);
  EXPECT_EQ(metric(m, "pagoda:kv_cache_blocks{state=\"used\"}"), 0);
}

// Joins a thread on every exit path (a failed ASSERT included).
struct joiner {
  std::thread& t;
  ~joiner() {
    if (t.joinable()) t.join();
  }
};

TEST(server, full_queue_answers_429) {
  server_setup setup = default_setup();
  setup.engine.max_num_seqs = 1;
  setup.engine.max_model_len = 2048;  // r1 runs long enough for r2 and r3 to arrive while it does
  setup.max_waiting = 1;
  test_server s(setup);
  auto c1 = s.client();
  auto c2 = s.client();
  // r1 runs, r2 waits, r3 finds the queue full.
  std::thread t1([&] {
    c1->Post("/v1/completions", completion_body("Once upon a time", 2000, {{"ignore_eos", true}, {"stream", true}}),
             "application/json");
  });
  std::thread t2;
  joiner j1{t1}, j2{t2};
  struct stopper {
    test_server& s;
    ~stopper() { s.loop().stop(); }  // ends r1 and r2 (abort) before the joins
  } stop_first{s};
  for (int i = 0; i < 2000 && s.snapshot().n_running == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(s.snapshot().n_running, 1);
  t2 = std::thread([&] { post_json(*c2, "/v1/completions", completion_body("Once", 2)); });
  for (int i = 0; i < 2000 && s.snapshot().n_waiting == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(s.snapshot().n_waiting, 1);
  auto c3 = s.client();
  auto res = c3->Post("/v1/completions", completion_body("Once", 2), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 429);
  EXPECT_EQ(res->get_header_value("Retry-After"), "1");
  json err = json::parse(res->body);
  EXPECT_EQ(err["error"]["type"], "rate_limit_error");
}

TEST(server, api_keys_and_tenants) {
  server_setup setup = default_setup();
  ASSERT_TRUE(setup.keys.add("sk-global", "").ok());
  ASSERT_TRUE(setup.keys.add("sk-alice", "alice").ok());
  ASSERT_TRUE(setup.keys.add("sk-bob", "bob").ok());
  setup.engine.tenant_quota_blocks["bob"] = 64;
  test_server s(setup);
  auto c = s.client();
  const std::string body = completion_body(k_story, 2);

  http_reply none = post_json(*c, "/v1/completions", body);
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.json_body["error"]["code"], "invalid_api_key");
  http_reply wrong = post_json(*c, "/v1/completions", body, {{"Authorization", "Bearer sk-alicf"}});
  EXPECT_EQ(wrong.status, 401);
  EXPECT_EQ(c->Get("/v1/models")->status, 401);
  EXPECT_EQ(c->Get("/health")->status, 200);   // open, as in vLLM
  EXPECT_EQ(c->Get("/metrics")->status, 200);

  auto cached = [&](const char* key) {
    http_reply r = post_json(*c, "/v1/completions", body, {{"Authorization", std::string("Bearer ") + key}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json_body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  };
  EXPECT_EQ(cached("sk-alice"), 0);
  EXPECT_GT(cached("sk-alice"), 0);  // alice's own cache
  EXPECT_EQ(cached("sk-bob"), 0);    // same prompt, another tenant: no shared hit
  EXPECT_EQ(cached("sk-global"), 0);
  EXPECT_GT(cached("sk-global"), 0);
  // A client-sent salt isolates further within a tenant.
  http_reply salted = post_json(*c, "/v1/completions", completion_body(k_story, 2, {{"cache_salt", "mine"}}),
                                {{"Authorization", "Bearer sk-alice"}});
  EXPECT_EQ(salted.json_body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

  auto m = s.metrics();
  EXPECT_GT(metric(m, "pagoda:tenant_kv_blocks{tenant=\"alice\",state=\"cached\"}"), 0);
  EXPECT_GT(metric(m, "pagoda:tenant_kv_blocks{tenant=\"bob\",state=\"cached\"}"), 0);
  EXPECT_EQ(metric(m, "pagoda:tenant_kv_quota_blocks{tenant=\"bob\"}"), 64);
  EXPECT_EQ(metric(m, "pagoda:http_requests_total{endpoint=\"/v1/completions\",code=\"401\"}"), 2);
}

TEST(server, models_health_metrics) {
  server_setup setup = default_setup();
  setup.api.served_model_name = "tiny-stories";
  test_server s(setup);
  auto c = s.client();
  auto res = c->Get("/v1/models");
  ASSERT_TRUE(res);
  json j = json::parse(res->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "tiny-stories");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["max_model_len"], 512);
  EXPECT_EQ(c->Get("/v1/models/tiny-stories")->status, 200);
  EXPECT_EQ(c->Get("/v1/models/other")->status, 404);
  // The served name and the file's name are both accepted; others are not.
  EXPECT_EQ(post_json(*c, "/v1/completions", completion_body("Once", 1, {{"model", "tiny-stories"}})).status, 200);
  EXPECT_EQ(post_json(*c, "/v1/completions", completion_body("Once", 1, {{"model", "stories260K"}})).status, 200);
  http_reply unknown = post_json(*c, "/v1/completions", completion_body("Once", 1, {{"model", "gpt-4o"}}));
  EXPECT_EQ(unknown.status, 400);
  EXPECT_EQ(unknown.json_body["error"]["param"], "model");

  res = c->Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  res = c->Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->get_header_value("Content-Type").find("text/plain"), std::string::npos);
  for (const char* name :
       {"pagoda:kv_cache_usage_perc", "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total",
        "pagoda:num_preemptions_total", "pagoda:num_requests_running", "pagoda:num_requests_waiting",
        "pagoda:prompt_tokens_total", "pagoda:generation_tokens_total", "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket", "pagoda:e2e_request_latency_seconds_bucket",
        "pagoda:kv_cache_fragmentation_ratio", "pagoda:kv_cache_blocks{", "pagoda:tenant_kv_blocks{"})
    EXPECT_NE(res->body.find(name), std::string::npos) << name;
  auto m = parse_metrics(res->body);
  EXPECT_EQ(metric(m, "pagoda:kv_cache_blocks{state=\"used\"}") + metric(m, "pagoda:kv_cache_blocks{state=\"cached\"}") +
                metric(m, "pagoda:kv_cache_blocks{state=\"free\"}"),
            1024);
  EXPECT_EQ(metric(m, "pagoda:request_success_total{finished_reason=\"length\"}") +
                metric(m, "pagoda:request_success_total{finished_reason=\"stop\"}"),
            2);
}

// KV policies over HTTP: a request names its own (a bad one is a 400 naming
// the field), chat messages carry theirs, and /metrics counts compactions.
TEST(server, kv_policies_per_request) {
  test_server s(default_setup());
  auto c = s.client();
  http_reply bad = post_json(*c, "/v1/completions", completion_body("Once", 4, {{"kv_policy", "lru"}}));
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.json_body["error"]["param"], "kv_policy");
  http_reply r = post_json(*c, "/v1/completions",
                           completion_body(k_story, 120, {{"ignore_eos", true}, {"kv_policy", "h2o:budget=32"}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body["usage"]["completion_tokens"], 120);
  json chat = {{"messages", json::array({{{"role", "system"}, {"content", "You tell stories."}},
                                         {{"role", "user"}, {"content", k_story}, {"kv", {{"policy", "snapkv:budget=16"}}}}})},
               {"max_tokens", 60},
               {"temperature", 0},
               {"ignore_eos", true}};
  http_reply cr = post_json(*c, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(cr.status, 200) << cr.body;
  EXPECT_EQ(cr.json_body["usage"]["completion_tokens"], 60);
  http_reply rr = post_json(*c, "/v1/completions",
                            completion_body(k_story, 40, {{"ignore_eos", true}, {"kv_policy", "retrieval:k=8,recent=16"}}));
  ASSERT_EQ(rr.status, 200) << rr.body;
  chat["messages"][1]["kv"]["type"] = "int4";  // this server keeps one KV type
  http_reply typed = post_json(*c, "/v1/chat/completions", chat.dump());
  EXPECT_EQ(typed.status, 400);
  EXPECT_NE(typed.json_body["error"]["message"].get<std::string>().find("--kv-segment-dtype int4"), std::string::npos)
      << typed.body;
  auto m = parse_metrics(c->Get("/metrics")->body);
  EXPECT_GT(metric(m, "pagoda:kv_policy_compactions_total"), 0);
  EXPECT_GT(metric(m, "pagoda:kv_policy_evicted_slots_total"), 0);
  ASSERT_TRUE(wait_idle(s));
  m = parse_metrics(c->Get("/metrics")->body);
  EXPECT_EQ(metric(m, "pagoda:kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(metric(m, "pagoda:kv_selector_memory_bytes"), 0);  // the retrieval request's indexes went with it
}

// A server with an int4 KV class: a chat message whose content is a
// document in int4 and a question in the default type; the class's blocks
// show in /metrics, used while it runs and cached after.
TEST(server, a_part_of_the_prompt_in_its_own_kv_type) {
  server_setup setup = default_setup();
  const kv_layout& kv = setup.engine.kv;
  setup.engine.kv_classes.push_back(kv_segment_class{
      "int4", kv_layout::uniform(kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.block_size, kv_type::int4, kv_type::int4),
      64});
  test_server s(setup);
  auto c = s.client();
  json chat = {{"messages", json::array({{{"role", "user"},
                                          {"content", json::array({{{"type", "text"}, {"text", k_story}, {"kv", {{"type", "int4"}}}},
                                                                   {{"type", "text"}, {"text", "What happened next?"}}})}}})},
               {"max_tokens", 16},
               {"temperature", 0},
               {"ignore_eos", true}};
  http_reply r = post_json(*c, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body["usage"]["completion_tokens"], 16);
  ASSERT_TRUE(wait_idle(s));
  auto m = s.metrics();
  EXPECT_GT(metric(m, "pagoda:kv_class_blocks{type=\"int4\",state=\"cached\"}"), 0);
  EXPECT_EQ(metric(m, "pagoda:kv_class_blocks{type=\"int4\",state=\"used\"}"), 0);
  // Again: the document's int4 blocks come from the prefix cache.
  http_reply again = post_json(*c, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_GT(again.json_body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 16);
  EXPECT_EQ(again.json_body["choices"][0]["message"]["content"], r.json_body["choices"][0]["message"]["content"]);
  chat["messages"][0]["content"][0]["kv"]["type"] = "int2";
  http_reply unknown = post_json(*c, "/v1/chat/completions", chat.dump());
  EXPECT_EQ(unknown.status, 400) << unknown.body;
}

}  // namespace
}  // namespace pagoda::test
