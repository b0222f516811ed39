// Fuzz target for the image decoders (src/vision/image_decode.h): bytes from a
// request are decoded as PNG or JPEG under small limits, and read as an
// image_url string. A decode must fail with a message or give an image whose
// size agrees with its pixels and the limits; anything else aborts.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fuzz_check.h"
#include "vision/image_decode.h"

using namespace pagoda;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  vision::image_limits limits;
  limits.max_pixels = 1 << 20;  // a fuzzer's input must not allocate gigabytes
  limits.max_side = 4096;
  auto r = vision::decode_image(std::span<const std::uint8_t>(data, size), limits);
  if (r.ok()) {
    FUZZ_CHECK(r->nx > 0 && r->ny > 0 && r->nx <= limits.max_side && r->ny <= limits.max_side);
    FUZZ_CHECK(static_cast<std::int64_t>(r->nx) * r->ny <= limits.max_pixels);
    FUZZ_CHECK(r->rgb.size() == static_cast<std::size_t>(r->nx) * static_cast<std::size_t>(r->ny) * 3);
  } else {
    FUZZ_CHECK(r.error().code() != errc::ok && !r.error().message().empty());
  }
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto u = vision::image_url_bytes(text, limits);
  if (u.ok()) FUZZ_CHECK(vision::sniff_image_format(*u) != vision::image_format::unknown);
  else FUZZ_CHECK(!u.error().message().empty());
  return 0;
}
