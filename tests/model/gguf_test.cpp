// GGUF reader tests: the bundled model and vocabulary files, writer round trips
// of every value type, and one test per malformed-file case.
#include "model/gguf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/anon_memory.h"
#include "core/ggml_blocks.h"
#include "core/half.h"
#include "model/gguf_writer.h"

namespace pagoda::gguf {
namespace {

std::string source_path(const std::string& rel) { return std::string(PAGODA_SOURCE_DIR) + "/" + rel; }

TEST(gguf_real_files, stories260k) {
  auto r = file::open(source_path("models/stories260K.gguf"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  const file& f = **r;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.tensors().size(), 48u);
  EXPECT_EQ(*f.get_string("general.architecture"), "llama");
  EXPECT_EQ(*f.get_uint("llama.embedding_length"), 64u);
  EXPECT_EQ(*f.get_uint("llama.block_count"), 5u);
  EXPECT_EQ(*f.get_uint("llama.attention.head_count"), 8u);
  EXPECT_EQ(*f.get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(*f.get_string("tokenizer.ggml.model"), "llama");
  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[0], "<unk>");
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[2], "</s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores")->size(), 512u);
  auto types = f.get_i32_array("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ((*types)[3], 6);  // byte token
  EXPECT_NEAR(*f.get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);

  std::uint64_t total = 0;
  for (const auto& t : f.tensors()) {
    EXPECT_EQ(t.type, tensor_type::f32) << t.name;
    EXPECT_EQ(t.size_bytes, static_cast<std::uint64_t>(t.n_elements()) * 4) << t.name;
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    EXPECT_NE(t.data, nullptr) << t.name;
    total += t.size_bytes;
  }
  const tensor_info* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->n_dims, 2u);
  EXPECT_EQ(emb->ne[0], 64);
  EXPECT_EQ(emb->ne[1], 512);
  const tensor_info* wk = f.find_tensor("blk.4.attn_k.weight");
  ASSERT_NE(wk, nullptr);
  EXPECT_EQ(wk->ne[0], 64);
  EXPECT_EQ(wk->ne[1], 32);  // 4 KV heads of 8
  EXPECT_EQ(f.find_tensor("blk.5.attn_k.weight"), nullptr);
  // Tensor data fills the file after the header (no gaps larger than padding).
  EXPECT_LE(f.data_offset() + total, f.size_bytes());
  EXPECT_GT(f.data_offset() + total + 32 * 48, f.size_bytes());
}

TEST(gguf_real_files, vocab_only_files_have_no_tensors) {
  struct expect {
    const char* file;
    const char* model;
    std::size_t n_vocab;
  };
  const expect cases[] = {
      {"ggml-vocab-phi-3.gguf", "llama", 32064},
      {"ggml-vocab-deepseek-coder.gguf", "gpt2", 32256},
      {"ggml-vocab-starcoder.gguf", "gpt2", 49152},
  };
  for (const auto& c : cases) {
    auto r = file::open(source_path(std::string("tests/data/tokenizer/") + c.file));
    ASSERT_TRUE(r.ok()) << c.file << ": " << r.error().message();
    const file& f = **r;
    EXPECT_EQ(f.tensors().size(), 0u) << c.file;
    EXPECT_EQ(*f.get_string("tokenizer.ggml.model"), c.model) << c.file;
    EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), c.n_vocab) << c.file;
    EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type")->size(), c.n_vocab) << c.file;
  }
}

TEST(gguf_real_files, missing_file_is_not_found) {
  auto r = file::open(source_path("models/does-not-exist.gguf"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), errc::not_found);
  EXPECT_NE(r.error().message().find("does-not-exist.gguf"), std::string::npos);
}

TEST(gguf_real_files, directory_and_empty_file_are_rejected) {
  auto dir = file::open(source_path("models"));
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.error().code(), errc::invalid_argument);
  EXPECT_NE(dir.error().message().find("not a regular file"), std::string::npos);

  const std::string empty = ::testing::TempDir() + "/gguf_empty.gguf";
  std::FILE* fp = std::fopen(empty.c_str(), "wb");
  ASSERT_NE(fp, nullptr);
  std::fclose(fp);
  auto r = file::open(empty);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), errc::corrupt);
  EXPECT_NE(r.error().message().find("gguf_empty.gguf: truncated file: magic"), std::string::npos)
      << r.error().message();
  std::remove(empty.c_str());
}

// ---------------------------------------------------------------------------
// Writer -> reader round trips

using bytes_t = std::vector<std::byte>;
using ::testing::HasSubstr;

result<std::unique_ptr<file>> parse(const bytes_t& b) { return file::from_memory(b); }

template <typename T>
void patch(bytes_t& b, std::size_t pos, T v) {
  ASSERT_LE(pos + sizeof(T), b.size());
  std::memcpy(b.data() + pos, &v, sizeof(T));
}

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

