// Reference logits from llama.cpp for Pagoda's oracle tests (not part of
// Pagoda's build: it links llama.cpp's libllama; tests/data/oracle/README.md
// says how it was built and run).
//
//   llama_logits MODEL.gguf PROMPT_IDS N_GREEDY OUT NAME FAMILY
//
// PROMPT_IDS is a text file of whitespace-separated token ids. The prompt goes
// in one llama_decode with logits for every token (rows 0..n-1); then
// N_GREEDY tokens, each the argmax of the previous row (lowest id on ties),
// are decoded one at a time (rows n..n+N_GREEDY-1). Writes OUT.logits.f32
// (rows x n_vocab float32, little-endian, row-major) and OUT.json in the
// oracle's format (name, family, arch, tokens, greedy ids and their top-1
// minus top-2 margins, the file's tensor type counts). Settings: 1 thread, F32 K/V cache, flash attention off,
// full-size sliding-window cache (the mask does the windowing), no weight
// repacking, n_ctx = n_batch = n_ubatch = 256.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include <map>
#include <string>

#include "gguf.h"
#include "llama.h"

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "llama_logits: %s\n", what);
  return 1;
}

// Decodes tokens at positions pos0.. with logits for every one of them.
bool decode(llama_context* ctx, const std::vector<llama_token>& tokens, int pos0) {
  llama_batch b = llama_batch_init(static_cast<int32_t>(tokens.size()), 0, 1);
  b.n_tokens = static_cast<int32_t>(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    b.token[i] = tokens[i];
    b.pos[i] = pos0 + static_cast<llama_pos>(i);
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = 1;
  }
  const bool ok = llama_decode(ctx, b) == 0;
  llama_batch_free(b);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) return fail("usage: llama_logits MODEL.gguf PROMPT_IDS N_GREEDY OUT NAME FAMILY");
  std::vector<llama_token> prompt;
  {
    std::ifstream in(argv[2]);
    for (long id; in >> id;) prompt.push_back(static_cast<llama_token>(id));
  }
  const int n_greedy = std::atoi(argv[3]);
  const std::string out = argv[4];
  if (prompt.empty() || n_greedy < 0) return fail("empty prompt or negative N_GREEDY");

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  mp.use_extra_bufts = false;
  mp.check_tensors = true;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail("cannot load the model");
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = cp.n_batch = cp.n_ubatch = 256;
  cp.n_threads = cp.n_threads_batch = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  cp.swa_full = true;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("cannot create a context");
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  std::vector<float> rows, margins;
  auto take = [&](int i) {
    const float* l = llama_get_logits_ith(ctx, i);
    rows.insert(rows.end(), l, l + n_vocab);
    int best = 0;
    for (int t = 1; t < n_vocab; ++t)
      if (l[t] > l[best]) best = t;
    float second = -INFINITY;
    for (int t = 0; t < n_vocab; ++t)
      if (t != best && l[t] > second) second = l[t];
    margins.push_back(l[best] - second);
    return best;
  };
  if (!decode(ctx, prompt, 0)) return fail("decoding the prompt failed");
  int next = 0;
  for (std::size_t i = 0; i < prompt.size(); ++i) next = take(static_cast<int>(i));
  std::vector<llama_token> greedy;
  std::vector<float> greedy_margins;
  for (int k = 0; k < n_greedy; ++k) {
    greedy_margins.push_back(margins[prompt.size() - 1 + k]);
    greedy.push_back(next);
    if (!decode(ctx, {next}, static_cast<int>(prompt.size()) + k)) return fail("decoding a greedy token failed");
    next = take(0);
  }

  std::FILE* f = std::fopen((out + ".logits.f32").c_str(), "wb");
  if (!f || std::fwrite(rows.data(), sizeof(float), rows.size(), f) != rows.size()) return fail("cannot write logits");
  std::fclose(f);
  f = std::fopen((out + ".json").c_str(), "w");
  if (!f) return fail("cannot write the json");
  // The file's architecture and tensor types, as ggml names them.
  std::string arch;
  std::map<std::string, int> type_counts;
  {
    gguf_init_params gp = {true, nullptr};
    gguf_context* g = gguf_init_from_file(argv[1], gp);
    if (!g) return fail("cannot read the gguf");
    arch = gguf_get_val_str(g, gguf_find_key(g, "general.architecture"));
    for (int64_t t = 0; t < gguf_get_n_tensors(g); ++t) {
      std::string name = ggml_type_name(gguf_get_tensor_type(g, t));
      for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      ++type_counts[name];
    }
    gguf_free(g);
  }
  std::string model_file = argv[1];
  model_file = model_file.substr(model_file.find_last_of('/') + 1);
  std::fprintf(f, "{\n  \"name\": \"%s\",\n  \"family\": \"%s\",\n  \"arch\": \"%s\",\n  \"gguf\": \"gguf/%s\",\n",
               argv[5], argv[6], arch.c_str(), model_file.c_str());
  std::fprintf(f, "  \"n_vocab\": %d,\n  \"n_prompt\": %zu,\n  \"tokens\": [", n_vocab, prompt.size());
  for (std::size_t i = 0; i < prompt.size() + greedy.size(); ++i)
    std::fprintf(f, "%s%d", i ? ", " : "", i < prompt.size() ? prompt[i] : greedy[i - prompt.size()]);
  std::fprintf(f, "],\n  \"greedy\": [");
  for (std::size_t i = 0; i < greedy.size(); ++i) std::fprintf(f, "%s%d", i ? ", " : "", greedy[i]);
  std::fprintf(f, "],\n  \"greedy_margins\": [");
  for (std::size_t i = 0; i < greedy_margins.size(); ++i) std::fprintf(f, "%s%.9g", i ? ", " : "", greedy_margins[i]);
  std::fprintf(f, "],\n  \"type_counts\": {");
  bool first = true;
  for (const auto& [type, n] : type_counts) {
    std::fprintf(f, "%s\"%s\": %d", first ? "" : ", ", type.c_str(), n);
    first = false;
  }
  std::fprintf(f, "},\n  \"run\": {\"threads\": 1, \"kv_type\": \"f32\", \"flash_attn\": false, \"swa_full\": true, "
                  "\"use_extra_bufts\": false, \"n_ctx\": 256}\n}\n");
  std::fclose(f);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
