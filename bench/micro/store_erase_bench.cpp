// What a tenant erase costs in the disk tier: it deletes the tenant's entries
// and rewrites the file with the live ones (so none of the tenant's bytes stay
// in it), against writing the same store in the first place. Reports; asserts
// nothing.
//   ./build/release/bench/store_erase_bench
// Arg: the store's size in MiB, half of it the erased tenant's (blocks of
// 64 KiB, incompressible, as f16 KV is nearly).
#include <unistd.h>

#include <filesystem>
#include <random>

#include <benchmark/benchmark.h>

#include "store/block_record.h"
#include "store/block_store.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t k_block_bytes = 64 << 10;

std::vector<std::vector<std::byte>> records(const std::string& tenant, std::int64_t n, std::vector<store_key>& keys) {
  std::mt19937_64 rng(n);
  std::vector<std::vector<std::byte>> out;
  for (std::int64_t i = 0; i < n; ++i) {
    block_record r;
    r.chain = static_cast<block_key>(i);
    r.key = make_store_key({1, 2}, tenant, r.chain);
    r.tenant = tenant;
    r.tokens.assign(16, static_cast<token_id>(i));
    r.bytes.resize(k_block_bytes);
    for (auto& b : r.bytes) b = static_cast<std::byte>(rng());
    keys.push_back(r.key);
    out.push_back(encode_block_record(r, false));
  }
  return out;
}

void write_all(block_store& s, const std::vector<store_key>& keys, const std::vector<std::vector<std::byte>>& values) {
  std::vector<store_entry> batch;
  for (std::size_t i = 0; i < keys.size(); ++i) batch.push_back({keys[i], values[i]});
  for (std::size_t i = 0; i < batch.size(); i += 64)
    (void)s.put_many(std::span(batch).subspan(i, std::min<std::size_t>(64, batch.size() - i)));
}

struct fixture {
  std::vector<store_key> keys;
  std::vector<std::vector<std::byte>> values;
  explicit fixture(std::int64_t mib) {
    const std::int64_t n = mib * (1 << 20) / static_cast<std::int64_t>(k_block_bytes) / 2;
    values = records("alice", n, keys);
    auto bob = records("bob", n, keys);
    for (auto& v : bob) values.push_back(std::move(v));
  }
};

std::string bench_dir() { return (fs::temp_directory_path() / ("pagoda_erase_bench_" + std::to_string(::getpid()))).string(); }

std::unique_ptr<block_store> fresh_store() {
  fs::remove_all(bench_dir());
  return *make_disk_store({bench_dir(), std::int64_t{4} << 30, 0});
}

// Writing the whole store (both tenants), in batches of 64 blocks as the writer thread does.
void bm_write_store(benchmark::State& state) {
  const fixture f(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    auto s = fresh_store();
    state.ResumeTiming();
    write_all(*s, f.keys, f.values);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * (1 << 20));
  fs::remove_all(bench_dir());
}

// Erasing one tenant (half the store): the deletes and the rewrite of the other half.
void bm_erase_tenant(benchmark::State& state) {
  const fixture f(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    auto s = fresh_store();
    write_all(*s, f.keys, f.values);
    state.ResumeTiming();
    benchmark::DoNotOptimize(s->erase_tenant(tenant_hash("alice")));
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * (1 << 20));
  fs::remove_all(bench_dir());
}

BENCHMARK(bm_write_store)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(bm_erase_tenant)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
}  // namespace pagoda

BENCHMARK_MAIN();