TEST(gguf_round_trip, every_scalar_type) {
  writer w;
  w.add_u8("u8", 250);
  w.add_i8("i8", -120);
  w.add_u16("u16", 65000);
  w.add_i16("i16", -32000);
  w.add_u32("u32", 4000000000u);
  w.add_i32("i32", -2000000000);
  w.add_u64("u64", std::numeric_limits<std::uint64_t>::max());
  w.add_i64("i64", std::numeric_limits<std::int64_t>::min());
  w.add_f32("f32", 3.25f);
  w.add_f64("f64", -1e300);
  w.add_bool("t", true);
  w.add_bool("f", false);
  w.add_string("s", "h\xc3\xa9llo");
  w.add_string("empty", "");
  auto bytes = w.to_bytes();
  EXPECT_EQ(bytes.size(), w.layout().size_bytes);
  auto r = parse(bytes);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const file& f = **r;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.metadata().size(), 14u);
  EXPECT_EQ(f.tensors().size(), 0u);
  EXPECT_EQ(*f.get_uint("u8"), 250u);
  EXPECT_EQ(*f.get_int("i8"), -120);
  EXPECT_EQ(*f.get_uint("u16"), 65000u);
  EXPECT_EQ(*f.get_int("i16"), -32000);
  EXPECT_EQ(*f.get_uint("u32"), 4000000000u);
  EXPECT_EQ(*f.get_int("u32"), 4000000000);  // unsigned value that fits int64
  EXPECT_EQ(*f.get_int("i32"), -2000000000);
  EXPECT_EQ(*f.get_uint("u64"), std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(*f.get_int("i64"), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(*f.get_float("f32"), 3.25);
  EXPECT_EQ(*f.get_float("f64"), -1e300);
  EXPECT_EQ(*f.get_float("i8"), -120.0);  // integers read as floats
  EXPECT_TRUE(*f.get_bool("t"));
  EXPECT_FALSE(*f.get_bool("f"));
  EXPECT_EQ(*f.get_string("s"), "h\xc3\xa9llo");
  EXPECT_EQ(*f.get_string("empty"), "");
  EXPECT_EQ(f.find("u8")->type, value_type::u8);
  EXPECT_EQ(f.find("f64")->type, value_type::f64);
  EXPECT_EQ(f.find("nope"), nullptr);
  // Metadata keeps file order.
  EXPECT_EQ(f.metadata()[0].key, "u8");
  EXPECT_EQ(f.metadata()[13].key, "empty");
}

TEST(gguf_round_trip, getter_errors_name_key_and_type) {
  writer w;
  w.add_string("name", "x");
  w.add_i32("neg", -5);
  w.add_u64("huge", std::numeric_limits<std::uint64_t>::max());
  const std::int64_t wide[] = {1, 1LL << 40};
  w.add_array("wide", std::span<const std::int64_t>(wide));
  const std::uint32_t big[] = {1, 3000000000u};
  w.add_array("big", std::span<const std::uint32_t>(big));
  const float fl[] = {1.5f};
  w.add_array("fl", std::span<const float>(fl));
  auto bytes = w.to_bytes();
  auto r = parse(bytes);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const file& f = **r;

  auto missing = f.get_uint("missing.key");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), errc::not_found);
  EXPECT_THAT(missing.error().message(), HasSubstr("missing.key"));

  auto wrong = f.get_uint("name");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.error().code(), errc::invalid_argument);
  EXPECT_THAT(wrong.error().message(), HasSubstr("'name'"));
  EXPECT_THAT(wrong.error().message(), HasSubstr("string"));

  EXPECT_EQ(f.get_string("neg").error().code(), errc::invalid_argument);
  EXPECT_THAT(f.get_string("neg").error().message(), HasSubstr("int32"));
  EXPECT_EQ(f.get_bool("neg").error().code(), errc::invalid_argument);
  EXPECT_EQ(f.get_uint("neg").error().code(), errc::out_of_range);
  EXPECT_EQ(f.get_int("huge").error().code(), errc::out_of_range);
  EXPECT_EQ(f.get_string_array("fl").error().code(), errc::invalid_argument);
  EXPECT_THAT(f.get_string_array("fl").error().message(), HasSubstr("array of float32"));
  EXPECT_EQ(f.get_i32_array("fl").error().code(), errc::invalid_argument);
  EXPECT_EQ(f.get_f32_array("name").error().code(), errc::invalid_argument);
  EXPECT_EQ(f.get_i32_array("wide").error().code(), errc::out_of_range);
  EXPECT_EQ(f.get_i32_array("big").error().code(), errc::out_of_range);
  EXPECT_EQ(*f.get_f32_array("wide"), (std::vector<float>{1.0f, static_cast<float>(1LL << 40)}));
}

template <typename T>
void check_array_round_trip(std::vector<T> values, value_type expect_type) {
  writer w;
  if constexpr (std::is_same_v<T, bool>) {
    bool raw[8];
    for (std::size_t k = 0; k < values.size(); ++k) raw[k] = values[k];
    w.add_array("arr", std::span<const bool>(raw, values.size()));
  } else {
    w.add_array("arr", std::span<const T>(values));
  }
  w.add_array("empty", std::span<const T>());
  auto bytes = w.to_bytes();
  auto r = parse(bytes);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const value* v = (*r)->find("arr");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->type, value_type::array);
  EXPECT_EQ(v->array_type, expect_type);
  ASSERT_EQ(v->array_size, values.size());
  for (std::size_t k = 0; k < values.size(); ++k) {
    EXPECT_EQ(load<T>(v->array_data + k * sizeof(T)), values[k]) << k;
  }
  const value* e = (*r)->find("empty");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->array_type, expect_type);
  EXPECT_EQ(e->array_size, 0u);
  if constexpr (!std::is_same_v<T, bool>) {
    auto f32 = (*r)->get_f32_array("arr");
    ASSERT_TRUE(f32.ok()) << f32.error().message();
    for (std::size_t k = 0; k < values.size(); ++k) EXPECT_EQ((*f32)[k], static_cast<float>(values[k]));
    EXPECT_TRUE((*r)->get_f32_array("empty")->empty());
  }
}

