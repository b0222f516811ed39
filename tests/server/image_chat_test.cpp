// Images in chat completions (`serve --mmproj`, docs/serving.md "Images"):
// text-tiny-F32 and its idefics3 mmproj (tests/data/oracle/vision), images
// written in memory as PNG and JPEG (tests/common/image_files.h) and sent as
// data: URLs.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/image_files.h"
#include "sched/engine_setup.h"
#include "sched/image_engine_util.h"
#include "server/server_util.h"
#include "vision/image_prompt.h"

namespace pagoda::test {
namespace {

const llama_model& text_model() { return vision_text_model(); }

// nx x ny RGB pixels that differ with `seed` everywhere.
std::vector<std::uint8_t> pixels(int nx, int ny, int seed) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(nx) * static_cast<std::size_t>(ny) * 3);
  for (std::size_t i = 0; i < p.size(); ++i)
    p[i] = static_cast<std::uint8_t>((i * 7 + static_cast<std::size_t>(seed) * 131 + (i / 3) * (i % 5)) & 0xff);
  return p;
}

std::vector<std::uint8_t> png(int nx, int ny, int seed) {
  const std::vector<std::uint8_t> px = pixels(nx, ny, seed);
  return write_png(px.data(), nx, ny, PNG_FORMAT_RGB);
}

std::vector<std::uint8_t> jpeg(int nx, int ny, int seed) {
  const std::vector<std::uint8_t> px = pixels(nx, ny, seed);
  return write_jpeg(px.data(), nx, ny, 90, TJSAMP_444);
}

std::string base64(const std::vector<std::uint8_t>& b) {
  static constexpr char k[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < b.size(); i += 3) {
    const std::uint32_t n = (std::uint32_t{b[i]} << 16) | (i + 1 < b.size() ? std::uint32_t{b[i + 1]} << 8 : 0) |
                            (i + 2 < b.size() ? std::uint32_t{b[i + 2]} : 0);
    out += k[(n >> 18) & 63];
    out += k[(n >> 12) & 63];
    out += i + 1 < b.size() ? k[(n >> 6) & 63] : '=';
    out += i + 2 < b.size() ? k[n & 63] : '=';
  }
  return out;
}

std::string data_url(const std::vector<std::uint8_t>& bytes, const std::string& mime = "image/png") {
  return "data:" + mime + ";base64," + base64(bytes);
}

json image_part(const std::string& url, json kv = nullptr) {
  json p = {{"type", "image_url"}, {"image_url", {{"url", url}}}};
  if (!kv.is_null()) p["kv"] = std::move(kv);
  return p;
}

// One user message: the image, then the question; greedy, ids in the logprobs.
json chat_body(const json& parts, int max_tokens = 6) {
  return {{"messages", {{{"role", "user"}, {"content", parts}}}},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"logprobs", true},
          {"return_tokens_as_token_ids", true}};
}

json one_image(const std::string& url, json kv = nullptr) {
  return chat_body(json::array({image_part(url, std::move(kv)), {{"type", "text"}, {"text", "What is this?"}}}));
}

// The completion's token ids (logprobs with return_tokens_as_token_ids).
std::vector<token_id> completion_ids(const json& body) {
  std::vector<token_id> out;
  for (const json& lp : body["choices"][0]["logprobs"]["content"])
    out.push_back(std::stoi(lp["token"].get<std::string>().substr(std::string("token_id:").size())));
  return out;
}

engine_config base_config() {
  engine_config ec = test::vision_engine_config("text-tiny-F32.gguf", 512, 8, 8192);
  ec.block_size = 4;  // an image chunk (16 tokens) fills whole blocks wherever it starts
  return ec;
}

// A server over text-tiny with the mmproj, chatml chat.
struct vision_server {
  std::unique_ptr<server::image_input> images;
  std::unique_ptr<test_server> server;
  std::unique_ptr<httplib::Client> client;

  explicit vision_server(const engine_config& ec = base_config(), server::image_options io = {}, bool with_images = true) {
    io.n_threads = 1;
    if (with_images) {
      auto opened = server::image_input::open(vision_dir() + "/mmproj-idefics3-F32.gguf", text_model(), io);
      EXPECT_TRUE(opened.ok()) << opened.error().message();
      if (opened.ok()) images = std::move(*opened);
    }
    server_setup s = default_setup();
    auto cfg = make_engine_core_config(text_model(), ec);
    EXPECT_TRUE(cfg.ok()) << cfg.error().message();
    if (cfg.ok()) s.engine = *cfg;
    s.api.model_path = ec.model_path;
    s.api.chat_template = "chatml";
    s.images = images.get();
    server = std::make_unique<test_server>(std::move(s), text_model());
    client = server->client();
  }

