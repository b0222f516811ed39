// The router's decision as a pure function (router/route_choice.h), the keys
// it computes for a prompt against the KV manager's own, and the summary
// format the replicas answer (server/kv_summary.h).
#include <set>

#include <gtest/gtest.h>

#include "kv/kv_manager.h"
#include "router/request_keys.h"
#include "router/route_choice.h"
#include "server/kv_summary.h"

namespace pagoda::router {
namespace {

std::vector<block_key> keys_of(std::initializer_list<block_key> k) { return k; }

TEST(RouteChoice, LongestHeldPrefixWins) {
  replica_blocks a, b, c;
  a.replace(keys_of({1}), 0);
  b.replace(keys_of({1, 2, 3}), 0);
  c.replace(keys_of({2, 3}), 0);  // not a prefix: block 1 is missing
  const std::vector<block_key> req = {1, 2, 3, 4};
  std::vector<replica_view> v(3);
  v[0] = {true, false, &a, req, 1};
  v[1] = {true, false, &b, req, 2};
  v[2] = {true, false, &c, req, 0};
  for (std::uint64_t turn = 0; turn < 3; ++turn) {
    const auto d = choose_replica(v, {}, turn);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->replica, 1u);
    EXPECT_EQ(d->reason, route_reason::prefix);
    EXPECT_EQ(d->matched_blocks, 3);
  }
}

TEST(RouteChoice, LoadBeyondTheSlackBeatsAPrefix) {
  replica_blocks held, empty;
  held.replace(keys_of({7, 8}), 0);
  const std::vector<block_key> req = {7, 8};
  std::vector<replica_view> v(2);
  v[0] = {true, false, &held, req, 10};
  v[1] = {true, false, &empty, req, 2};
  const auto far = choose_replica(v, route_params{route_policy::prefix, 4}, 0);
  ASSERT_TRUE(far);
  EXPECT_EQ(far->replica, 1u);
  EXPECT_EQ(far->reason, route_reason::load);
  // Within the slack the prefix wins.
  const auto near = choose_replica(v, route_params{route_policy::prefix, 8}, 0);
  ASSERT_TRUE(near);
  EXPECT_EQ(near->replica, 0u);
  EXPECT_EQ(near->reason, route_reason::prefix);
}

TEST(RouteChoice, NoPrefixGoesToTheLeastLoadedAndTiesRotate) {
  replica_blocks empty;
  const std::vector<block_key> req = {5};
  std::vector<replica_view> v(3);
  v[0] = {true, false, &empty, req, 3};
  v[1] = {true, false, &empty, req, 1};
  v[2] = {true, false, nullptr, {}, 1};  // no summary: by load only
  std::set<std::size_t> seen;
  for (std::uint64_t turn = 0; turn < 6; ++turn) {
    const auto d = choose_replica(v, {}, turn);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->reason, route_reason::load);
    EXPECT_NE(d->replica, 0u);
    seen.insert(d->replica);
  }
  EXPECT_EQ(seen.size(), 2u);  // the two least loaded share the new prefixes
}

TEST(RouteChoice, DownTriedAndUnsummarisedReplicasAreSkipped) {
  replica_blocks held;
  held.replace(keys_of({1}), 0);
  const std::vector<block_key> req = {1};
  std::vector<replica_view> v(3);
  v[0] = {false, false, &held, req, 0};  // down
  v[1] = {true, true, &held, req, 0};    // tried already
  v[2] = {true, false, nullptr, req, 9};
  const auto d = choose_replica(v, {}, 0);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->replica, 2u);
  EXPECT_EQ(d->reason, route_reason::load);
  v[2].up = false;
  EXPECT_FALSE(choose_replica(v, {}, 0));
  EXPECT_FALSE(choose_replica(std::span<const replica_view>(), {}, 0));
}