TEST(gguf_round_trip, arrays_of_every_element_type) {
  check_array_round_trip<std::uint8_t>({0, 7, 255}, value_type::u8);
  check_array_round_trip<std::int8_t>({-128, 0, 127}, value_type::i8);
  check_array_round_trip<std::uint16_t>({1, 65535}, value_type::u16);
  check_array_round_trip<std::int16_t>({-32768, 32767}, value_type::i16);
  check_array_round_trip<std::uint32_t>({0, 4294967295u}, value_type::u32);
  check_array_round_trip<std::int32_t>({-7, 2147483647}, value_type::i32);
  check_array_round_trip<std::uint64_t>({1, 1ULL << 63}, value_type::u64);
  check_array_round_trip<std::int64_t>({-(1LL << 62), 5}, value_type::i64);
  check_array_round_trip<float>({0.5f, -2.0f, 1e-30f}, value_type::f32);
  check_array_round_trip<double>({0.1, -1e200}, value_type::f64);
  check_array_round_trip<bool>({true, false, true}, value_type::boolean);
}

TEST(gguf_round_trip, integer_arrays_convert_to_i32) {
  writer w;
  const std::int8_t a[] = {-3, 4};
  const std::uint16_t b[] = {65535};
  w.add_array("a", std::span<const std::int8_t>(a));
  w.add_array("b", std::span<const std::uint16_t>(b));
  auto bytes = w.to_bytes();
  auto r = parse(bytes);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*(*r)->get_i32_array("a"), (std::vector<std::int32_t>{-3, 4}));
  EXPECT_EQ(*(*r)->get_i32_array("b"), (std::vector<std::int32_t>{65535}));
}

TEST(gguf_round_trip, string_arrays) {
  const std::vector<std::string> tokens = {"<unk>", "", "\xe2\x96\x81the", std::string("a\0b", 3), "<0xFF>"};
  writer w(2);
  w.add_string_array("tokens", std::span<const std::string>(tokens));
  w.add_string_array("none", std::span<const std::string>());
  auto bytes = w.to_bytes();
  auto r = parse(bytes);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ((*r)->version(), 2u);
  auto got = (*r)->get_string_array("tokens");
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), tokens.size());
  for (std::size_t k = 0; k < tokens.size(); ++k) EXPECT_EQ((*got)[k], tokens[k]);
  EXPECT_TRUE((*r)->get_string_array("none")->empty());
}

// Two-tensor base file used by the malformed cases: an f32 [64 x 2] and a q8_0 [64 x 3].
struct base_file {
  bytes_t bytes;
  file_layout layout;
};

base_file make_base_file(std::uint32_t alignment = 32) {
  writer w;
  if (alignment != 32) w.set_alignment(alignment);
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 1);
  const std::vector<std::string> toks = {"a", "b"};
  w.add_string_array("tokenizer.ggml.tokens", std::span<const std::string>(toks));
  const float scores[] = {0.f, -1.f};
  w.add_array("tokenizer.ggml.scores", std::span<const float>(scores));
  std::vector<float> a(64 * 2);
  for (std::size_t k = 0; k < a.size(); ++k) a[k] = static_cast<float>(k);
  const std::int64_t ne_a[] = {64, 2};
  w.add_tensor("a", tensor_type::f32, ne_a, std::as_bytes(std::span<const float>(a)));
  std::vector<std::byte> q(6 * sizeof(block_q8_0), std::byte{1});
  const std::int64_t ne_b[] = {64, 3};
  w.add_tensor("b", tensor_type::q8_0, ne_b, q);
  return {w.to_bytes(), w.layout()};
}

