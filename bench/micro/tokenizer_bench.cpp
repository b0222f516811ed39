// Tokenizer throughput on tests/data/tinystories_dev.txt (412 KB): encode and
// decode with the bundled stories260K (SentencePiece, 512 tokens) and the three
// shared test vocabularies (phi-3 SentencePiece; StarCoder and DeepSeek-Coder
// byte-level BPE). Counter: bytes/s of text. Paths are found from this file's
// location (or PAGODA_SOURCE_DIR), so run it from a build of this checkout:
//
//   build-tok/bench/tokenizer_bench
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "model/gguf.h"
#include "model/tokenizer.h"

namespace {

// PAGODA_SOURCE_DIR if set, else the checkout this file was compiled from, else ".".
std::string repo_root() {
  if (const char* env = std::getenv("PAGODA_SOURCE_DIR")) return env;
  const std::string file = __FILE__;  // <root>/bench/micro/tokenizer_bench.cpp
  const auto pos = file.rfind("/bench/micro/");
  return pos == std::string::npos ? "." : file.substr(0, pos);
}

const std::string& dev_text() {
  static const std::string text = [] {
    std::ifstream in(repo_root() + "/tests/data/tinystories_dev.txt", std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }();
  return text;
}

const pagoda::tokenizer* load(const std::string& relative) {
  static std::map<std::string, std::unique_ptr<pagoda::tokenizer>> cache;
  auto& slot = cache[relative];
  if (!slot) {
    auto file = pagoda::gguf::file::open(repo_root() + "/" + relative);
    if (!file.ok()) return nullptr;
    auto tok = pagoda::tokenizer::from_gguf(**file);
    if (!tok.ok()) return nullptr;
    slot = std::move(*tok);
  }
  return slot.get();
}

void bm_encode(benchmark::State& state, const char* vocab) {
  const pagoda::tokenizer* tok = load(vocab);
  if (tok == nullptr || dev_text().empty()) {
    state.SkipWithError("cannot load the vocabulary or the dev text");
    return;
  }
  std::size_t n_tokens = 0;
  for (auto _ : state) {
    auto ids = tok->encode(dev_text(), true);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * dev_text().size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
}

void bm_decode(benchmark::State& state, const char* vocab) {
  const pagoda::tokenizer* tok = load(vocab);
  if (tok == nullptr || dev_text().empty()) {
    state.SkipWithError("cannot load the vocabulary or the dev text");
    return;
  }
  const auto ids = tok->encode(dev_text(), true);
  for (auto _ : state) {
    auto text = tok->decode(ids);
    benchmark::DoNotOptimize(text.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * dev_text().size()));
}

BENCHMARK_CAPTURE(bm_encode, stories260K, "models/stories260K.gguf")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, phi3, "tests/data/tokenizer/ggml-vocab-phi-3.gguf")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, starcoder, "tests/data/tokenizer/ggml-vocab-starcoder.gguf")
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, deepseek_coder, "tests/data/tokenizer/ggml-vocab-deepseek-coder.gguf")
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_decode, stories260K, "models/stories260K.gguf")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_decode, starcoder, "tests/data/tokenizer/ggml-vocab-starcoder.gguf")
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