  http_reply chat(const json& body) { return post_json(*client, "/v1/chat/completions", body.dump()); }
};

const json& details(const http_reply& r) { return r.json_body["usage"]["prompt_tokens_details"]; }

// The image's prompt part as `pagoda run --image` builds it.
vision::image_part part_of(const std::vector<std::uint8_t>& bytes) {
  auto m = vision::mmproj::open(vision_dir() + "/mmproj-idefics3-F32.gguf");
  EXPECT_TRUE(m.ok());
  thread_pool pool(1);
  auto p = vision::make_image_part(bytes, **m, text_model().vocab(), text_model().hparams().n_embd, pool);
  EXPECT_TRUE(p.ok()) << p.error().message();
  return std::move(*p);
}

// The answer is the engine's on the prompt `pagoda run` would build from the
// chatml text written out by hand: the image where the part was, the image's
// tokens counted in the usage, and greedy ids equal.
TEST(image_chat, answers_as_the_engine_does_on_the_same_prompt) {
  vision_server vs;
  const std::vector<std::uint8_t> img = png(64, 64, 1);
  const http_reply r = vs.chat(one_image(data_url(img)));
  ASSERT_EQ(r.status, 200) << r.body;
  const vision::image_part part = part_of(img);
  EXPECT_EQ(details(r)["image_tokens"], part.n_image_tokens());
  EXPECT_EQ(details(r)["cached_image_tokens"], 0);

  const tokenizer& vocab = text_model().vocab();
  request q;
  q.id = "direct";
  q.max_tokens = 6;
  q.prompt = vocab.encode("<|im_start|>user\n", vocab.add_bos_default(), true);
  const auto at = static_cast<std::int32_t>(q.prompt.size());
  q.prompt.insert(q.prompt.end(), part.tokens.begin(), part.tokens.end());
  const std::vector<token_id> tail = vocab.encode("\nWhat is this?<|im_end|>\n<|im_start|>assistant\n", false, true);
  q.prompt.insert(q.prompt.end(), tail.begin(), tail.end());
  for (image_span s : part.spans) {
    s.begin += at;
    q.images.push_back(std::move(s));
  }
  EXPECT_EQ(r.json_body["usage"]["prompt_tokens"], static_cast<int>(q.prompt.size()));
  auto cfg = make_engine_core_config(text_model(), base_config());
  ASSERT_TRUE(cfg.ok());
  auto e = engine_core::create(text_model(), *cfg);
  ASSERT_TRUE(e.ok()) << e.error().message();
  ASSERT_TRUE((*e)->add_request(std::move(q)).ok());
  std::vector<token_id> want;
  std::vector<engine_event> events;
  for (int guard = 0; (*e)->has_work() && guard < 1000; ++guard) {
    events.clear();
    (*e)->step(events);
    for (const engine_event& ev : events) want.insert(want.end(), ev.tokens.begin(), ev.tokens.end());
  }
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(completion_ids(r.json_body), want);
}

