// Placing prompt parts with a KV policy or type on the prompt's tokens: one
// tokenization and one pass over it however many parts there are, tokens
// matched back to the text on real vocabularies, and the cap on parts.
#include "server/prompt_segments.h"

#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "model/gguf.h"
#include "server/openai_request.h"
#include "server/server_util.h"

namespace pagoda::server {
namespace {

using nlohmann::json;

api_context context() { return test::stories_api_context(); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every token's bytes in the text are its piece: a tokenization of `text`
// spelled back by token_ends_in_text, checked token by token.
void expect_spelled_back(const tokenizer& vocab, const std::string& text, bool add_bos, const std::string& what) {
  const std::vector<token_id> ids = vocab.encode(text, add_bos, /*parse_special=*/true);
  const auto ends = token_ends_in_text(vocab, text, ids, add_bos);
  ASSERT_TRUE(ends.has_value()) << what << ": '" << text << "'";
  ASSERT_EQ(ends->size(), ids.size()) << what;
  EXPECT_EQ(ids.empty() ? 0 : ends->back(), text.size()) << what;
  for (std::size_t i = 1; i < ends->size(); ++i) EXPECT_LE((*ends)[i - 1], (*ends)[i]) << what;
  // Decoding the tokens of [0, ends[i]] gives the text up to there (up to
  // the SPM spaces a literal "▁" stands for).
  if (vocab.kind() == tokenizer_kind::bpe) {
    for (std::size_t i = 0; i < ids.size(); i += 7)
      EXPECT_EQ(vocab.decode(std::span(ids).first(i + 1), /*render_special=*/true)
                    .substr(add_bos && ids[0] == vocab.bos() ? vocab.token_text(vocab.bos()).size() : 0),
                text.substr(0, (*ends)[i]))
          << what << " token " << i;
  }
}

// The llama.cpp vocabulary cases (whitespace runs, unicode, code, digits) on
// SPM and byte-level BPE vocabularies, and stories260K's own.
TEST(prompt_segments, tokens_are_matched_back_to_their_text_on_real_vocabularies) {
  for (const char* name : {"ggml-vocab-phi-3.gguf", "ggml-vocab-deepseek-coder.gguf", "ggml-vocab-starcoder.gguf"}) {
    const std::string path = std::string(PAGODA_SOURCE_DIR) + "/tests/data/tokenizer/" + name;
    auto file = gguf::file::open(path);
    ASSERT_TRUE(file.ok()) << file.error().message();
    auto vocab = tokenizer::from_gguf(**file);
    ASSERT_TRUE(vocab.ok()) << vocab.error().message();
    const std::string inp = read_file(path + ".inp");
    const std::string sep = "\n__ggml_vocab_test__\n";
    int n = 0;
    for (std::size_t pos = 0, next; (next = inp.find(sep, pos)) != std::string::npos; pos = next + sep.size(), ++n) {
      const std::string text = inp.substr(pos, next - pos);
      expect_spelled_back(**vocab, text, false, fmt::format("{} case {}", name, n));
      expect_spelled_back(**vocab, text, true, fmt::format("{} case {} with BOS", name, n));
    }
    EXPECT_GT(n, 40);
  }
  const tokenizer& stories = test::stories().vocab();
  for (const std::string text : {"Once upon a time", " two  spaces", "a literal \xE2\x96\x81 and \xE2\x96\x81x", "<s>x</s> y",
                                 "\n\ttabs\n", "日本語 ü", ""})
    expect_spelled_back(stories, text, true, "stories260K");
}

// Tens of thousands of parts: the placement reads the prompt's tokens once
// (before, each part tokenized the prompt up to its start and its end, twice
// per part: quadratic, and minutes for this prompt).
TEST(prompt_segments, many_parts_are_placed_in_one_pass) {
  const tokenizer& vocab = test::stories().vocab();
  constexpr int k_parts = 20000;
  std::string text;
  std::vector<text_piece> pieces;
  for (int i = 0; i < k_parts; ++i) {
    text_piece p{fmt::format("Tom {} ran. ", i % 10), {"", i % 2 ? "int4" : ""}, fmt::format("prompt[{}]", i)};
    if (i % 3 == 0) p.kv.policy = "none";
    text += p.text;
    pieces.push_back(std::move(p));
  }
  const std::vector<token_id> ids = vocab.encode(text, true, true);
  std::size_t matched = 0;
  auto placed = place_segments(vocab, true, text, ids, pieces, &matched);
  ASSERT_TRUE(placed.ok()) << placed.error.message;
  EXPECT_EQ(matched, text.size()) << "each byte of the prompt matched once";
  std::size_t n_kv = 0;
  for (const text_piece& p : pieces) n_kv += p.kv.any();
  ASSERT_EQ(placed.value->size(), n_kv);
  std::int32_t last_end = 1;  // after BOS
  for (const prompt_segment& s : *placed.value) {
    EXPECT_LE(last_end, s.begin);
    EXPECT_LT(s.begin, s.end);
    last_end = s.end;
  }
  EXPECT_LE(last_end, static_cast<std::int32_t>(ids.size()));
  // A part's tokens spell its text (a part starts at "Tom", a word start).
  const prompt_segment& first = placed.value->front();
  EXPECT_EQ(vocab.decode(std::span(ids).subspan(first.begin, first.end - first.begin)), "Tom 0 ran.");
}

// Parts of a completion prompt, and chat parts with a KV choice: at most
// k_max_kv_parts, beyond it a 400 that names the limit.
TEST(prompt_segments, parts_beyond_the_cap_are_refused) {
  const api_context ctx = context();
  auto parts = [](int n) {
    json p = json::array();
    for (int i = 0; i < n; ++i) p.push_back({{"text", "a"}, {"kv", {{"policy", "none"}}}});
    return p;
  };
  auto ok = parse_request(api_kind::completion, {{"prompt", parts(k_max_kv_parts)}}, ctx, "");
  ASSERT_TRUE(ok.ok()) << ok.error.message;
  EXPECT_EQ(ok.value->requests[0].segments.size(), static_cast<std::size_t>(k_max_kv_parts));
  auto over = parse_request(api_kind::completion, {{"prompt", parts(k_max_kv_parts + 1)}}, ctx, "");
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error.http_status, 400);
  EXPECT_EQ(over.error.param, "prompt");
  EXPECT_NE(over.error.message.find(std::to_string(k_max_kv_parts)), std::string::npos) << over.error.message;

  json content = json::array();
  for (int i = 0; i <= k_max_kv_parts; ++i) content.push_back({{"type", "text"}, {"text", "x"}});
  const json chat = {{"messages", json::array({{{"role", "user"}, {"content", content}}})},
                     {"kv_policy_by_role", {{"user", "none"}}}};
  auto chat_over = parse_request(api_kind::chat, chat, ctx, "");
  ASSERT_FALSE(chat_over.ok());
  EXPECT_EQ(chat_over.error.param, "messages");
  EXPECT_NE(chat_over.error.message.find(std::to_string(k_max_kv_parts)), std::string::npos);
  // Without a KV choice the same parts are only text: no cap beyond the
  // body's and the context's (which this many parts exceed here).
  json plain = chat;
  plain.erase("kv_policy_by_role");
  auto plain_r = parse_request(api_kind::chat, plain, ctx, "");
  EXPECT_TRUE(plain_r.ok() || plain_r.error.message.find("KV policy") == std::string::npos) << plain_r.error.message;
}

// "kv": {"reuse": "chunk", "recompute": r} marks a part for chunk reuse: the
// segment carries the mark and the fraction; a bad value, a fraction without
// the mark or out of [0, 1], and a marked part with no text are 400s naming the field.
TEST(prompt_segments, chunk_reuse_marks_are_read_and_checked) {
  const api_context ctx = context();
  auto body = [](json kv, const std::string& text = "Once upon a time there was a dog.") {
    return json{{"prompt", json::array({{{"text", "Read this. "}}, {{"text", text}, {"kv", std::move(kv)}},
                                        {{"text", " What next?"}}})}};
  };
  auto ok = parse_request(api_kind::completion, body({{"reuse", "chunk"}, {"recompute", 0.3}}), ctx, "");
  ASSERT_TRUE(ok.ok()) << ok.error.message;
  ASSERT_EQ(ok.value->requests[0].segments.size(), 1u);
  const prompt_segment& s = ok.value->requests[0].segments[0];
  EXPECT_TRUE(s.reuse_chunk);
  EXPECT_FLOAT_EQ(s.recompute, 0.3f);
  EXPECT_LT(s.begin, s.end);
  auto deflt = parse_request(api_kind::completion, body({{"reuse", "chunk"}}), ctx, "");
  ASSERT_TRUE(deflt.ok()) << deflt.error.message;
  EXPECT_LT(deflt.value->requests[0].segments[0].recompute, 0.0f) << "no fraction: the engine's default";

  const std::vector<std::pair<json, std::string>> bad = {
      {{{"reuse", "prefix"}}, "prompt[1].kv.reuse"},
      {{{"reuse", true}}, "prompt[1].kv.reuse"},
      {{{"reuse", "chunk"}, {"recompute", 1.5}}, "prompt[1].kv.recompute"},
      {{{"reuse", "chunk"}, {"recompute", -0.1}}, "prompt[1].kv.recompute"},
      {{{"reuse", "chunk"}, {"recompute", "all"}}, "prompt[1].kv.recompute"},
      {{{"recompute", 0.5}}, "prompt[1].kv.recompute"},
  };
  for (const auto& [kv, param] : bad) {
    auto r = parse_request(api_kind::completion, body(kv), ctx, "");
    ASSERT_FALSE(r.ok()) << kv.dump();
    EXPECT_EQ(r.error.http_status, 400);
    EXPECT_EQ(r.error.param, param) << kv.dump() << ": " << r.error.message;
  }
  auto empty = parse_request(api_kind::completion, body({{"reuse", "chunk"}}, ""), ctx, "");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error.message.find("chunk reuse"), std::string::npos) << empty.error.message;
}

}  // namespace
}  // namespace pagoda::server
