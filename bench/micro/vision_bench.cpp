// Vision encoder time per image (issue 37). SmolVLM-256M's vision tower
// (SigLIP base: 512x512 input, patch 16, 12 blocks of width 768, 12 heads,
// FFN 3072, pixel-shuffle x4 to 64 tokens per chunk, longest edge 2048) with
// random weights written by vision/mmproj_synth.h, so no download is needed.
//
// The projection width is 256, not SmolLM2-135M's 576: the file then pairs
// with `pagoda synth --preset tiny256` for llama.cpp's side of the comparison
// (mtmd checks the text model's width). The projector is 64 tokens x 12288 x
// 256 multiply-adds per chunk, under 0.5% of the tower's; the tower is the
// real one's shape.
//
// Gemma 3's (SigLIP so400m: 896x896, patch 14, 27 blocks of width 1,152, 16
// heads, FFN 4,304, a 4x4 average pool to 256 tokens; f16 as its converter
// writes it) is bm_encode_chunk/gemma3_f16: an image is one chunk.
//
//   bm_encode_chunk/<type>  one 512x512 chunk through the tower and the projector
//   bm_image/<type>/nx/ny   an nx x ny PNG from its bytes: decode,
//                           preprocess (idefics3 resizes to the longest edge
//                           2048, so a square image is 4x4 slices and the
//                           overview, 17 chunks; a 2:1 one 4x2 and the
//                           overview, 9), every chunk encoded: what a request pays
//
// PAGODA_VISION_BENCH_DIR (default /tmp) keeps the written files between runs:
// mmproj-<tower>-<type>.gguf, and image-<nx>x<ny>.ppm for llama.cpp's tool
// (bench/tools/mtmd_encode_time.cpp). Threads: every hardware thread.
#include <benchmark/benchmark.h>

#include <png.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "vision/image_preprocess.h"
#include "vision/image_prompt.h"
#include "vision/mmproj.h"
#include "vision/mmproj_synth.h"
#include "vision/vision_encoder.h"

namespace {

using namespace pagoda;

constexpr int k_projection = 256;

std::string bench_dir() {
  const char* env = std::getenv("PAGODA_VISION_BENCH_DIR");
  return env != nullptr ? env : "/tmp";
}

std::string repo_root() {
  if (const char* env = std::getenv("PAGODA_SOURCE_DIR")) return env;
  const std::string file = __FILE__;  // <root>/bench/micro/vision_bench.cpp
  const auto pos = file.rfind("/bench/micro/");
  return pos == std::string::npos ? "." : file.substr(0, pos);
}

thread_pool& pool() {
  static thread_pool p(0);
  return p;
}

gguf::tensor_type type_of(const std::string& name) {
  return name == "f16" ? gguf::tensor_type::f16 : name == "q8_0" ? gguf::tensor_type::q8_0 : gguf::tensor_type::f32;
}

// A real model's tower with random weights: "smolvlm256m" (idefics3) or
// "gemma3" (Gemma 3's SigLIP so400m at 896/14 with the 4x4 average pool),
// in `type`, written once and kept open.
const vision::mmproj* tower(const std::string& name, const std::string& type) {
  static std::map<std::string, std::unique_ptr<vision::mmproj>> cache;
  auto& slot = cache[name + "-" + type];
  if (slot) return slot.get();
  const std::string path = bench_dir() + "/mmproj-" + name + "-" + type + ".gguf";
  if (!std::filesystem::exists(path)) {
    vision::mmproj_synth_options o =
        name == "gemma3"
            ? vision::mmproj_synth_options{.projector = vision::projector_kind::gemma3, .projection_dim = k_projection,
                                           .image_size = 896, .patch_size = 14, .n_embd = 1152, .n_head = 16,
                                           .n_ff = 4304, .n_layer = 27, .scale_factor = 4, .longest_edge = 896}
            : vision::mmproj_synth_options{.projection_dim = k_projection, .image_size = 512, .patch_size = 16,
                                           .n_embd = 768, .n_head = 12, .n_ff = 3072, .n_layer = 12,
                                           .scale_factor = 4, .longest_edge = 2048};
    o.weight_type = type_of(type);
    if (!vision::write_synth_mmproj(o, path).ok()) return nullptr;
  }
  auto m = vision::mmproj::open(path);
  if (!m.ok()) return nullptr;
  slot = std::move(*m);
  return slot.get();
}

// A colour gradient with some texture (the content does not change the work).
std::vector<std::uint8_t> test_rgb(int nx, int ny) {
  std::vector<std::uint8_t> rgb(static_cast<std::size_t>(nx) * ny * 3);
  for (int y = 0; y < ny; ++y)
    for (int x = 0; x < nx; ++x) {
      std::uint8_t* p = &rgb[(static_cast<std::size_t>(y) * nx + x) * 3];
      p[0] = static_cast<std::uint8_t>(x * 255 / nx);
      p[1] = static_cast<std::uint8_t>(y * 255 / ny);
      p[2] = static_cast<std::uint8_t>((x * 7 + y * 13) & 255);
    }
  return rgb;
}

std::vector<std::uint8_t> test_png(int nx, int ny) {
  const std::vector<std::uint8_t> rgb = test_rgb(nx, ny);
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(nx);
  img.height = static_cast<png_uint_32>(ny);
  img.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, rgb.data(), 0, nullptr)) return {};
  std::vector<std::uint8_t> out(size);
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, rgb.data(), 0, nullptr)) return {};
  out.resize(size);
  // The same pixels as a PPM for llama.cpp's tool.
  const std::string ppm = bench_dir() + "/image-" + std::to_string(nx) + "x" + std::to_string(ny) + ".ppm";
  if (std::FILE* f = std::fopen(ppm.c_str(), "wb")) {
    std::fprintf(f, "P6\n%d %d\n255\n", nx, ny);
    std::fwrite(rgb.data(), 1, rgb.size(), f);
    std::fclose(f);
  }
  return out;
}