TEST(gguf_round_trip, tensors_of_every_supported_type) {
  for (std::uint32_t alignment : {32u, 64u, 4096u}) {
    writer w;
    w.set_alignment(alignment);
    struct spec {
      const char* name;
      tensor_type type;
      std::int64_t ne[4];
      std::uint32_t n_dims;
    };
    const spec specs[] = {
        {"t.f32", tensor_type::f32, {3, 1, 1, 1}, 1},
        {"t.f16", tensor_type::f16, {5, 3, 1, 1}, 2},
        {"t.bf16", tensor_type::bf16, {2, 3, 4, 1}, 3},
        {"t.q8_0", tensor_type::q8_0, {64, 3, 1, 1}, 2},
        {"t.q4_0", tensor_type::q4_0, {32, 2, 2, 2}, 4},
        {"t.q4_1", tensor_type::q4_1, {32, 2, 1, 1}, 2},
        {"t.q5_0", tensor_type::q5_0, {64, 1, 1, 1}, 1},
        {"t.q5_1", tensor_type::q5_1, {32, 3, 1, 1}, 2},
        {"t.iq4_nl", tensor_type::iq4_nl, {96, 1, 1, 1}, 1},
        {"t.q2_K", tensor_type::q2_k, {256, 2, 1, 1}, 2},
        {"t.q3_K", tensor_type::q3_k, {512, 1, 1, 1}, 1},
        {"t.q4_K", tensor_type::q4_k, {256, 3, 1, 1}, 2},
        {"t.q5_K", tensor_type::q5_k, {256, 1, 2, 1}, 3},
        {"t.q6_K", tensor_type::q6_k, {256, 2, 1, 1}, 2},
        {"t.iq4_xs", tensor_type::iq4_xs, {256, 1, 1, 1}, 1},
        {"t.iq3_s", tensor_type::iq3_s, {256, 2, 1, 1}, 2},
        {"t.mxfp4", tensor_type::mxfp4, {64, 3, 5, 1}, 3},  // 17-byte blocks: 510 bytes, padded to the alignment
    };
    constexpr std::size_t n_specs = sizeof(specs) / sizeof(specs[0]);
    std::vector<bytes_t> datas;
    std::uint32_t seed = 1;
    for (const auto& s : specs) {
      auto size = tensor_size_bytes(static_cast<std::uint32_t>(s.type), std::span<const std::int64_t>(s.ne, s.n_dims));
      ASSERT_TRUE(size.has_value());
      bytes_t d(*size);
      for (auto& b : d) b = static_cast<std::byte>((seed = seed * 1103515245u + 12345u) >> 24);
      w.add_tensor(s.name, s.type, std::span<const std::int64_t>(s.ne, s.n_dims), d);
      datas.push_back(std::move(d));
    }
    auto bytes = w.to_bytes();
    auto lay = w.layout();
    ASSERT_EQ(bytes.size(), lay.size_bytes);
    auto r = parse(bytes);
    ASSERT_TRUE(r.ok()) << r.error().message();
    const file& f = **r;
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.data_offset(), lay.data_start);
    EXPECT_EQ(f.data_offset() % alignment, 0u);
    ASSERT_EQ(f.tensors().size(), n_specs);
    EXPECT_EQ(f.tensors()[3].size_bytes, 6u * 34u);   // 6 q8_0 blocks
    EXPECT_EQ(f.tensors()[4].size_bytes, 8u * 18u);   // 8 q4_0 blocks
    EXPECT_EQ(f.tensors()[5].size_bytes, 2u * 20u);   // 2 q4_1 blocks
    EXPECT_EQ(f.tensors()[6].size_bytes, 2u * 22u);   // 2 q5_0 blocks
    EXPECT_EQ(f.tensors()[7].size_bytes, 3u * 24u);   // 3 q5_1 blocks
    EXPECT_EQ(f.tensors()[8].size_bytes, 3u * 18u);   // 3 iq4_nl blocks
    EXPECT_EQ(f.tensors()[9].size_bytes, 2u * 84u);   // 2 q2_K super-blocks
    EXPECT_EQ(f.tensors()[10].size_bytes, 2u * 110u); // 2 q3_K
    EXPECT_EQ(f.tensors()[11].size_bytes, 3u * 144u); // 3 q4_K
    EXPECT_EQ(f.tensors()[12].size_bytes, 2u * 176u); // 2 q5_K
    EXPECT_EQ(f.tensors()[13].size_bytes, 2u * 210u); // 2 q6_K
    EXPECT_EQ(f.tensors()[14].size_bytes, 1u * 136u); // 1 iq4_xs
    EXPECT_EQ(f.tensors()[15].size_bytes, 2u * 110u); // 2 iq3_s
    for (std::size_t k = 0; k < n_specs; ++k) {
      const tensor_info& t = f.tensors()[k];
      EXPECT_EQ(t.name, specs[k].name);
      EXPECT_EQ(t.type, specs[k].type);
      EXPECT_EQ(t.n_dims, specs[k].n_dims);
      for (int d = 0; d < 4; ++d) EXPECT_EQ(t.ne[d], specs[k].ne[d]);
      EXPECT_EQ(t.offset % alignment, 0u);
      EXPECT_EQ(t.offset, lay.tensors[k].data_offset);
      ASSERT_EQ(t.size_bytes, datas[k].size());
      EXPECT_EQ(t.data, bytes.data() + f.data_offset() + t.offset);
      EXPECT_EQ(std::memcmp(t.data, datas[k].data(), t.size_bytes), 0) << t.name;
      EXPECT_EQ(f.find_tensor(specs[k].name), &t);
    }
  }
}

TEST(gguf_round_trip, streamed_tensor_matches_and_file_maps) {
  // 2100 rows of 1100 f32 are ~9 MB: more than one fill chunk.
  const std::int64_t ne[] = {1100, 2100};
  auto value_at = [](std::int64_t row, std::int64_t col) { return static_cast<float>(row * 7 + col % 13); };
  std::int64_t rows_seen = 0;
  int calls = 0;
  writer w;
  w.add_string("general.name", "streamed");
  w.add_tensor("big", tensor_type::f32, ne, [&](std::int64_t first, std::int64_t n, std::span<std::byte> out) {
    EXPECT_EQ(first, rows_seen);
    EXPECT_EQ(out.size(), static_cast<std::size_t>(n) * 1100 * 4);
    auto* p = reinterpret_cast<float*>(out.data());
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c = 0; c < 1100; ++c) p[r * 1100 + c] = value_at(first + r, c);
    rows_seen += n;
    ++calls;
    return ok_status();
  });
  const std::string path = ::testing::TempDir() + "/gguf_streamed.gguf";
  ASSERT_TRUE(w.write_file(path).ok());
  EXPECT_EQ(rows_seen, 2100);
  EXPECT_GT(calls, 1);
  auto r = file::open(path);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const tensor_info* t = (*r)->find_tensor("big");
  ASSERT_NE(t, nullptr);
  const auto* p = reinterpret_cast<const float*>(t->data);
  for (std::int64_t row : {0, 1, 1000, 2099})
    for (std::int64_t c : {0, 5, 1099}) EXPECT_EQ(p[row * 1100 + c], value_at(row, c));
  EXPECT_EQ((*r)->size_bytes(), w.layout().size_bytes);
  EXPECT_EQ((*r)->path(), path);
  std::remove(path.c_str());
}