TEST(RouteChoice, RoundRobinIgnoresPrefixesAndSkipsDown) {
  replica_blocks held;
  held.replace(keys_of({1}), 0);
  const std::vector<block_key> req = {1};
  std::vector<replica_view> v(3);
  v[0] = {true, false, &held, req, 0};
  v[1] = {false, false, nullptr, {}, 0};
  v[2] = {true, false, nullptr, {}, 5};
  const route_params rr{route_policy::round_robin, 4};
  std::vector<std::size_t> got;
  for (std::uint64_t turn = 0; turn < 4; ++turn) got.push_back(choose_replica(v, rr, turn)->replica);
  EXPECT_EQ(got, (std::vector<std::size_t>{0, 2, 2, 0}));
  EXPECT_EQ(choose_replica(v, rr, 0)->reason, route_reason::round_robin);
}

TEST(RouteChoice, PendingKeysCountUntilASummaryOutdatesThem) {
  replica_blocks b;
  const std::vector<block_key> req = {4, 5};
  b.add_pending(req, /*now=*/100);
  EXPECT_EQ(leading_matches(req, b), 2);
  b.replace(keys_of({4}), /*pending_before=*/50);  // routed after the cut: kept
  EXPECT_EQ(leading_matches(req, b), 2);
  b.replace(keys_of({4}), /*pending_before=*/200);  // older than the cut: only the summary counts
  EXPECT_EQ(leading_matches(req, b), 1);
  b.clear();
  EXPECT_EQ(leading_matches(req, b), 0);
}

// The router's keys are the KV manager's: a prompt the manager committed is
// found under exactly the keys prompt_keys computes (tenant and salt included).
TEST(RequestKeys, MatchTheKvManagersPrefixIndex) {
  constexpr int bs = 4;
  kv_manager kv(bs, 16);
  std::vector<token_id> prompt;
  for (int i = 0; i < 11; ++i) prompt.push_back(100 + i);
  const sequence_options opts{"alice", "salt1"};
  ASSERT_TRUE(kv.add_sequence(seq_id(1), prompt, opts).ok());
  ASSERT_TRUE(kv.allocate(seq_id(1), static_cast<std::int32_t>(prompt.size())).has_value());
  ASSERT_TRUE(kv.commit(seq_id(1), prompt).ok());
  std::set<block_key> held;
  kv.index().for_each_key([&](block_key k) { held.insert(k); });
  ASSERT_EQ(held.size(), 2u);  // two full blocks of 11 tokens

  prompt_info p{prompt, first_block_extras("alice", "salt1")};
  const std::vector<block_key> keys = prompt_keys(p, bs, 100);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(std::set<block_key>(keys.begin(), keys.end()), held);
  // Another tenant or salt: nothing matches.
  for (const auto& [t, s] : {std::pair{"bob", "salt1"}, std::pair{"alice", ""}}) {
    const std::vector<block_key> other = prompt_keys({prompt, first_block_extras(t, s)}, bs, 100);
    EXPECT_FALSE(held.contains(other[0])) << t << "/" << s;
  }
}

TEST(KvSummary, RoundTripsAndRefusesMalformed) {
  server::kv_summary s;
  s.generation = "abc-7";
  s.model_fingerprint = "0123456789abcdef";
  s.block_size_tokens = 16;
  s.n_running = 2;
  s.n_waiting = 1;
  s.keys = {0, 0xffffffffffffffffull, 0x70a60da6b10c4e75ull};
  const auto back = server::parse_kv_summary(server::kv_summary_json(s).dump());
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->keys, s.keys);
  EXPECT_EQ(back->generation, "abc-7");
  EXPECT_EQ(back->n_running + back->n_waiting, 3);
  s.unchanged = true;
  const auto same = server::parse_kv_summary(server::kv_summary_json(s).dump());
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(same->unchanged);
  EXPECT_TRUE(same->keys.empty());
  for (const char* bad : {"", "[]", R"({"object":"kv.summary"})",
                          R"({"object":"kv.summary","generation":"g","model_fingerprint":"f","block_size_tokens":16,"running":0,"waiting":0,"keys":"12"})",
                          R"({"object":"kv.summary","generation":"g","model_fingerprint":"f","block_size_tokens":16,"running":0,"waiting":0,"keys":"zzzzzzzzzzzzzzzz"})",
                          R"({"object":"kv.summary","generation":"g","model_fingerprint":"f","block_size_tokens":0,"running":0,"waiting":0,"keys":""})"})
    EXPECT_FALSE(server::parse_kv_summary(bad).ok()) << bad;
}

}  // namespace
}  // namespace pagoda::router
