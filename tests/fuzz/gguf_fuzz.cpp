// libFuzzer target for the GGUF reader: parses arbitrary bytes with
// file::from_memory and, when they parse, exercises every getter on every key
// and touches every tensor's first and last byte. A parse must either fail
// with a message or produce a file whose invariants hold; anything else aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "fuzz_check.h"
#include "model/gguf.h"

namespace {

using namespace pagoda;
using namespace pagoda::gguf;

// Calls every getter; each must succeed or fail with a message, never crash.
void exercise_getters(const file& f, std::string_view key) {
  std::size_t sink = 0;
  auto check = [&](const auto& r) {
    if (r.ok()) {
      ++sink;
    } else {
      FUZZ_CHECK(!r.error().message().empty());
      FUZZ_CHECK(r.error().code() != errc::ok);
    }
  };
  check(f.get_uint(key));
  check(f.get_int(key));
  check(f.get_float(key));
  check(f.get_bool(key));
  check(f.get_string(key));
  auto strings = f.get_string_array(key);
  check(strings);
  if (strings.ok()) {
    for (std::string_view s : *strings) sink += s.empty() ? 0 : static_cast<unsigned char>(s.back());
  }
  auto floats = f.get_f32_array(key);
  check(floats);
  if (floats.ok()) {
    for (float x : *floats) sink += x > 0;
  }
  check(f.get_i32_array(key));
  if (sink == static_cast<std::size_t>(-1)) std::abort();  // keep the reads observable
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto r = file::from_memory(bytes);
  if (!r.ok()) {
    FUZZ_CHECK(r.error().code() != errc::ok);
    FUZZ_CHECK(!r.error().message().empty());
    return 0;
  }
  const file& f = **r;
  FUZZ_CHECK(f.version() == 2 || f.version() == 3);
  FUZZ_CHECK(f.alignment() != 0 && (f.alignment() & (f.alignment() - 1)) == 0);

  for (const auto& e : f.metadata()) {
    FUZZ_CHECK(f.find(e.key) == &e.val);
    if (e.val.type == value_type::array && e.val.array_type != value_type::string) {
      FUZZ_CHECK(e.val.array_size == 0 ||
                 (e.val.array_data >= bytes.data() &&
                  e.val.array_data + e.val.array_size * value_type_size(e.val.array_type) <= bytes.data() + size));
    }
    exercise_getters(f, e.key);
  }
  exercise_getters(f, "general.alignment");
  exercise_getters(f, "no.such.key");

  const std::byte* end = bytes.data() + size;
  for (const auto& t : f.tensors()) {
    FUZZ_CHECK(f.find_tensor(t.name) == &t);
    FUZZ_CHECK(t.n_dims >= 1 && t.n_dims <= 4);
    FUZZ_CHECK(t.n_elements() > 0);
    const auto* traits = get_tensor_type_traits(static_cast<std::uint32_t>(t.type));
    FUZZ_CHECK(traits != nullptr && traits->supported);
    auto expect = tensor_size_bytes(static_cast<std::uint32_t>(t.type), std::span<const std::int64_t>(t.ne, t.n_dims));
    FUZZ_CHECK(expect.has_value() && *expect == t.size_bytes);
    FUZZ_CHECK(t.offset % f.alignment() == 0);
    FUZZ_CHECK(t.data >= bytes.data() && t.size_bytes <= static_cast<std::uint64_t>(end - t.data));
    // Touch the first and last byte: out of bounds here is a sanitizer report.
    volatile std::byte first = t.data[0];
    volatile std::byte last = t.data[t.size_bytes - 1];
    (void)first;
    (void)last;
  }
  return 0;
}