// --no-mmap: the file read into anonymous memory parses to the same metadata
// and the same tensor bytes as the mapped file, at the same offsets; the
// memory is the reader's own (the file can change or go away underneath it).
TEST(gguf_no_mmap, read_into_memory_holds_the_same_bytes) {
  const std::string src = source_path("models/stories260K.gguf");
  const std::string path = ::testing::TempDir() + "/gguf_no_mmap.gguf";
  {
    std::FILE* in = std::fopen(src.c_str(), "rb");
    std::FILE* out = std::fopen(path.c_str(), "wb");
    ASSERT_TRUE(in && out);
    char buf[65536];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, in)) > 0) std::fwrite(buf, 1, n, out);
    std::fclose(in);
    std::fclose(out);
  }
  auto mapped = file::open(path);
  auto read = file::open(path, open_options{.use_mmap = false});
  ASSERT_TRUE(mapped.ok() && read.ok()) << (read.ok() ? "" : read.error().message());
  const file& a = **mapped;
  const file& b = **read;
  EXPECT_EQ(a.storage_kind(), file::storage::mapped);
  EXPECT_EQ(b.storage_kind(), file::storage::read_into_memory);
  EXPECT_EQ(b.size_bytes(), a.size_bytes());
  EXPECT_EQ(b.data_offset(), a.data_offset());
  EXPECT_EQ(*b.get_string("general.architecture"), "llama");
  ASSERT_EQ(b.tensors().size(), a.tensors().size());
  for (std::size_t k = 0; k < a.tensors().size(); ++k) {
    const tensor_info& ta = a.tensors()[k];
    const tensor_info& tb = b.tensors()[k];
    EXPECT_EQ(tb.name, ta.name);
    EXPECT_EQ(tb.offset, ta.offset);
    ASSERT_EQ(tb.size_bytes, ta.size_bytes);
    EXPECT_NE(tb.data, ta.data);
    EXPECT_EQ(std::memcmp(tb.data, ta.data, ta.size_bytes), 0) << ta.name;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(tb.data) % 32, 0u) << ta.name;  // the file's alignment holds
  }
  // The mapping starts on a huge-page boundary (so that the page cache's huge
  // folios of the file can be mapped whole); this 1.2 MB file is smaller than
  // one, so none of it is mapped by a huge page.
  const tensor_info& first = a.tensors().front();
  const std::byte* start = first.data - a.data_offset() - first.offset;
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(start) % pagoda::huge_page_bytes(), 0u);
  EXPECT_EQ(a.huge_page_bytes(), 0u);
  EXPECT_LE(b.huge_page_bytes(), (b.size_bytes() + (2u << 20) - 1) / (2u << 20) * (2u << 20));
  // Overwrite the file: the read copy keeps the bytes it read.
  const tensor_info* t = b.find_tensor("token_embd.weight");
  std::vector<std::byte> before(t->data, t->data + t->size_bytes);
  {
    std::FILE* out = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(out, nullptr);
    std::fseek(out, static_cast<long>(b.data_offset() + t->offset), SEEK_SET);
    std::vector<char> junk(t->size_bytes, 0x5a);
    std::fwrite(junk.data(), 1, junk.size(), out);
    std::fclose(out);
  }
  EXPECT_EQ(std::memcmp(t->data, before.data(), before.size()), 0);
  std::remove(path.c_str());
}

// The errors of a read are the mapping's: a missing file is not_found, a
// directory invalid_argument, an empty file a truncated magic.
TEST(gguf_no_mmap, errors_match_the_mapped_open) {
  const open_options read{.use_mmap = false};
  EXPECT_EQ(file::open(source_path("models/does-not-exist.gguf"), read).error().code(), errc::not_found);
  EXPECT_EQ(file::open(source_path("models"), read).error().code(), errc::invalid_argument);
  const std::string empty = ::testing::TempDir() + "/gguf_no_mmap_empty.gguf";
  std::fclose(std::fopen(empty.c_str(), "wb"));
  auto r = file::open(empty, read);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().message(), HasSubstr("truncated file: magic"));
  std::remove(empty.c_str());
}

TEST(gguf_round_trip, failing_fill_leaves_no_file) {
  writer w;
  const std::int64_t ne[] = {32};
  w.add_tensor("t", tensor_type::f32, ne, [](std::int64_t, std::int64_t, std::span<std::byte>) {
    return error(errc::internal, "producer failed");
  });
  const std::string path = ::testing::TempDir() + "/gguf_fail.gguf";
  status st = w.write_file(path);
  EXPECT_EQ(st.code(), errc::internal);
  EXPECT_THAT(st.message(), HasSubstr("producer failed"));
  EXPECT_EQ(file::open(path).error().code(), errc::not_found);
  EXPECT_EQ(file::open(path + ".tmp").error().code(), errc::not_found);
}

