// Malformed and hostile requests, sent as raw bytes: each gets its answer
// (an OpenAI error object naming the field where there is one), and afterwards
// the server still serves and holds no block.
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::test {
namespace {

struct raw_reply {
  int status = 0;  // 0: the server closed without an answer
  std::string body;
  json json_body;
};

raw_reply parse_reply(const std::string& raw) {
  raw_reply r;
  if (raw.rfind("HTTP/1.1 ", 0) != 0) return r;
  r.status = std::atoi(raw.c_str() + 9);
  std::size_t b = raw.find("\r\n\r\n");
  if (b != std::string::npos) r.body = raw.substr(b + 4);
  r.json_body = json::parse(r.body, nullptr, false);
  return r;
}

std::string http_request(const std::string& method, const std::string& path, const std::string& body,
                         const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers +
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

raw_reply post(int port, const std::string& body, const std::string& path = "/v1/completions") {
  return parse_reply(raw_exchange(port, http_request("POST", path, body), 10000));
}

struct bad_case {
  std::string name;
  std::string body;
  int status;
  std::string param;  // expected error.param; "" = not checked
  std::string path = "/v1/completions";
};

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(bad_input, table_of_hostile_requests_then_still_serving) {
  server_setup setup = default_setup();
  setup.http.limits.max_body_bytes = 1 << 20;
  setup.engine.max_model_len = 512;
  test_server s(setup);
  const std::string chat = "/v1/chat/completions";

  const std::vector<bad_case> cases = {
      // Not JSON, or not an object.
      {"truncated JSON", R"({"prompt": "Once upon)", 400, ""},
      {"truncated after key", R"({"prompt")", 400, ""},
      {"empty body", "", 400, ""},
      {"null body", "null", 400, ""},
      {"array body", "[1, 2, 3]", 400, ""},
      {"string body", R"("Once upon a time")", 400, ""},
      {"trailing garbage", R"({"prompt": "a"} xyz)", 400, ""},
      {"NaN literal", R"({"prompt": "a", "temperature": NaN})", 400, ""},
      // Wrong types.
      {"prompt object", R"({"prompt": {"text": "a"}})", 400, "prompt"},
      {"prompt bool", R"({"prompt": true})", 400, "prompt"},
      {"max_tokens string", R"({"prompt": "a", "max_tokens": "ten"})", 400, "max_tokens"},
      {"n array", R"({"prompt": "a", "n": []})", 400, "n"},
      {"stream string", R"({"prompt": "a", "stream": "true"})", 400, "stream"},
      {"stop number", R"({"prompt": "a", "stop": 7})", 400, "stop"},
      {"messages string", R"({"messages": "hello"})", 400, "messages", chat},
      {"message content number", R"({"messages": [{"role": "user", "content": 42}]})", 400, "messages[0].content", chat},
      {"message role missing", R"({"messages": [{"content": "hi"}]})", 400, "messages[0].role", chat},
      {"image part", R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
       400, "messages[0].content[0].type", chat},
      // Negative and huge values.
      {"max_tokens negative", R"({"prompt": "a", "max_tokens": -1})", 400, "max_tokens"},
      {"max_tokens huge", R"({"prompt": "a", "max_tokens": 1e308})", 400, "max_tokens"},
      {"max_tokens beyond u64", R"({"prompt": "a", "max_tokens": 99999999999999999999999999})", 400, "max_tokens"},
      {"max_tokens past context", R"({"prompt": "a", "max_tokens": 511})", 400, "max_tokens"},
      {"n negative", R"({"prompt": "a", "n": -3})", 400, "n"},
      {"n huge", R"({"prompt": "a", "n": 1000000000})", 400, "n"},
      {"temperature negative", R"({"prompt": "a", "temperature": -0.5})", 400, "temperature"},
      {"top_p huge", R"({"prompt": "a", "top_p": 1e300})", 400, "top_p"},
      {"top_k negative", R"({"prompt": "a", "top_k": -7})", 400, "top_k"},
      {"logprobs huge", R"({"prompt": "a", "logprobs": 1000000})", 400, "logprobs"},
      {"priority huge", R"({"prompt": "a", "priority": 1e20})", 400, "priority"},
      {"token id huge", R"({"prompt": [1, 1099511627776]})", 400, "prompt[1]"},
      {"token id negative", R"({"prompt": [-1]})", 400, "prompt[0]"},
      {"many stops", R"({"prompt": "a", "stop": [)" + [] {
         std::string s;
         for (int i = 0; i < 1000; ++i) s += std::string(i ? "," : "") + "\"x\"";
         return s;
       }() + "]}",
       400, "stop"},
      {"prompt too long", R"({"prompt": ")" + std::string(300000, 'a') + "\"}", 400, "prompt"},
      {"chat too long", R"({"messages": [{"role": "user", "content": ")" + std::string(20000, 'b') + "\"}]}", 400,
       "messages", chat},
      {"unknown model", R"({"prompt": "a", "model": "gpt-4o"})", 400, "model"},
      // Invalid UTF-8 and bad escapes inside strings.
      {"invalid UTF-8", "{\"prompt\": \"Once \xff\xfe upon\"}", 400, ""},
      {"overlong UTF-8", "{\"prompt\": \"\xc0\xaf\"}", 400, ""},
      {"invalid UTF-8 in key", "{\"pro\xffmpt\": \"a\"}", 400, ""},
      {"lone surrogate escape", R"({"prompt": "\ud800"})", 400, ""},
      {"control char in string", "{\"prompt\": \"a\x01b\"}", 400, ""},
      // Accepted: unknown fields, neutral values, odd but valid input.
      {"unknown fields", R"({"prompt": "Once", "max_tokens": 2, "foo": {"bar": [1, 2]}, "frequency_penalty": 0})", 200,
       ""},
      {"deep nesting in unknown field", R"({"prompt": "Once", "max_tokens": 1, "x": )" + nested(100000) + "}", 400, ""},
      {"nesting at the depth limit", R"({"prompt": "Once", "max_tokens": 1, "x": )" + nested(63) + "}", 200, ""},
      {"nul in prompt", R"({"prompt": "a\u0000b", "max_tokens": 1})", 200, ""},
      {"empty prompt", R"({"prompt": "", "max_tokens": 1})", 200, ""},
      {"negative seed", R"({"prompt": "a", "max_tokens": 1, "seed": -1, "temperature": 1})", 200, ""},
      {"nulls mean defaults", R"({"prompt": "a", "max_tokens": null, "temperature": null, "stop": null})", 200, ""},
      {"emoji prompt", R"({"prompt": "\ud83d\ude00 Once", "max_tokens": 1})", 200, ""},
  };
  for (const bad_case& c : cases) {
    raw_reply r = post(s.port(), c.body, c.path);
    EXPECT_EQ(r.status, c.status) << c.name << ": " << r.body.substr(0, 300);
    if (c.status == 200) continue;
    ASSERT_FALSE(r.json_body.is_discarded()) << c.name << ": error body is not JSON: " << r.body.substr(0, 200);
    const json& e = r.json_body["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << c.name;
    EXPECT_EQ(e["type"], "invalid_request_error") << c.name;
    if (!c.param.empty()) {
      EXPECT_EQ(e["param"], c.param) << c.name << ": " << e.dump();
    }
  }

  // A 10 MB body: 413 with an error object (or, if the server hung up while we
  // were still sending, no answer at all; never a crash).
  {
    const std::string big = R"({"prompt": ")" + std::string(10 << 20, 'a') + "\"}";
    raw_reply r = parse_reply(raw_exchange(s.port(), http_request("POST", "/v1/completions", big), 10000));
    EXPECT_TRUE(r.status == 413 || r.status == 0) << r.status;
    std::fprintf(stderr, "10 MB body: HTTP %d\n", r.status);
    if (r.status == 413) {
      EXPECT_EQ(r.json_body["error"]["type"], "invalid_request_error") << r.body;
    }
  }
  // A 10 MB body announced, then the client hangs up: 413 from the header
  // alone, nothing kept, nothing runs.
  {
    raw_reply r = parse_reply(raw_exchange(
        s.port(), "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10485760\r\n\r\n{\"prompt\":", 2000, true));
    EXPECT_NE(r.status, 200) << r.body;
  }
  // The body stops halfway and the client hangs up: no answer, nothing queued.
  {
    std::string req = http_request("POST", "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 100})");
    raw_exchange(s.port(), req.substr(0, req.size() - 20), 500, true);
  }
  // Garbage instead of HTTP, an oversized header, a wrong method.
  {
    std::string garbage = raw_exchange(s.port(), "GARBAGE\r\n\r\n", 2000);
    EXPECT_TRUE(garbage.empty() || parse_reply(garbage).status == 400) << garbage;
    std::string huge_header = "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(100000, 'h') + "\r\n\r\n";
    raw_reply r = parse_reply(raw_exchange(s.port(), huge_header, 2000));
    EXPECT_TRUE(r.status == 0 || r.status >= 400) << r.status;
    r = parse_reply(raw_exchange(s.port(), http_request("GET", "/v1/completions", ""), 2000));
    EXPECT_GE(r.status, 400);
    EXPECT_FALSE(r.json_body.is_discarded()) << r.body;
  }
  // Chunked upload of a valid request.
  {
    const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
    char len[16];
    std::snprintf(len, sizeof(len), "%zx", body.size());
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n" +
                      std::string(len) + "\r\n" + body + "\r\n0\r\n\r\n";
    EXPECT_EQ(parse_reply(raw_exchange(s.port(), req, 5000)).status, 200);
  }
  // Disconnects mid-stream, after the first chunk arrived.
  for (int i = 0; i < 3; ++i) {
    int fd = raw_connect(s.port());
    ASSERT_GE(fd, 0);
    std::string req = http_request(
        "POST", "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": true, "stream": true})");
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    std::string got;
    while (got.find("data: ") == std::string::npos && raw_read_some(fd, got, 2000)) {
    }
    EXPECT_NE(got.find("data: "), std::string::npos);
    close(fd);
  }

  // Still serving, nothing leaked.
  EXPECT_TRUE(wait_idle(s, 5000));
  raw_reply ok = post(s.port(), R"({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})");
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.json_body["usage"]["completion_tokens"], 4);
  EXPECT_TRUE(wait_idle(s, 5000));
  auto m = s.metrics();
  EXPECT_EQ(metric(m, "pagoda:kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(metric(m, "pagoda:num_requests_running"), 0);
  EXPECT_EQ(metric(m, "pagoda:num_requests_waiting"), 0);
  EXPECT_EQ(metric(m, "pagoda:request_success_total{finished_reason=\"abort\"}"), 3);
}

}  // namespace
}  // namespace pagoda::test
