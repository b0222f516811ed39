// Reference image embeddings and logits from llama.cpp's libmtmd for Pagoda's
// vision tests (not part of Pagoda's build: it links llama.cpp's libllama and
// libmtmd; tests/data/oracle/README.md, "Vision", says how it was built and run).
//
//   mtmd_embd TEXT.gguf MMPROJ.gguf IMAGE.ppm PROMPT_IDS OUT [AFTER_IDS]
//
// IMAGE.ppm is a binary PPM (P6, maxval 255). The image goes through mtmd's
// own preprocessing and tokenization (the prompt is mtmd's media marker
// alone); every image chunk, in mtmd's order (for idefics3 the slices
// row-major, then the overview), is encoded by itself. Writes:
//   OUT.pixels.f32  each chunk's preprocessed image as the encoder saw it
//                   (the graph's "inp_raw" input, planar [3][ny][nx]), chunk after chunk
//   OUT.embd.f32    each chunk's embeddings, [n_tokens][n_embd] chunk after chunk
//   OUT.logits.f32  the text model's logits at every position of the first
//                   image chunk, decoded (as embeddings) after the prompt ids
//                   of PROMPT_IDS (whitespace-separated), [n_tokens][n_vocab];
//                   then, with AFTER_IDS, at each of those ids decoded after
//                   the image, [n_after][n_vocab]. The image is decoded
//                   non-causally where mtmd says so (mtmd_decode_use_non_causal:
//                   Gemma 3), as mtmd_helper_decode_image_chunk does.
//   OUT.json        sizes: the chunks' nx, ny and n_tokens, n_embd, n_vocab,
//                   prompt, the ids after, whether the image was decoded
//                   non-causally, and mtmd's tokenization of the marker alone
//                   (text chunks' ids, "image:N" for an image chunk of N tokens)
// All float32, little-endian, row-major. Settings: 1 thread, CPU only, flash
// attention off (in the encoder and in the text model), F32 K/V cache, no warm-up.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "mtmd.h"

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "mtmd_embd: %s\n", what);
  return 1;
}

// The encoder's preprocessed input of each graph run, captured through the
// scheduler's eval callback: the first node reading "inp_raw" in each encode.
struct pixel_capture {
  std::vector<std::vector<float>> images;
  std::vector<int> nx, ny;
  bool armed = false;  // set before each encode
};

const ggml_tensor* inp_raw_source(const ggml_tensor* t) {
  for (const ggml_tensor* s : t->src) {
    if (s != nullptr && std::string(ggml_get_name(s)) == "inp_raw") return s;
  }
  return nullptr;
}

bool capture_pixels(ggml_tensor* t, bool ask, void* user) {
  const ggml_tensor* src = inp_raw_source(t);
  if (ask) return src != nullptr;
  auto* cap = static_cast<pixel_capture*>(user);
  if (src == nullptr || !cap->armed) return true;
  cap->armed = false;  // one capture per encode: later readers see the same input
  std::vector<float> px(static_cast<std::size_t>(ggml_nelements(src)));
  ggml_backend_tensor_get(src, px.data(), 0, px.size() * sizeof(float));
  cap->images.push_back(std::move(px));
  cap->nx.push_back(static_cast<int>(src->ne[0]));
  cap->ny.push_back(static_cast<int>(src->ne[1]));
  return true;
}

bool read_ppm(const char* path, int& nx, int& ny, std::vector<unsigned char>& rgb) {
  std::ifstream in(path, std::ios::binary);
  std::string magic;
  int maxval = 0;
  if (!(in >> magic >> nx >> ny >> maxval) || magic != "P6" || maxval != 255 || nx <= 0 || ny <= 0) return false;
  in.get();  // the single whitespace byte after maxval
  rgb.resize(static_cast<std::size_t>(nx) * ny * 3);
  return static_cast<bool>(in.read(reinterpret_cast<char*>(rgb.data()), static_cast<std::streamsize>(rgb.size())));
}

