// API keys, bearer parsing and the tenants file.
#include "server/auth.h"

#include <gtest/gtest.h>

namespace pagoda::server {
namespace {

TEST(auth, constant_time_equal_is_equality) {
  EXPECT_TRUE(constant_time_equal("sk-abc", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("sk-abd", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("sk-ab", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("sk-abcd", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("sk-abcsk-abc", "sk-abc"));  // a repeat of the key is not the key
  EXPECT_FALSE(constant_time_equal("", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("x", ""));
  EXPECT_TRUE(constant_time_equal("", ""));
}

TEST(auth, bearer_token) {
  EXPECT_EQ(bearer_token("Bearer sk-1"), "sk-1");
  EXPECT_EQ(bearer_token("bearer   sk-1 "), "sk-1");
  EXPECT_EQ(bearer_token("Basic dXNlcjpwYXNz"), std::nullopt);
  EXPECT_EQ(bearer_token("Bearer "), std::nullopt);
  EXPECT_EQ(bearer_token(""), std::nullopt);
}

TEST(auth, keys_are_compared_exactly_as_sent) {
  key_store keys;
  ASSERT_TRUE(keys.add("sk-alice", "alice").ok());
  for (const char* presented : {"sk-al%69ce", "sk-alice%00junk", "sk-alicex", "sk-alic", "SK-ALICE", "sk-alice\n"})
    EXPECT_FALSE(keys.authenticate(presented).has_value()) << presented;
  EXPECT_EQ(keys.authenticate("sk-alice"), "alice");
  EXPECT_EQ(bearer_token("Bearer sk-al%69ce"), "sk-al%69ce");  // nothing decoded
}

TEST(auth, api_key_file) {
  auto keys = parse_api_keys("# ops keys\nsk-one\r\n\n  sk-two  \n#sk-commented\n", "keys.txt");
  ASSERT_TRUE(keys.ok()) << keys.error().message();
  EXPECT_EQ(*keys, (std::vector<std::string>{"sk-one", "sk-two"}));
  auto empty = parse_api_keys("# nothing here\n\n", "keys.txt");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().message().find("keys.txt: holds no API key"), std::string::npos) << empty.error().message();
  auto spaced = parse_api_keys("sk one\n", "keys.txt");
  ASSERT_FALSE(spaced.ok());
  EXPECT_NE(spaced.error().message().find("keys.txt:1"), std::string::npos) << spaced.error().message();
  EXPECT_FALSE(load_api_key_file("/nonexistent/keys.txt").ok());
}

TEST(auth, key_store_maps_keys_to_tenants) {
  key_store keys;
  EXPECT_FALSE(keys.enabled());
  ASSERT_TRUE(keys.add("sk-global", "").ok());
  auto tenants = parse_tenants(R"({"tenants": [{"name": "alice", "api_keys": ["sk-a"], "quota_blocks": 8},
                                               {"name": "bob", "api_keys": ["sk-b1", "sk-b2"]}]})",
                               "t.json");
  ASSERT_TRUE(tenants.ok()) << tenants.error().message();
  ASSERT_EQ(tenants->size(), 2u);
  EXPECT_EQ((*tenants)[0].quota_blocks, 8);
  EXPECT_EQ((*tenants)[1].quota_blocks, std::nullopt);
  ASSERT_TRUE(keys.add_tenants(*tenants).ok());
  EXPECT_TRUE(keys.enabled());
  EXPECT_EQ(keys.authenticate("sk-global"), "");
  EXPECT_EQ(keys.authenticate("sk-a"), "alice");
  EXPECT_EQ(keys.authenticate("sk-b2"), "bob");
  EXPECT_EQ(keys.authenticate("sk-b"), std::nullopt);
  EXPECT_EQ(keys.authenticate(""), std::nullopt);
  EXPECT_FALSE(keys.add("sk-a", "carol").ok());  // one key, one tenant
  EXPECT_FALSE(keys.add("", "").ok());
}

TEST(auth, tenants_file_errors_name_the_field) {
  struct bad {
    const char* text;
    const char* needle;
  };
  const bad cases[] = {
      {"not json", "not valid JSON"},
      {"[]", "'tenants' array"},
      {R"({"tenants": [], "extra": 1})", "unknown field 'extra'"},
      {R"({"tenants": [{"api_keys": ["k"]}]})", "missing field 'name'"},
      {R"({"tenants": [{"name": "a b", "api_keys": ["k"]}]})", "tenants[0].name"},
      {R"({"tenants": [{"name": "a", "api_keys": []}]})", "at least one key"},
      {R"({"tenants": [{"name": "a", "api_keys": [""]}]})", "tenants[0].api_keys[0]"},
      {R"({"tenants": [{"name": "a", "api_keys": ["k"], "quota_blocks": 0}]})", "quota_blocks"},
      {R"({"tenants": [{"name": "a", "api_keys": ["k"], "quota": 5}]})", "unknown field 'quota'"},
      {R"({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]})", "listed twice"},
  };
  for (const bad& b : cases) {
    auto r = parse_tenants(b.text, "t.json");
    ASSERT_FALSE(r.ok()) << b.text;
    EXPECT_NE(r.error().message().find(b.needle), std::string::npos) << r.error().message();
    EXPECT_NE(r.error().message().find("t.json"), std::string::npos) << r.error().message();
  }
  EXPECT_EQ(load_tenants_file("/nonexistent/tenants.json").error().code(), errc::not_found);
}

}  // namespace
}  // namespace pagoda::server
