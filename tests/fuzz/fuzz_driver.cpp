// Standalone driver for libFuzzer targets, for compilers without libFuzzer.
// Runs every file given (or every file in each directory given) through
// LLVMFuzzerTestOneInput, then a deterministic set of mutations of each one:
// every truncation, single-bit flips, 32- and 64-bit fields overwritten with
// boundary values at every offset, and seeded random multi-byte edits. A bug
// shows as a crash, an abort from the target, or a sanitizer report.
//
// usage: fuzz_driver [--random N] PATH...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

using bytes_t = std::vector<std::uint8_t>;

std::size_t g_runs = 0;

void run(const bytes_t& b) {
  // Copy into an exact-size heap block so a sanitizer sees reads past the end.
  auto* p = static_cast<std::uint8_t*>(std::malloc(b.size() ? b.size() : 1));
  if (!b.empty()) std::memcpy(p, b.data(), b.size());
  LLVMFuzzerTestOneInput(p, b.size());
  std::free(p);
  ++g_runs;
}

template <typename T>
void overwrite_everywhere(const bytes_t& seed, std::initializer_list<T> values) {
  if (seed.size() < sizeof(T)) return;
  bytes_t b = seed;
  for (std::size_t pos = 0; pos + sizeof(T) <= seed.size(); ++pos) {
    for (T v : values) {
      std::memcpy(b.data() + pos, &v, sizeof(T));
      run(b);
    }
    std::memcpy(b.data() + pos, seed.data() + pos, sizeof(T));
  }
}

void mutate(const bytes_t& seed, std::size_t n_random, std::uint64_t rng) {
  run(seed);
  for (std::size_t n = 0; n < seed.size(); ++n) run(bytes_t(seed.begin(), seed.begin() + static_cast<std::ptrdiff_t>(n)));
  bytes_t b = seed;
  for (std::size_t pos = 0; pos < seed.size(); ++pos) {
    b[pos] ^= static_cast<std::uint8_t>(1u << (pos % 8));
    run(b);
    b[pos] = seed[pos];
  }
  const std::uint64_t size = seed.size();
  overwrite_everywhere<std::uint64_t>(seed, {0, 1, 0xffffffffffffffffull, 1ull << 63, 1ull << 32, size, size / 2});
  overwrite_everywhere<std::uint32_t>(seed, {0, 5, 12, 30, 99, 0xffffffffu});

  auto next = [&rng] {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  };
  for (std::size_t k = 0; k < n_random && !seed.empty(); ++k) {
    b = seed;
    std::size_t n_edits = 1 + next() % 4;
    for (std::size_t e = 0; e < n_edits; ++e) {
      std::size_t pos = next() % b.size();
      switch (next() % 4) {
        case 0: b[pos] = static_cast<std::uint8_t>(next()); break;
        case 1: b[pos] = 0xff; break;
        case 2: b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos)); break;
        default: b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos), static_cast<std::uint8_t>(next())); break;
      }
      if (b.empty()) break;
    }
    run(b);
  }
}

bool read_file(const std::filesystem::path& p, bytes_t& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n_random = 2000;
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--random" && i + 1 < argc) {
      n_random = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::filesystem::is_directory(a)) {
      for (const auto& e : std::filesystem::directory_iterator(a))
        if (e.is_regular_file()) inputs.push_back(e.path());
    } else {
      inputs.emplace_back(a);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "fuzz_driver: no inputs (usage: fuzz_driver [--random N] PATH...)\n");
    return 2;
  }
  std::uint64_t rng = 0x9e3779b97f4a7c15ull;
  for (const auto& p : inputs) {
    bytes_t seed;
    if (!read_file(p, seed)) {
      std::fprintf(stderr, "fuzz_driver: cannot read %s\n", p.c_str());
      return 2;
    }
    std::size_t before = g_runs;
    mutate(seed, n_random, rng += 0x632be59bd9b4e019ull);
    std::fprintf(stderr, "fuzz_driver: %s (%zu bytes): %zu inputs\n", p.filename().c_str(), seed.size(),
                 g_runs - before);
  }
  std::fprintf(stderr, "fuzz_driver: %zu inputs from %zu seeds, no failures\n", g_runs, inputs.size());
  return 0;
}
