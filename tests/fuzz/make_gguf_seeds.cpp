// Writes the GGUF fuzz seed corpus (tests/fuzz/corpus/gguf) with the writer:
// small files that between them hold every metadata value type, every array
// element type, string arrays, every supported tensor type, both versions,
// a non-default alignment and a vocabulary-only file. Regenerate with
//   build/tests/fuzz/make_gguf_seeds tests/fuzz/corpus/gguf
#include <cstdio>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"

using namespace pagoda;
using namespace pagoda::gguf;

namespace {

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> d(n);
  for (auto& b : d) b = static_cast<std::byte>((seed = seed * 1664525u + 1013904223u) >> 24);
  return d;
}

void add_tensor(writer& w, const char* name, tensor_type type, std::vector<std::int64_t> ne, std::uint32_t seed) {
  auto size = tensor_size_bytes(static_cast<std::uint32_t>(type), ne);
  w.add_tensor(name, type, ne, pattern(*size, seed));
}

bool save(const writer& w, const std::string& dir, const char* name) {
  status st = w.write_file(dir + "/" + name);
  if (!st.ok()) std::fprintf(stderr, "%s: %s\n", name, st.message().c_str());
  return st.ok();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_gguf_seeds OUT_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  bool ok = true;
  {
    writer w;
    w.add_u8("v.u8", 200);
    w.add_i8("v.i8", -100);
    w.add_u16("v.u16", 60000);
    w.add_i16("v.i16", -30000);
    w.add_u32("v.u32", 3000000000u);
    w.add_i32("v.i32", -2000000000);
    w.add_u64("v.u64", 1ull << 60);
    w.add_i64("v.i64", -(1ll << 60));
    w.add_f32("v.f32", 0.25f);
    w.add_f64("v.f64", 1e-300);
    w.add_bool("v.bool", true);
    w.add_string("v.string", "h\xc3\xa9llo");
    const std::uint8_t a_u8[] = {1, 2, 255};
    const std::int8_t a_i8[] = {-1, 2};
    const std::uint16_t a_u16[] = {65535};
    const std::int16_t a_i16[] = {-3, 4};
    const std::uint32_t a_u32[] = {7, 3000000000u};
    const std::int32_t a_i32[] = {-7, 70000};
    const std::uint64_t a_u64[] = {1ull << 40};
    const std::int64_t a_i64[] = {-(1ll << 40), 3};
    const float a_f32[] = {1.5f, -2.5f};
    const double a_f64[] = {0.125};
    const bool a_bool[] = {true, false};
    w.add_array("a.u8", std::span<const std::uint8_t>(a_u8));
    w.add_array("a.i8", std::span<const std::int8_t>(a_i8));
    w.add_array("a.u16", std::span<const std::uint16_t>(a_u16));
    w.add_array("a.i16", std::span<const std::int16_t>(a_i16));
    w.add_array("a.u32", std::span<const std::uint32_t>(a_u32));
    w.add_array("a.i32", std::span<const std::int32_t>(a_i32));
    w.add_array("a.u64", std::span<const std::uint64_t>(a_u64));
    w.add_array("a.i64", std::span<const std::int64_t>(a_i64));
    w.add_array("a.f32", std::span<const float>(a_f32));
    w.add_array("a.f64", std::span<const double>(a_f64));
    w.add_array("a.bool", std::span<const bool>(a_bool));
    const std::vector<std::string> strs = {"", "x", "\xe2\x96\x81the"};
    w.add_string_array("a.string", std::span<const std::string>(strs));
    ok &= save(w, dir, "all_values.gguf");
  }
  {
    writer w;
    w.add_string("general.architecture", "llama");
    w.add_u32("llama.embedding_length", 64);
    add_tensor(w, "t.f32", tensor_type::f32, {4, 2}, 1);
    add_tensor(w, "t.f16", tensor_type::f16, {8, 2}, 2);
    add_tensor(w, "t.bf16", tensor_type::bf16, {2, 2, 2}, 3);
    add_tensor(w, "t.q8_0", tensor_type::q8_0, {32, 2}, 4);
    add_tensor(w, "t.q4_0", tensor_type::q4_0, {64, 1, 1, 2}, 5);
    ok &= save(w, dir, "tensors.gguf");
  }
  {
    writer w(2);
    w.add_string("tokenizer.ggml.model", "llama");
    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<float> scores = {0, 0, 0};
    std::vector<std::int32_t> types = {2, 3, 3};
    for (int k = 0; k < 8; ++k) {
      tokens.push_back(fmt::format("<0x{:02X}>", k));
      scores.push_back(0);
      types.push_back(6);
    }
    for (const char* p : {"\xe2\x96\x81" "a", "\xe2\x96\x81the", "b", "cd"}) {
      tokens.emplace_back(p);
      scores.push_back(-static_cast<float>(tokens.size()));
      types.push_back(1);
    }
    w.add_string_array("tokenizer.ggml.tokens", std::span<const std::string>(tokens));
    w.add_array("tokenizer.ggml.scores", std::span<const float>(scores));
    w.add_array("tokenizer.ggml.token_type", std::span<const std::int32_t>(types));
    w.add_u32("tokenizer.ggml.bos_token_id", 1);
    w.add_u32("tokenizer.ggml.eos_token_id", 2);
    ok &= save(w, dir, "vocab_v2.gguf");
  }
  {
    writer w;
    w.set_alignment(64);
    w.add_string("general.name", "aligned");
    add_tensor(w, "a", tensor_type::f32, {3}, 6);
    add_tensor(w, "b", tensor_type::q8_0, {32}, 7);
    ok &= save(w, dir, "align64.gguf");
  }
  return ok ? 0 : 1;
}