TEST(gguf_round_trip, tensor_size_bytes_rules) {
  const std::int64_t ok_q8[] = {64, 3};
  EXPECT_EQ(tensor_size_bytes(8, ok_q8), 6u * 34u);
  const std::int64_t bad_q8[] = {48, 3};
  EXPECT_FALSE(tensor_size_bytes(8, bad_q8).has_value());
  const std::int64_t zero[] = {4, 0};
  EXPECT_FALSE(tensor_size_bytes(0, zero).has_value());
  const std::int64_t overflow[] = {1LL << 40, 1LL << 40};
  EXPECT_FALSE(tensor_size_bytes(0, overflow).has_value());
  const std::int64_t bytes_overflow[] = {1LL << 31, 1LL << 31};  // 2^62 elements * 4 bytes
  EXPECT_FALSE(tensor_size_bytes(0, bytes_overflow).has_value());
  EXPECT_FALSE(tensor_size_bytes(99, ok_q8).has_value());
  EXPECT_STREQ(tensor_type_name(tensor_type::q4_k), "q4_K");
  EXPECT_TRUE(get_tensor_type_traits(30)->supported);
  EXPECT_TRUE(get_tensor_type_traits(12)->supported);   // q4_K
  EXPECT_TRUE(get_tensor_type_traits(39)->supported);   // mxfp4
  EXPECT_STREQ(tensor_type_name(tensor_type::mxfp4), "mxfp4");
  EXPECT_FALSE(get_tensor_type_traits(16)->supported);  // iq2_xxs
  EXPECT_FALSE(get_tensor_type_traits(15)->supported);  // q8_K: an activation format, never a weight
  EXPECT_EQ(get_tensor_type_traits(4), nullptr);
}

// ---------------------------------------------------------------------------
// Malformed files: one test per case, each checking the error code and message.

void expect_error(const bytes_t& bytes, errc code, std::string_view substr) {
  auto r = parse(bytes);
  ASSERT_FALSE(r.ok()) << "parsed a malformed file; expected: " << substr;
  EXPECT_EQ(r.error().code(), code) << errc_name(r.error().code()) << ": " << r.error().message();
  EXPECT_THAT(r.error().message(), HasSubstr(std::string(substr)));
}

TEST(gguf_malformed, base_file_is_valid) {
  auto base = make_base_file();
  auto r = parse(base.bytes);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ((*r)->tensors().size(), 2u);
  EXPECT_EQ((*r)->tensors()[1].offset, 512u);  // 64*2*4 = 512 bytes of f32 before it
}

TEST(gguf_malformed, bad_magic) {
  auto b = make_base_file().bytes;
  b[k_header_magic_pos + 3] = std::byte{'X'};
  expect_error(b, errc::corrupt, "bad magic");
  expect_error(bytes_t{}, errc::corrupt, "truncated file: magic");
}

TEST(gguf_malformed, version_1_is_unsupported) {
  auto b = make_base_file().bytes;
  patch<std::uint32_t>(b, k_header_version_pos, 1);
  expect_error(b, errc::unsupported, "version 1");
}

TEST(gguf_malformed, future_version_is_unsupported) {
  auto b = make_base_file().bytes;
  patch<std::uint32_t>(b, k_header_version_pos, 4);
  expect_error(b, errc::unsupported, "unsupported GGUF version 4");
}

TEST(gguf_malformed, big_endian_file_is_named) {
  auto b = make_base_file().bytes;
  patch<std::uint32_t>(b, k_header_version_pos, 0x03000000u);
  expect_error(b, errc::unsupported, "big-endian");
}

TEST(gguf_malformed, truncated_at_every_point) {
  auto base = make_base_file();
  ASSERT_EQ(base.bytes.size(), base.layout.size_bytes);
  for (std::size_t n = 0; n < base.bytes.size(); ++n) {
    bytes_t cut(base.bytes.begin(), base.bytes.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = parse(cut);
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(r.error().code(), errc::corrupt) << n << ": " << r.error().message();
    const std::string& m = r.error().message();
    EXPECT_TRUE(m.find("truncated") != std::string::npos || m.find("past the end") != std::string::npos ||
                m.find("cannot fit") != std::string::npos)
        << n << ": " << m;
  }
}

TEST(gguf_malformed, key_length_past_end) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.kv_pos[0], 1ULL << 40);
  expect_error(base.bytes, errc::corrupt, "metadata key at offset 24: length 1099511627776 runs past the end");
}

TEST(gguf_malformed, string_value_length_past_end) {
  auto base = make_base_file();
  // general.architecture: key length (8) + key (20) + type (4), then the value's length.
  std::size_t value_len_pos = base.layout.kv_pos[0] + 8 + 20 + 4;
  patch<std::uint64_t>(base.bytes, value_len_pos, ~0ULL);
  expect_error(base.bytes, errc::corrupt, "metadata key 'general.architecture': string value at offset");
}

TEST(gguf_malformed, string_array_element_length_past_end) {
  auto base = make_base_file();
  // tokenizer.ggml.tokens: key len + key (21) + type + elem type + count, then the first string.
  std::size_t first_len_pos = base.layout.kv_pos[2] + 8 + 21 + 4 + 4 + 8;
  patch<std::uint64_t>(base.bytes, first_len_pos, 1ULL << 50);
  expect_error(base.bytes, errc::corrupt, "string array element at offset");
}