bool write_f32(const std::string& path, const std::vector<float>& v) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(v.data(), sizeof(float), v.size(), f) == v.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) return fail("usage: mtmd_embd TEXT.gguf MMPROJ.gguf IMAGE.ppm PROMPT_IDS OUT [AFTER_IDS]");
  const std::string out = argv[5];
  auto read_ids = [](const char* path) {
    std::vector<llama_token> ids;
    std::ifstream in(path);
    for (long id; in >> id;) ids.push_back(static_cast<llama_token>(id));
    return ids;
  };
  const std::vector<llama_token> prompt = read_ids(argv[4]);
  const std::vector<llama_token> after = argc == 7 ? read_ids(argv[6]) : std::vector<llama_token>{};
  int nx = 0, ny = 0;
  std::vector<unsigned char> rgb;
  if (!read_ppm(argv[3], nx, ny, rgb)) return fail("cannot read the PPM image (P6, maxval 255)");

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  mp.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail("cannot load the text model");

  pixel_capture cap;
  mtmd_context_params vp = mtmd_context_params_default();
  vp.use_gpu = false;
  vp.print_timings = false;
  vp.n_threads = 1;
  vp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  vp.warmup = false;
  vp.cb_eval = capture_pixels;
  vp.cb_eval_user_data = &cap;
  mtmd_context* vctx = mtmd_init_from_file(argv[2], model, vp);
  if (!vctx) return fail("cannot load the mmproj");

  mtmd_bitmap* bmp = mtmd_bitmap_init(static_cast<uint32_t>(nx), static_cast<uint32_t>(ny), rgb.data());
  mtmd_input_chunks* chunks = mtmd_input_chunks_init();
  const char* marker = mtmd_default_marker();
  mtmd_input_text text{marker, std::strlen(marker), false, true};
  const mtmd_bitmap* bitmaps[] = {bmp};
  if (mtmd_tokenize(vctx, chunks, &text, bitmaps, 1) != 0) return fail("mtmd_tokenize failed");

  // mtmd's tokenization of the marker alone: text chunks' ids, image chunks' sizes.
  std::string layout;
  for (std::size_t i = 0; i < mtmd_input_chunks_size(chunks); ++i) {
    const mtmd_input_chunk* c = mtmd_input_chunks_get(chunks, i);
    layout += i ? ", " : "";
    if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
      std::size_t n = 0;
      const llama_token* ids = mtmd_input_chunk_get_tokens_text(c, &n);
      layout += "[";
      for (std::size_t k = 0; k < n; ++k) layout += (k ? ", " : "") + std::to_string(ids[k]);
      layout += "]";
    } else {
      layout += "\"image:" + std::to_string(mtmd_input_chunk_get_n_tokens(c)) + "\"";
    }
  }

  const int n_embd = llama_model_n_embd_inp(model);
  std::vector<float> embd;
  bool non_causal = false;
  std::vector<int> chunk_tokens;
  std::vector<float> first_chunk;
  for (std::size_t i = 0; i < mtmd_input_chunks_size(chunks); ++i) {
    const mtmd_input_chunk* c = mtmd_input_chunks_get(chunks, i);
    if (mtmd_input_chunk_get_type(c) != MTMD_INPUT_CHUNK_TYPE_IMAGE) continue;
    cap.armed = true;
    if (mtmd_encode_chunk(vctx, c) != 0) return fail("mtmd_encode_chunk failed");
    const std::size_t n_tok = mtmd_input_chunk_get_n_tokens(c);
    const float* e = mtmd_get_output_embd(vctx);
    if (chunk_tokens.empty()) {
      first_chunk.assign(e, e + n_tok * n_embd);
      non_causal = mtmd_decode_use_non_causal(vctx, c);
    }
    embd.insert(embd.end(), e, e + n_tok * n_embd);
    chunk_tokens.push_back(static_cast<int>(n_tok));
  }
  if (chunk_tokens.empty()) return fail("no image chunk");
  if (cap.images.size() != chunk_tokens.size()) return fail("did not capture one input image per chunk");

  // The first chunk's embeddings after the prompt, logits at every image position.
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = cp.n_batch = cp.n_ubatch = 256;
  cp.n_threads = cp.n_threads_batch = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("cannot create a context");
  const int n_prompt = static_cast<int>(prompt.size());
  if (n_prompt > 0) {
    llama_batch b = llama_batch_init(n_prompt, 0, 1);
    b.n_tokens = n_prompt;
    for (int i = 0; i < n_prompt; ++i) {
      b.token[i] = prompt[i];
      b.pos[i] = i;
      b.n_seq_id[i] = 1;
      b.seq_id[i][0] = 0;
      b.logits[i] = 0;
    }
    if (llama_decode(ctx, b) != 0) return fail("prompt decode failed");
    llama_batch_free(b);
  }
  const int n_img = chunk_tokens[0];
  llama_batch b = llama_batch_init(n_img, n_embd, 1);
  b.n_tokens = n_img;
  std::copy(first_chunk.begin(), first_chunk.end(), b.embd);
  for (int i = 0; i < n_img; ++i) {
    b.pos[i] = n_prompt + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = 1;
  }
  if (non_causal) llama_set_causal_attn(ctx, false);
  if (llama_decode(ctx, b) != 0) return fail("image decode failed");
  if (non_causal) llama_set_causal_attn(ctx, true);
  llama_batch_free(b);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::vector<float> logits;
  for (int i = 0; i < n_img; ++i) {
    const float* row = llama_get_logits_ith(ctx, i);
    logits.insert(logits.end(), row, row + n_vocab);
  }
  if (!after.empty()) {
    const int n_after = static_cast<int>(after.size());
    llama_batch a = llama_batch_init(n_after, 0, 1);
    a.n_tokens = n_after;
    for (int i = 0; i < n_after; ++i) {
      a.token[i] = after[i];
      a.pos[i] = n_prompt + n_img + i;
      a.n_seq_id[i] = 1;
      a.seq_id[i][0] = 0;
      a.logits[i] = 1;
    }
    if (llama_decode(ctx, a) != 0) return fail("decode after the image failed");
    llama_batch_free(a);
    for (int i = 0; i < n_after; ++i) {
      const float* row = llama_get_logits_ith(ctx, i);
      logits.insert(logits.end(), row, row + n_vocab);
    }
  }

  std::vector<float> pixels;
  for (const auto& img : cap.images) pixels.insert(pixels.end(), img.begin(), img.end());
  if (!write_f32(out + ".pixels.f32", pixels) || !write_f32(out + ".embd.f32", embd) ||
      !write_f32(out + ".logits.f32", logits))
    return fail("cannot write the outputs");
  std::FILE* j = std::fopen((out + ".json").c_str(), "w");
  if (!j) return fail("cannot write the json");
  std::fprintf(j, "{\n  \"image\": [%d, %d],\n  \"n_embd\": %d,\n  \"n_vocab\": %d,\n  \"chunks\": [", nx, ny, n_embd,
               n_vocab);
  for (std::size_t i = 0; i < chunk_tokens.size(); ++i)
    std::fprintf(j, "%s{\"nx\": %d, \"ny\": %d, \"n_tokens\": %d}", i ? ", " : "", cap.nx[i], cap.ny[i],
                 chunk_tokens[i]);
  std::fprintf(j, "],\n  \"prompt\": [");
  for (int i = 0; i < n_prompt; ++i) std::fprintf(j, "%s%d", i ? ", " : "", prompt[i]);
  std::fprintf(j, "],\n  \"logits_rows\": %d", n_img);
  if (argc == 7) {
    std::fprintf(j, ",\n  \"after\": [");
    for (std::size_t i = 0; i < after.size(); ++i) std::fprintf(j, "%s%d", i ? ", " : "", after[i]);
    std::fprintf(j, "],\n  \"non_causal\": %s,\n  \"layout\": [%s]", non_causal ? "true" : "false", layout.c_str());
  }
  std::fprintf(j, "\n}\n");
  std::fclose(j);

  mtmd_input_chunks_free(chunks);
  mtmd_bitmap_free(bmp);
  llama_free(ctx);
  mtmd_free(vctx);
  llama_model_free(model);
  return 0;
}
