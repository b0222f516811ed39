// The scheduler charges a policy's side memory (kv_manager.h, "Side blocks"):
// a request whose KV plus side memory could never fit is refused, one that
// does not fit now waits, and a tenant's quota counts it.
#include <gtest/gtest.h>

#include "sched/scheduler_harness.h"

namespace pagoda::test {
namespace {

constexpr std::int64_t k_block_bytes = 1000;

// A policy that keeps everything and holds 8 side blocks' worth of memory.
class heavy_policy final : public kv_policy {
 public:
  explicit heavy_policy(kv_policy_spec spec) : spec_(std::move(spec)) {}
  const kv_policy_spec& spec() const override { return spec_; }
  side_charge side_memory(int, int, int) const override { return side_charge{8 * k_block_bytes, 0}; }

 private:
  kv_policy_spec spec_;
};

scheduler_config side_config(std::int64_t n_blocks) {
  scheduler_config c = config(n_blocks);
  c.side_block_bytes = k_block_bytes;
  c.policy_shape = {2, 2, 8, c.block_size};
  c.policy_factory = [](const kv_policy_spec& s) -> result<std::unique_ptr<kv_policy>> {
    return std::unique_ptr<kv_policy>(std::make_unique<heavy_policy>(s));
  };
  return c;
}

request heavy(const std::string& id, int n_prompt, int max_tokens, const std::string& tenant = "") {
  request r = req(id, prompt_of(n_prompt, static_cast<int>(id.size())), max_tokens, tenant);
  r.kv_policy = "heavy";
  return r;
}

TEST(scheduler_side, a_request_whose_side_memory_cannot_fit_is_refused) {
  harness h(side_config(20));
  // 60 + 4 tokens: 16 KV blocks + 8 side blocks > 20.
  const status st = h.s.add_request(heavy("big", 60, 4));
  EXPECT_EQ(st.code(), errc::resource_exhausted);
  EXPECT_NE(st.message().find("side memory"), std::string::npos) << st.message();
  // The same request without the policy fits.
  EXPECT_TRUE(h.s.add_request(req("plain", prompt_of(60), 4)).ok());
}

TEST(scheduler_side, a_second_sequence_whose_side_memory_does_not_fit_waits) {
  harness h(side_config(20));
  h.add(heavy("a", 16, 4));  // 5 KV + 8 side = 13 blocks
  h.add(heavy("b", 16, 4));  // 13 more: not with a's
  int most_side = 0;
  for (int i = 0; i < 200 && h.s.has_work(); ++i) {
    h.step();
    const kv_metrics m = h.s.kv().metrics();
    EXPECT_LE(m.n_blocks_used, 20);
    EXPECT_LE(m.n_side_blocks, 8) << "both sequences' side memory at once would exceed the pool";
    most_side = std::max(most_side, m.n_side_blocks);
  }
  EXPECT_EQ(most_side, 8);
  EXPECT_EQ(h.results["a"].finish, "length");
  EXPECT_EQ(h.results["b"].finish, "length");
  EXPECT_EQ(h.s.kv().metrics().n_side_blocks, 0);
}

TEST(scheduler_side, the_tenants_quota_counts_side_memory) {
  scheduler_config c = side_config(100);
  c.tenant_quota_blocks["alice"] = 12;
  harness h(c);
  // 16 + 4 tokens: 5 KV + 8 side = 13 > 12.
  const status st = h.s.add_request(heavy("a", 16, 4, "alice"));
  EXPECT_EQ(st.code(), errc::resource_exhausted);
  EXPECT_NE(st.message().find("tenant 'alice'"), std::string::npos) << st.message();
  h.add(heavy("b", 8, 4, "alice"));  // 3 KV + 8 side = 11
  h.run();
  EXPECT_EQ(h.results["b"].finish, "length");
}

}  // namespace
}  // namespace pagoda::test