TEST(gguf_malformed, string_array_count_beyond_file) {
  auto base = make_base_file();
  std::size_t count_pos = base.layout.kv_pos[2] + 8 + 21 + 4 + 4;
  patch<std::uint64_t>(base.bytes, count_pos, 1ULL << 61);
  expect_error(base.bytes, errc::corrupt, "2305843009213693952 strings cannot fit");
}

TEST(gguf_malformed, numeric_array_count_beyond_file) {
  auto base = make_base_file();
  std::size_t count_pos = base.layout.kv_pos[3] + 8 + 21 + 4 + 4;  // tokenizer.ggml.scores
  patch<std::uint64_t>(base.bytes, count_pos, ~0ULL / 2);
  expect_error(base.bytes, errc::corrupt, "elements of float32 cannot fit");
}

TEST(gguf_malformed, absurd_metadata_count) {
  auto b = make_base_file().bytes;
  patch<std::uint64_t>(b, k_header_n_kv_pos, ~0ULL);
  expect_error(b, errc::corrupt, "metadata count 18446744073709551615 cannot fit");
}

TEST(gguf_malformed, absurd_tensor_count) {
  auto b = make_base_file().bytes;
  patch<std::uint64_t>(b, k_header_n_tensors_pos, 1ULL << 40);
  expect_error(b, errc::corrupt, "tensor count 1099511627776 cannot fit");
}

TEST(gguf_malformed, n_dims_zero) {
  auto base = make_base_file();
  patch<std::uint32_t>(base.bytes, base.layout.tensors[0].n_dims_pos, 0);
  expect_error(base.bytes, errc::corrupt, "tensor 'a' (info 0 at offset");
  expect_error(base.bytes, errc::corrupt, "n_dims 0 is not in 1..4");
}

TEST(gguf_malformed, n_dims_above_four) {
  auto base = make_base_file();
  patch<std::uint32_t>(base.bytes, base.layout.tensors[1].n_dims_pos, 5);
  expect_error(base.bytes, errc::corrupt, "tensor 'b'");
  expect_error(base.bytes, errc::corrupt, "n_dims 5 is not in 1..4");
}

TEST(gguf_malformed, zero_dimension) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[0].ne_pos + 8, 0);
  expect_error(base.bytes, errc::corrupt, "tensor 'a' (info 0 at offset");
  expect_error(base.bytes, errc::corrupt, "dimension 1 is zero");
}

TEST(gguf_malformed, negative_dimension) {
  auto base = make_base_file();
  patch<std::int64_t>(base.bytes, base.layout.tensors[0].ne_pos, -64);
  expect_error(base.bytes, errc::corrupt, "dimension 0 is 18446744073709551552 (negative as int64)");
}

TEST(gguf_malformed, element_count_overflow) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[0].ne_pos, 1ULL << 40);
  patch<std::uint64_t>(base.bytes, base.layout.tensors[0].ne_pos + 8, 1ULL << 40);
  expect_error(base.bytes, errc::corrupt, "element count of shape [1099511627776, 1099511627776, 1, 1] overflows");
}

TEST(gguf_malformed, byte_size_overflow) {
  auto base = make_base_file();
  // 2^62 f32 elements fit int64 but their 2^64 bytes do not.
  patch<std::uint64_t>(base.bytes, base.layout.tensors[0].ne_pos, 1ULL << 31);
  patch<std::uint64_t>(base.bytes, base.layout.tensors[0].ne_pos + 8, 1ULL << 31);
  expect_error(base.bytes, errc::corrupt, "tensor 'a' (info 0 at offset");
  expect_error(base.bytes, errc::corrupt, "byte size overflows");
}

TEST(gguf_malformed, row_not_a_multiple_of_block_size) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[1].ne_pos, 48);
  expect_error(base.bytes, errc::corrupt, "row length 48 is not a multiple of the q8_0 block size 32");
}

TEST(gguf_malformed, misaligned_tensor_offset) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[1].offset_pos, 516);
  expect_error(base.bytes, errc::corrupt, "tensor 'b' (info 1 at offset");
  expect_error(base.bytes, errc::corrupt, "data offset 516 is not a multiple of the alignment 32");
}

TEST(gguf_malformed, tensor_data_past_end) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[1].offset_pos, 1 << 20);
  expect_error(base.bytes, errc::corrupt, "tensor 'b': data at offset 1048576 with size 204 runs past the end");
}

TEST(gguf_malformed, tensor_offset_plus_size_overflows) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[1].offset_pos, ~0ULL - 31);  // aligned, and + size wraps
  expect_error(base.bytes, errc::corrupt, "tensor 'b': data at offset 18446744073709551584");
}

TEST(gguf_malformed, tensor_data_last_byte_missing) {
  auto base = make_base_file();
  base.bytes.pop_back();
  expect_error(base.bytes, errc::corrupt, "tensor 'b': data at offset 512 with size 204 runs past the end");
}

TEST(gguf_malformed, overlapping_tensor_data) {
  auto base = make_base_file();
  patch<std::uint64_t>(base.bytes, base.layout.tensors[1].offset_pos, 256);
  expect_error(base.bytes, errc::corrupt, "tensor 'b' data [256, 460) overlaps tensor 'a' data [0, 512)");
}

TEST(gguf_malformed, unknown_tensor_type) {
  auto base = make_base_file();
  patch<std::uint32_t>(base.bytes, base.layout.tensors[0].type_pos, 99);
  expect_error(base.bytes, errc::corrupt, "tensor 'a' (info 0 at offset");
  expect_error(base.bytes, errc::corrupt, "unknown tensor type 99");
  patch<std::uint32_t>(base.bytes, base.layout.tensors[0].type_pos, 4);  // removed from ggml (q4_2)
  expect_error(base.bytes, errc::corrupt, "unknown tensor type 4");
}

