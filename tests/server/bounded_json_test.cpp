// The bounded JSON parse: each limit refuses one past it and accepts it exactly.
#include "server/bounded_json.h"

#include <gtest/gtest.h>

namespace pagoda::server {
namespace {

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

std::string zeros(std::size_t n) {
  std::string s = "[";
  for (std::size_t i = 0; i < n; ++i) s += i ? ",0" : "0";
  return s + "]";
}

TEST(bounded_json, depth_limit) {
  json_limits l;
  l.max_depth = 8;
  EXPECT_TRUE(parse_bounded_json(nested(8), l).ok());
  api_result<nlohmann::json> r = parse_bounded_json(nested(9), l);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error.http_status, 400);
  EXPECT_EQ(r.error.code, "json_too_large");
  EXPECT_NE(r.error.message.find("deeper than 8"), std::string::npos) << r.error.message;
}

TEST(bounded_json, value_limit_counts_every_value) {
  json_limits l;
  l.max_values = 11;  // the array itself and ten zeros
  api_result<nlohmann::json> ok = parse_bounded_json(zeros(10), l);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok.value->size(), 10u);
  EXPECT_FALSE(parse_bounded_json(zeros(11), l).ok());
  // Object values count; keys do not.
  EXPECT_TRUE(parse_bounded_json(R"({"a": 1, "b": 2})", l).ok());
}

TEST(bounded_json, string_and_key_limits) {
  json_limits l;
  l.max_string_bytes = 4;
  EXPECT_TRUE(parse_bounded_json(R"({"abcd": "wxyz"})", l).ok());
  EXPECT_FALSE(parse_bounded_json(R"({"abcde": "w"})", l).ok());
  EXPECT_FALSE(parse_bounded_json(R"({"a": "vwxyz"})", l).ok());
}

TEST(bounded_json, syntax_errors_are_invalid_json) {
  for (const char* bad : {"", "{", R"({"a": 1} x)", "[1,]", "NaN", "\"\xff\""}) {
    api_result<nlohmann::json> r = parse_bounded_json(bad, json_limits{});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error.code, "invalid_json") << bad;
    EXPECT_NE(r.error.message.find("not valid JSON"), std::string::npos) << r.error.message;
  }
  api_result<nlohmann::json> ok = parse_bounded_json(R"({"prompt": "a\u0000b", "n": [1, 2.5, true, null]})", json_limits{});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok.value)["prompt"].get<std::string>().size(), 3u);
}

}  // namespace
}  // namespace pagoda::server