// The same image again is a prefix-cache hit in the usage and on /metrics;
// another image (of the same size, and a JPEG) misses.
TEST(image_chat, the_same_image_is_cached_another_misses) {
  vision_server vs;
  const std::string a = data_url(png(64, 64, 1)), b = data_url(jpeg(64, 64, 2), "image/jpeg");
  const http_reply first = vs.chat(one_image(a));
  ASSERT_EQ(first.status, 200) << first.body;
  const int n_image = details(first)["image_tokens"];
  ASSERT_GT(n_image, 0);
  const http_reply second = vs.chat(one_image(a));
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(details(second)["image_tokens"], n_image);
  EXPECT_EQ(details(second)["cached_image_tokens"], n_image) << "block size 4: every image token is in a whole block";
  EXPECT_GE(details(second)["cached_tokens"].get<int>(), n_image);
  EXPECT_EQ(completion_ids(second.json_body), completion_ids(first.json_body));
  const http_reply other = vs.chat(one_image(b));
  ASSERT_EQ(other.status, 200) << other.body;
  EXPECT_EQ(details(other)["image_tokens"], n_image);
  EXPECT_EQ(details(other)["cached_image_tokens"], 0);
  EXPECT_GT(details(other)["cached_tokens"].get<int>(), 0) << "the text before the image still hits";

  const auto m = vs.server->metrics();
  EXPECT_EQ(metric(m, "pagoda:images_encoded_total"), 2) << "the repeated image's encoder output was kept";
  EXPECT_EQ(metric(m, "pagoda:image_encode_cache_hits_total"), 1);
  EXPECT_EQ(metric(m, "pagoda:image_prompt_tokens_total"), 3 * n_image);
  EXPECT_EQ(metric(m, "pagoda:image_prompt_tokens_cached_total"), n_image);
  EXPECT_GT(metric(m, "pagoda:image_encode_seconds_total"), 0);
  EXPECT_EQ(metric(m, "pagoda:images_refused_total"), 0);
}

// The encoder output cache: the same bytes give a copy of the same prompt
// part without encoding; the oldest entry goes when the budget is passed; 0
// keeps nothing.
TEST(image_chat, encoder_outputs_are_kept_by_bytes_within_the_budget) {
  const std::vector<std::uint8_t> a = png(64, 64, 1), b = png(64, 64, 2);
  const auto open = [](std::size_t cache_bytes) {
    server::image_options io;
    io.n_threads = 1;
    io.cache_bytes = cache_bytes;
    auto opened = server::image_input::open(vision_dir() + "/mmproj-idefics3-F32.gguf", text_model(), io);
    EXPECT_TRUE(opened.ok());
    return std::move(*opened);
  };
  const auto same = [](const vision::image_part& x, const vision::image_part& y) {
    if (x.tokens != y.tokens || x.spans.size() != y.spans.size()) return false;
    for (std::size_t i = 0; i < x.spans.size(); ++i)
      if (x.spans[i].embeddings != y.spans[i].embeddings || x.spans[i].content_hash != y.spans[i].content_hash)
        return false;
    return true;
  };
  auto big = open(std::size_t{64} << 20);
  auto first = big->encode(a);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(big->encode(b).ok());
  auto again = big->encode(a);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(same(*first, *again));
  EXPECT_EQ(big->counters().n_encoded, 2);
  EXPECT_EQ(big->counters().n_cache_hits, 1);

  // Room for one image's rows: b pushes a out.
  std::size_t one = first->tokens.size() * sizeof(token_id);
  for (const image_span& s : first->spans) one += s.embeddings.size() * sizeof(float);
  auto small = open(one);
  for (const auto* img : {&a, &b, &a}) ASSERT_TRUE(small->encode(*img).ok());
  EXPECT_EQ(small->counters().n_encoded, 3);
  EXPECT_EQ(small->counters().n_cache_hits, 0);
  ASSERT_TRUE(small->encode(a).ok());
  EXPECT_EQ(small->counters().n_cache_hits, 1) << "a is the newest entry now";

  auto none = open(0);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(none->encode(a).ok());
  EXPECT_EQ(none->counters().n_encoded, 2);
  EXPECT_EQ(none->counters().n_cache_hits, 0);
}

// Streaming: the usage chunk carries the image counts too.
TEST(image_chat, a_stream_reports_image_tokens) {
  vision_server vs;
  json body = one_image(data_url(png(48, 40, 3)));
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  const http_reply r = vs.chat(body);
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<std::string> events = sse_data(r.body);
  ASSERT_GE(events.size(), 2u);
  const json usage = json::parse(events[events.size() - 2])["usage"];
  EXPECT_GT(usage["prompt_tokens_details"]["image_tokens"].get<int>(), 0) << usage;
}

// Where the image of one_image() lies in the chatml prompt: the position
// of each span's first token.
std::vector<int> span_starts(const std::vector<std::uint8_t>& bytes) {
  const tokenizer& vocab = text_model().vocab();
  const int offset = static_cast<int>(vocab.encode("<|im_start|>user\n", vocab.add_bos_default(), true).size());
  std::vector<int> out;
  for (const image_span& s : part_of(bytes).spans) out.push_back(offset + s.begin);
  return out;
}

