// What the record MAC (--kv-store-secret-file) adds to a stored KV block:
// encode_block_record and decode_block_record of one block, without and with
// a secret, at two block sizes: 64 KiB, and 2 MiB (16 tokens of Llama-3-8B:
// 32 layers x 8 KV heads x 128 x K and V x f16). The payload is random (KV
// bytes barely compress) and stored uncompressed, so the time is the
// checksum, the copies and, with a secret, the HMAC-SHA256. Reports; asserts
// nothing.
//   ./build/release/bench/record_mac_bench
#include <random>
#include <string>

#include <benchmark/benchmark.h>

#include "store/block_record.h"

namespace pagoda {
namespace {

block_record make_record(std::size_t n_bytes) {
  block_record r;
  r.tenant = "alice";
  r.chain = 42;
  r.parent = 41;
  r.key = make_store_key({1, 2}, r.tenant, r.chain);
  for (int i = 0; i < 16; ++i) r.tokens.push_back(i * 7);
  std::mt19937_64 rng(7);
  r.bytes.resize(n_bytes);
  for (auto& b : r.bytes) b = static_cast<std::byte>(rng());
  return r;
}

const record_secret& secret() {
  static const record_secret s(std::string(32, 'k'));
  return s;
}

// range(0): bytes of the block; range(1): 1 with a secret.
void bm_encode(benchmark::State& state) {
  const block_record r = make_record(static_cast<std::size_t>(state.range(0)));
  const record_secret* s = state.range(1) ? &secret() : nullptr;
  for (auto _ : state) benchmark::DoNotOptimize(encode_block_record(r, false, s));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void bm_decode(benchmark::State& state) {
  const block_record r = make_record(static_cast<std::size_t>(state.range(0)));
  const record_secret* s = state.range(1) ? &secret() : nullptr;
  const std::vector<std::byte> stored = encode_block_record(r, false, s);
  for (auto _ : state) {
    auto back = decode_block_record(stored, r.key, s);
    if (!back.ok()) state.SkipWithError(back.error().message().c_str());
    benchmark::DoNotOptimize(back);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

BENCHMARK(bm_encode)->ArgsProduct({{64 << 10, 2 << 20}, {0, 1}})->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_decode)->ArgsProduct({{64 << 10, 2 << 20}, {0, 1}})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace pagoda

BENCHMARK_MAIN();
