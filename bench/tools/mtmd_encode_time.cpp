// llama.cpp's side of bench/micro/vision_bench.cpp: the time libmtmd takes to
// encode an image's chunks with the same mmproj file. Not part of Pagoda's
// build: it links llama.cpp's libllama and libmtmd (built from source for
// this CPU, -DGGML_NATIVE=ON; bench/history/2026.md gives the commands).
//
//   mtmd_encode_time TEXT.gguf MMPROJ.gguf IMAGE.ppm THREADS FLASH(on|off) ROUNDS [CHUNKS]
//
// The image goes through mtmd's own preprocessing and tokenization (the prompt
// is the media marker alone); each round encodes every image chunk (the first
// CHUNKS of them if given) with mtmd_encode_chunk, after one untimed round
// (mtmd's own warm-up at load is left off; both sides are measured warm).
// Prints one line per round: the chunks, the first chunk's time and all of
// them, in milliseconds.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "llama.h"
#include "mtmd.h"

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "mtmd_encode_time: %s\n", what);
  return 1;
}

bool read_ppm(const char* path, int& nx, int& ny, std::vector<unsigned char>& rgb) {
  std::ifstream in(path, std::ios::binary);
  std::string magic;
  int maxval = 0;
  if (!(in >> magic >> nx >> ny >> maxval) || magic != "P6" || maxval != 255 || nx <= 0 || ny <= 0) return false;
  in.get();
  rgb.resize(static_cast<std::size_t>(nx) * static_cast<std::size_t>(ny) * 3);
  return static_cast<bool>(in.read(reinterpret_cast<char*>(rgb.data()), static_cast<std::streamsize>(rgb.size())));
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) return fail("usage: mtmd_encode_time TEXT.gguf MMPROJ.gguf IMAGE.ppm THREADS on|off ROUNDS [CHUNKS]");
  int nx = 0, ny = 0;
  std::vector<unsigned char> rgb;
  if (!read_ppm(argv[3], nx, ny, rgb)) return fail("cannot read the PPM image (P6, maxval 255)");
  const int threads = std::atoi(argv[4]);
  const bool flash = std::strcmp(argv[5], "on") == 0;
  const int rounds = std::atoi(argv[6]);

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail("cannot load the text model");
  mtmd_context_params vp = mtmd_context_params_default();
  vp.use_gpu = false;
  vp.print_timings = false;
  vp.n_threads = threads;
  vp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  vp.warmup = false;
  mtmd_context* vctx = mtmd_init_from_file(argv[2], model, vp);
  if (!vctx) return fail("cannot load the mmproj");

  mtmd_bitmap* bmp = mtmd_bitmap_init(static_cast<uint32_t>(nx), static_cast<uint32_t>(ny), rgb.data());
  mtmd_input_chunks* chunks = mtmd_input_chunks_init();
  const char* marker = mtmd_default_marker();
  mtmd_input_text text{marker, std::strlen(marker), false, true};
  const mtmd_bitmap* bitmaps[] = {bmp};
  if (mtmd_tokenize(vctx, chunks, &text, bitmaps, 1) != 0) return fail("mtmd_tokenize failed");
  std::vector<const mtmd_input_chunk*> images;
  for (std::size_t i = 0; i < mtmd_input_chunks_size(chunks); ++i) {
    const mtmd_input_chunk* c = mtmd_input_chunks_get(chunks, i);
    if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE) images.push_back(c);
  }
  if (argc == 8 && std::atoi(argv[7]) > 0 && static_cast<std::size_t>(std::atoi(argv[7])) < images.size())
    images.resize(static_cast<std::size_t>(std::atoi(argv[7])));
  for (int r = -1; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    double first = 0;
    for (std::size_t i = 0; i < images.size(); ++i) {
      if (mtmd_encode_chunk(vctx, images[i]) != 0) return fail("mtmd_encode_chunk failed");
      if (i == 0) first = ms_since(t0);
    }
    const double total = ms_since(t0);
    if (r >= 0) std::printf("round %d: %zu chunks, first %.1f ms, all %.1f ms\n", r, images.size(), first, total);
  }
  mtmd_input_chunks_free(chunks);
  mtmd_bitmap_free(bmp);
  mtmd_free(vctx);
  llama_model_free(model);
  return 0;
}