// --kv-image-type int8: the image's blocks are int8 (the KV class's blocks
// on /metrics): every block of 4 tokens all of the image's; a part's own
// "kv": {"type"} does the same on a server that keeps an int8 class but
// gives images no type.
TEST(image_chat, image_blocks_take_the_image_kv_type) {
  const std::string cached = "pagoda:kv_class_blocks{type=\"int8\",state=\"cached\"}";
  const std::vector<std::uint8_t> img = png(64, 64, 1);
  const std::string url = data_url(img);
  const std::vector<int> starts = span_starts(img);
  const int per_span = static_cast<int>(part_of(img).spans[0].n_tokens);
  int whole = 0;  // blocks of 4 inside a span
  for (int b : starts) whole += (b + per_span) / 4 - (b + 3) / 4;
  ASSERT_GT(whole, 0);
  {
    engine_config ec = base_config();
    ec.kv_image_type = "int8";
    vision_server vs(ec);
    EXPECT_EQ(metric(vs.server->metrics(), cached), 0);
    const http_reply r = vs.chat(one_image(url));
    ASSERT_EQ(r.status, 200) << r.body;
    const int n_image = details(r)["image_tokens"];
    ASSERT_TRUE(wait_idle(*vs.server));
    EXPECT_GT(n_image, 0);
    EXPECT_EQ(metric(vs.server->metrics(), cached), whole);
  }
  {
    engine_config ec = base_config();
    ec.kv_segment_dtypes = {"int8"};
    vision_server vs(ec);
    const http_reply plain = vs.chat(one_image(url));
    ASSERT_EQ(plain.status, 200) << plain.body;
    ASSERT_TRUE(wait_idle(*vs.server));
    EXPECT_EQ(metric(vs.server->metrics(), cached), 0) << "without a type of its own the image takes the text's";
    const http_reply own = vs.chat(one_image(url, {{"type", "int8"}}));
    ASSERT_EQ(own.status, 200) << own.body;
    ASSERT_TRUE(wait_idle(*vs.server));
    EXPECT_EQ(metric(vs.server->metrics(), cached), whole);
    // Blocks are keyed with their type: the f32 chain of the first request
    // serves up to the block that holds the image's first tokens, then the int8 blocks differ.
    EXPECT_EQ(details(own)["cached_image_tokens"], (starts[0] + 3) / 4 * 4 - starts[0]);
  }
}

// --kv-image-policy window:budget=0.5 keeps half the image's tokens (usage
// and /metrics say the policy acted); a part's own "kv": {"policy"} does the
// same on a server without one.
TEST(image_chat, the_image_policy_acts_on_the_image) {
  const std::string url = data_url(png(64, 64, 1));
  const auto check = [](vision_server& vs, const http_reply& r) {
    ASSERT_EQ(r.status, 200) << r.body;
    const int seen = r.json_body["usage"]["kv_tokens_seen"], kept = r.json_body["usage"]["kv_tokens_kept"];
    const int n_image = details(r)["image_tokens"];
    EXPECT_EQ(seen - kept, n_image / 2) << r.json_body["usage"];
    EXPECT_GT(metric(vs.server->metrics(), "pagoda:kv_policy_evicted_slots_total"), 0);
  };
  {
    engine_config ec = base_config();
    ec.kv_image_policy = "window:budget=0.5";
    vision_server vs(ec);
    check(vs, vs.chat(one_image(url)));
  }
  {
    vision_server vs;
    const http_reply plain = vs.chat(one_image(url));
    ASSERT_EQ(plain.status, 200);
    EXPECT_FALSE(plain.json_body["usage"].contains("kv_tokens_seen")) << "no policy, nothing evicted";
    check(vs, vs.chat(one_image(url, {{"policy", "window:budget=0.5"}})));
  }
}

