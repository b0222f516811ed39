// Pagoda as a library: continues several prompts at once through one engine,
// streaming each one's text as it comes. Only the public headers are used.
//
//   generate MODEL.gguf [PROMPT ...]
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "pagoda/engine.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [PROMPT ...]\n", argv[0]);
    return 2;
  }
  pagoda::engine_config config;
  config.model_path = argv[1];
  config.kv_cache_dtype = "int8";  // half the bytes of f16 per token
  config.max_num_seqs = 8;
  auto eng = pagoda::engine::create(config);
  if (!eng.ok()) {
    std::fprintf(stderr, "error: %s\n", eng.error().message().c_str());
    return 1;
  }
  std::vector<std::string> prompts(argv + 2, argv + argc);
  if (prompts.empty()) prompts = {"Once upon a time", "The little dog", "Lily and Ben"};

  for (std::size_t i = 0; i < prompts.size(); ++i) {
    pagoda::request r;
    r.id = std::to_string(i);
    r.prompt = (*eng)->tokenize(prompts[i]);
    r.max_tokens = 48;
    r.sampling = pagoda::sampling_params::greedy();
    if (pagoda::status st = (*eng)->add_request(std::move(r)); !st.ok()) {
      std::fprintf(stderr, "error: prompt %zu: %s\n", i, st.message().c_str());
      return 1;
    }
  }
  // Every step advances all prompts together; text arrives in pieces.
  std::map<std::string, std::string> text;
  std::vector<pagoda::engine_event> events;
  int n_steps = 0;
  while ((*eng)->has_work()) {
    events.clear();
    (*eng)->step(events);
    ++n_steps;
    for (const pagoda::engine_event& e : events) {
      text[e.request_id] += e.text;
      if (!e.error.empty()) std::fprintf(stderr, "error: %s\n", e.error.c_str());
    }
  }
  for (std::size_t i = 0; i < prompts.size(); ++i)
    std::printf("[%zu] %s%s\n", i, prompts[i].c_str(), text[std::to_string(i)].c_str());
  const pagoda::engine_info& info = (*eng)->info();
  std::fprintf(stderr, "%zu prompts in %d steps; KV %s, %.0f bytes/token, peak %d of %lld blocks\n", prompts.size(),
               n_steps, info.kv_layout.c_str(), info.kv_bytes_per_token, (*eng)->usage().n_blocks_used_peak,
               static_cast<long long>(info.kv_blocks));
  return 0;
}