const tokenizer* vocab() {
  static std::unique_ptr<tokenizer> tok = [] {
    std::unique_ptr<tokenizer> t;
    auto file = gguf::file::open(repo_root() + "/models/stories260K.gguf");
    if (!file.ok()) return t;
    auto v = tokenizer::from_gguf(**file);
    if (v.ok()) t = std::move(*v);
    return t;
  }();
  return tok.get();
}

void bm_encode_chunk(benchmark::State& state, const char* name, const char* type) {
  const vision::mmproj* m = tower(name, type);
  if (m == nullptr) {
    state.SkipWithError("cannot write or load the mmproj");
    return;
  }
  const vision::vision_hparams& hp = m->hparams();
  vision::rgb_image image{hp.image_size, hp.image_size, test_rgb(hp.image_size, hp.image_size)};
  const vision::planar_image px = vision::normalize(image, hp.image_mean, hp.image_std);
  vision::vision_encoder enc(*m, pool());
  std::vector<float> out(static_cast<std::size_t>(enc.n_output_tokens(px.nx, px.ny)) * hp.projection_dim);
  // One untimed encode first (activations allocated, weights paged in), as
  // llama.cpp's side gets an untimed round.
  if (!enc.encode(px.data, px.nx, px.ny, out).ok()) {
    state.SkipWithError("encode failed");
    return;
  }
  for (auto _ : state) {
    if (!enc.encode(px.data, px.nx, px.ny, out).ok()) {
      state.SkipWithError("encode failed");
      return;
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens"] = static_cast<double>(enc.n_output_tokens(px.nx, px.ny));
  state.counters["threads"] = pool().size();
}

void bm_image(benchmark::State& state, const char* type) {
  const vision::mmproj* m = tower("smolvlm256m", type);
  const tokenizer* tok = vocab();
  const std::vector<std::uint8_t> png = test_png(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  if (m == nullptr || tok == nullptr || png.empty()) {
    state.SkipWithError("cannot load the mmproj or the vocabulary, or write the image");
    return;
  }
  std::size_t chunks = 0;
  int image_tokens = 0;
  for (auto _ : state) {
    auto part = vision::make_image_part(png, *m, *tok, k_projection, pool());
    if (!part.ok()) {
      state.SkipWithError(part.error().message().c_str());
      return;
    }
    chunks = part->spans.size();
    image_tokens = part->n_image_tokens();
    benchmark::DoNotOptimize(part->spans.data());
  }
  state.counters["chunks"] = static_cast<double>(chunks);
  state.counters["image_tokens"] = image_tokens;
  state.counters["threads"] = pool().size();
}

}  // namespace

BENCHMARK_CAPTURE(bm_encode_chunk, f32, "smolvlm256m", "f32")->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(bm_encode_chunk, f16, "smolvlm256m", "f16")->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(bm_encode_chunk, q8_0, "smolvlm256m", "q8_0")->Unit(benchmark::kMillisecond)->Iterations(3);
// One Gemma 3 image is one chunk of 4,096 patches through 27 blocks: minutes here.
BENCHMARK_CAPTURE(bm_encode_chunk, gemma3_f16, "gemma3", "f16")->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_CAPTURE(bm_image, f16, "f16")
    ->Args({512, 512})
    ->Args({1024, 512})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

BENCHMARK_MAIN();