void expect_400(vision_server& vs, const json& body, const std::string& needle) {
  const http_reply r = vs.chat(body);
  EXPECT_EQ(r.status, 400) << needle << ": " << r.body;
  const std::string msg = r.json_body.value("error", json::object()).value("message", "");
  EXPECT_NE(msg.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << msg;
}

// Every bad image is a 400 that says what is wrong; nothing is encoded for
// it, and the server answers the next request.
TEST(image_chat, bad_images_are_400s_and_the_server_goes_on) {
  server::image_options io;
  io.limits.max_bytes = 4096;
  io.limits.max_pixels = 100 * 100;
  io.max_images = 2;
  const std::vector<std::uint8_t> good = png(16, 16, 5);
  // A context that holds the image and the chat's frame, not much text besides.
  const int n_part = static_cast<int>(part_of(good).tokens.size());
  engine_config ec = base_config();
  ec.n_ctx = n_part + 64;
  vision_server vs(ec, io);
  // Text of fewer tokens than the context, more than it holds beside the image.
  std::string text;
  const tokenizer& vocab = text_model().vocab();
  while (static_cast<int>(vocab.encode("<|im_start|>user\n\n" + text + "<|im_end|>\n<|im_start|>assistant\n", true,
                                       true).size()) < 72)
    text += "ab ";
  std::vector<std::uint8_t> corrupt = good;
  for (std::size_t i = 40; i < corrupt.size(); ++i) corrupt[i] ^= 0x5a;
  const std::vector<std::uint8_t> truncated(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2));
  const std::vector<std::uint8_t> gif = {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0, 0, 0, 0, ';'};
  std::vector<std::uint8_t> noise(64 * 64 * 3);
  std::uint32_t x = 2463534242u;  // xorshift32: PNG cannot compress it
  for (std::uint8_t& b : noise) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  const std::vector<std::uint8_t> big_file = write_png(noise.data(), 64, 64, PNG_FORMAT_RGB);
  ASSERT_GT(big_file.size(), 4096u);

  expect_400(vs, one_image("https://example.com/cat.png"), "data:");
  expect_400(vs, one_image("file:///etc/passwd"), "data:");
  expect_400(vs, one_image("data:image/png;base64,@@not base64@@"), "base64");
  expect_400(vs, one_image(data_url(corrupt)), "PNG");
  expect_400(vs, one_image(data_url(truncated)), "PNG");
  expect_400(vs, one_image(data_url(gif, "image/gif")), "image/gif");
  expect_400(vs, one_image(data_url(gif)), "but its bytes are");
  expect_400(vs, one_image(data_url(big_file)), "bytes");
  const std::vector<std::uint8_t> flat(128 * 128 * 3, 200);  // a small file of many pixels
  const std::vector<std::uint8_t> wide = write_png(flat.data(), 128, 128, PNG_FORMAT_RGB);
  ASSERT_LT(wide.size(), 4096u);
  expect_400(vs, one_image(data_url(wide)), "pixels");
  expect_400(vs, chat_body(json::array({image_part(data_url(good)), image_part(data_url(good)),
                                        image_part(data_url(good))})),
             "--max-images-per-request");
  expect_400(vs, chat_body(json::array({image_part(data_url(good)), {{"type", "text"}, {"text", text}}}), 2),
             "of them images'");
  expect_400(vs, chat_body(json::array({{{"type", "image_url"}}})), "image_url");
  expect_400(vs, one_image(data_url(good), {{"type", "int3"}}), "int3");
  expect_400(vs, chat_body(json::array({image_part(data_url(good)), {{"type", "text"}, {"text", "<__media__>"}}})),
             "marker");

  const auto m = vs.server->metrics();
  // Refused: the two URLs, base64, corrupt, truncated, GIF twice, bytes, pixels, too many.
  EXPECT_EQ(metric(m, "pagoda:images_refused_total"), 10);
  EXPECT_EQ(metric(m, "pagoda:images_encoded_total"), 1) << "only the image of the request too long for the context";
  EXPECT_EQ(metric(m, "pagoda:kv_cache_blocks{state=\"used\"}"), 0);
  // Still serving: the image without the text fits.
  const http_reply ok = vs.chat(json{{"messages", {{{"role", "user"}, {"content", json::array({image_part(data_url(good))})}}}},
                                     {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.body;
}

// A KV type the engine keeps no class of is the engine's refusal: a 400 naming the flag.
TEST(image_chat, an_image_type_without_a_class_is_a_400) {
  vision_server vs;
  expect_400(vs, one_image(data_url(png(16, 16, 7)), {{"type", "int4"}}), "--kv-segment-dtype int4");
  expect_400(vs, one_image(data_url(png(16, 16, 7)), {{"reuse", "chunk"}}), "chunk");
  EXPECT_EQ(vs.chat(one_image(data_url(png(16, 16, 7)))).status, 200);
}

// Text parts with KV choices around an image: each keeps a segment on its
// own tokens, on either side of the image's, and the image's spans take the
// image part's own kv; the prompt is the text tokenized around the image.
TEST(image_chat, text_parts_keep_their_kv_around_an_image) {
  auto images = server::image_input::open(vision_dir() + "/mmproj-idefics3-F32.gguf", text_model(), {});
  ASSERT_TRUE(images.ok()) << images.error().message();
  server::api_options opts;
  opts.model_path = vision_dir() + "/text-tiny-F32.gguf";
  opts.chat_template = "chatml";
  auto ctx = server::make_api_context(text_model(), 512, opts, nullptr);
  ASSERT_TRUE(ctx.ok());
  ctx->images = images->get();
  const std::vector<std::uint8_t> img = png(40, 30, 4);
  const json body = {
      {"messages",
       {{{"role", "user"},
         {"content", json::array({{{"type", "text"}, {"text", "Look at this"}, {"kv", {{"policy", "window:budget=0.5"}}}},
                                  image_part(data_url(img), {{"type", "f32"}, {"policy", "none"}}),
                                  {{"type", "text"}, {"text", "and name it."}, {"kv", {{"type", "f32"}}}}})}}}},
      {"max_tokens", 4}};
  auto call = server::parse_request(server::api_kind::chat, body, *ctx, "");
  ASSERT_TRUE(call.ok()) << call.error.message;
  const request& r = call.value->requests.at(0);

  const tokenizer& vocab = text_model().vocab();
  const vision::image_part part = part_of(img);
  std::vector<token_id> want = vocab.encode("<|im_start|>user\nLook at this\n", vocab.add_bos_default(), true);
  const auto at = static_cast<std::int32_t>(want.size());
  want.insert(want.end(), part.tokens.begin(), part.tokens.end());
  const auto after = static_cast<std::int32_t>(want.size());
  const std::vector<token_id> tail = vocab.encode("\nand name it.<|im_end|>\n<|im_start|>assistant\n", false, true);
  want.insert(want.end(), tail.begin(), tail.end());
  EXPECT_EQ(r.prompt, want);
  ASSERT_EQ(r.images.size(), part.spans.size());
  for (std::size_t i = 0; i < r.images.size(); ++i) {
    EXPECT_EQ(r.images[i].begin, at + part.spans[i].begin);
    EXPECT_EQ(r.images[i].n_tokens, part.spans[i].n_tokens);
    EXPECT_EQ(r.images[i].kv_type, "f32");
    EXPECT_EQ(r.images[i].kv_policy, "none");
    EXPECT_EQ(r.images[i].content_hash, part.spans[i].content_hash);
  }
  ASSERT_EQ(r.segments.size(), 2u);
  const auto text_of = [&](const prompt_segment& s) {
    return vocab.decode(std::vector<token_id>(r.prompt.begin() + s.begin, r.prompt.begin() + s.end));
  };
  EXPECT_EQ(r.segments[0].kv_policy, "window:budget=0.5");
  EXPECT_LE(r.segments[0].end, at);
  EXPECT_NE(text_of(r.segments[0]).find("Look at this"), std::string::npos) << text_of(r.segments[0]);
  EXPECT_EQ(r.segments[1].kv_type, "f32");
  EXPECT_GE(r.segments[1].begin, after);
  EXPECT_NE(text_of(r.segments[1]).find("and name it."), std::string::npos) << text_of(r.segments[1]);
}

// Without --mmproj an image part is a 400 that says so.
TEST(image_chat, without_mmproj_an_image_is_a_400) {
  vision_server vs(base_config(), {}, /*with_images=*/false);
  expect_400(vs, one_image(data_url(png(16, 16, 1))), "--mmproj");
  const http_reply text = vs.chat(chat_body(json::array({{{"type", "text"}, {"text", "hello"}}})));
  EXPECT_EQ(text.status, 200) << text.body;
}

// An mmproj whose projection is not the model's width is refused at start.
TEST(image_chat, an_mmproj_of_another_width_is_refused) {
  auto r = server::image_input::open(vision_dir() + "/mmproj-idefics3-F32.gguf", stories(), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("does not match the model"), std::string::npos) << r.error().message();
  auto missing = server::image_input::open("/nonexistent/mmproj.gguf", text_model(), {});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message().find("--mmproj"), std::string::npos) << missing.error().message();
}

}  // namespace
}  // namespace pagoda::test
