// /v1/kv/warm through a real `pagoda serve` with KV classes: what a warm with
// a typed part reports as stored is what a restarted server loads from the
// disk tier for that same prompt.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/serve_process.h"
#include "cli/store_client.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

// The prompt of story_prompt(4) in three parts; the middle one typed (or not).
json parts(bool typed) {
  const std::string whole = story_prompt(4);
  const std::size_t a = whole.find("One day"), b = whole.find("The ball flew");
  json doc = {{"text", whole.substr(a, b - a)}};
  if (typed) doc["kv"] = {{"type", "int4"}};
  return json::array({{{"text", whole.substr(0, a)}}, doc, {{"text", whole.substr(b)}}});
}

// A warm computed its blocks' keys without the request's KV classes: a part
// typed int4 got the keys of class-0 blocks, so once the untyped prompt was
// stored it reported every block stored, though a restart loads only the
// blocks before the typed part (the typed ones are other blocks).
TEST(serve_kv_warm, a_typed_part_is_counted_under_its_own_keys) {
  temp_dir dir("kvwarmtyped");
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", (dir.path / "kv").string(), "--kv-segment-dtype", "int4"});
  int stored_typed = -1;
  {
    serve_process s(args);
    const json plain = call(s.port(), "POST", "/v1/kv/warm", {{"prompt", parts(false)}});
    ASSERT_EQ(plain["http_status"], 200) << plain;
    ASSERT_EQ(plain["stored_blocks"], plain["blocks"]) << plain;
    const json typed = call(s.port(), "POST", "/v1/kv/warm", {{"prompt", parts(true)}});
    ASSERT_EQ(typed["http_status"], 200) << typed;
    EXPECT_EQ(typed["blocks"], plain["blocks"]);
    stored_typed = typed["stored_blocks"];
    s.stop(SIGTERM);
  }
  serve_process s(args);
  const json r = call(s.port(), "POST", "/v1/completions", {{"prompt", parts(true)}, {"max_tokens", 1}});
  ASSERT_EQ(r["http_status"], 200) << r;
  // A prompt reuses every full block but one ending at its last token.
  const int reusable = (r["usage"]["prompt_tokens"].get<int>() - 1) / k_store_test_block;
  EXPECT_EQ(cached_from(r, "disk"), std::min(stored_typed, reusable) * k_store_test_block)
      << "the warm reported " << stored_typed << " blocks stored: " << r;
}

}  // namespace
}  // namespace pagoda::test