TEST(gguf_malformed, unsupported_tensor_type_is_named) {
  auto base = make_base_file();
  patch<std::uint32_t>(base.bytes, base.layout.tensors[1].type_pos, 16);
  expect_error(base.bytes, errc::unsupported, "tensor 'b'");
  expect_error(base.bytes, errc::unsupported, "tensor type iq2_xxs is not supported");
  patch<std::uint32_t>(base.bytes, base.layout.tensors[1].type_pos, 35);
  expect_error(base.bytes, errc::unsupported, "tensor type tq2_0 is not supported");
}

TEST(gguf_malformed, duplicate_key) {
  writer w;
  w.add_u32("a.b", 1);
  w.add_string("a.b", "again");
  expect_error(w.to_bytes(), errc::corrupt, "duplicate metadata key 'a.b' (entry 1 at offset");
}

TEST(gguf_malformed, duplicate_tensor_name) {
  writer w;
  const std::int64_t ne[] = {4};
  const float d[4] = {};
  w.add_tensor("w", tensor_type::f32, ne, std::as_bytes(std::span<const float>(d)));
  w.add_tensor("w", tensor_type::f32, ne, std::as_bytes(std::span<const float>(d)));
  expect_error(w.to_bytes(), errc::corrupt, "duplicate tensor name 'w' (info 1");
}

TEST(gguf_malformed, invalid_utf8_key) {
  for (std::string key : {std::string("bad\xff"), std::string("\xc0\xaf"), std::string("\xed\xa0\x80"),
                          std::string("cut\xe2\x96")}) {
    writer w;
    w.add_u8("fine", 1);
    w.add_u8(key, 1);
    expect_error(w.to_bytes(), errc::corrupt, "metadata entry 1 at offset");
    expect_error(w.to_bytes(), errc::corrupt, "key is not valid UTF-8");
  }
}

TEST(gguf_malformed, empty_key) {
  writer w;
  w.add_u8("", 1);
  w.add_u8("next", 1);
  expect_error(w.to_bytes(), errc::corrupt, "metadata entry 0 at offset 24: empty key");
}

TEST(gguf_malformed, nested_array) {
  writer w;
  bytes_t payload(12);
  std::uint32_t elem = static_cast<std::uint32_t>(value_type::array);
  std::memcpy(payload.data(), &elem, 4);  // element type array, count 0
  w.add_raw("nested", static_cast<std::uint32_t>(value_type::array), payload);
  expect_error(w.to_bytes(), errc::unsupported, "metadata key 'nested': array at offset");
  expect_error(w.to_bytes(), errc::unsupported, "nested arrays are not supported");
}

TEST(gguf_malformed, unknown_value_type) {
  writer w;
  w.add_raw("odd", 13, bytes_t(8));
  expect_error(w.to_bytes(), errc::corrupt, "metadata key 'odd': unknown value type 13");
}

TEST(gguf_malformed, unknown_array_element_type) {
  writer w;
  bytes_t payload(12);
  std::uint32_t elem = 77;
  std::memcpy(payload.data(), &elem, 4);
  w.add_raw("odd", static_cast<std::uint32_t>(value_type::array), payload);
  expect_error(w.to_bytes(), errc::corrupt, "unknown element type 77");
}

TEST(gguf_malformed, bool_not_zero_or_one) {
  writer w;
  w.add_raw("flag", static_cast<std::uint32_t>(value_type::boolean), bytes_t{std::byte{2}});
  expect_error(w.to_bytes(), errc::corrupt, "metadata key 'flag': bool value 2");
  writer w2;
  bytes_t payload(12 + 2);
  std::uint32_t elem = static_cast<std::uint32_t>(value_type::boolean);
  std::uint64_t count = 2;
  std::memcpy(payload.data(), &elem, 4);
  std::memcpy(payload.data() + 4, &count, 8);
  payload[13] = std::byte{7};
  w2.add_raw("flags", static_cast<std::uint32_t>(value_type::array), payload);
  expect_error(w2.to_bytes(), errc::corrupt, "bool array element 1");
}

TEST(gguf_malformed, alignment_not_a_power_of_two) {
  for (std::uint32_t a : {0u, 3u, 48u}) {
    writer w;
    w.add_u32("general.alignment", a);
    expect_error(w.to_bytes(), errc::corrupt, fmt::format("general.alignment {} is not a non-zero power of two", a));
  }
  writer w;
  w.add_u64("general.alignment", 1ULL << 40);
  expect_error(w.to_bytes(), errc::corrupt, "that fits uint32");
  writer ws;
  ws.add_string("general.alignment", "32");
  expect_error(ws.to_bytes(), errc::corrupt, "general.alignment has type string");
}

TEST(gguf_malformed, large_alignment_data_section_past_end) {
  auto base = make_base_file(4096);
  ASSERT_TRUE(parse(base.bytes).ok());
  bytes_t cut(base.bytes.begin(), base.bytes.begin() + static_cast<std::ptrdiff_t>(base.layout.data_start - 1));
  expect_error(cut, errc::corrupt, "tensor data section starts at offset 4096");
}

}  // namespace
}  // namespace pagoda::gguf
