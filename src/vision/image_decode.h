// Image files as requests carry them: PNG and JPEG, told apart by their first
// bytes and decoded to 8-bit RGB (rgb_image, image_preprocess.h) with
// libpng's simplified API and libjpeg-turbo's TurboJPEG. An OpenAI
// `image_url` is taken only as a `data:` URL of base64 bytes; Pagoda fetches
// nothing from the network, so http(s) and every other scheme are refused.
//
// What a decoded image is, against llama.cpp's mtmd (stb_image, 3 channels):
//   - alpha is dropped, not composited (stb's RGBA -> RGB keeps R, G, B);
//   - grey images are repeated into R, G and B; palettes are expanded;
//   - 16-bit PNG samples and gamma (gAMA, sRGB chunks) go through libpng's
//     conversion to 8-bit sRGB: a PNG without a gamma chunk decodes to the
//     same bytes as stb's, one with a gamma other than sRGB's may differ;
//   - JPEG's inverse DCT is libjpeg-turbo's (accurate integer), stb's is its
//     own: the same file may decode a level or two apart in places.
//
// Limits (image_limits) are checked before anything large is allocated: the
// encoded bytes, and the width, height and pixel count read from the header.
// Every malformed, truncated or unsupported input is an errc::invalid_argument
// naming what was wrong; errc::out_of_range for an image over a limit.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pagoda/status.h"
#include "vision/image_preprocess.h"

namespace pagoda::vision {

struct image_limits {
  std::int64_t max_bytes = 20 << 20;       // encoded file (after base64 decoding)
  std::int64_t max_pixels = 4096 * 4096;   // width x height
  int max_side = 8192;                     // width and height each
};

enum class image_format { unknown, png, jpeg, gif, webp, bmp };

const char* image_format_name(image_format f);

// By the file's first bytes ("magic numbers").
image_format sniff_image_format(std::span<const std::uint8_t> bytes);

// PNG or JPEG bytes to 8-bit RGB.
result<rgb_image> decode_image(std::span<const std::uint8_t> bytes, const image_limits& limits = {});

// The bytes of an OpenAI image_url: `data:image/png;base64,...` or
// `data:image/jpeg;base64,...` (image/jpg too; the media type must agree with
// the bytes). Anything else, remote URLs included, is an error naming the
// accepted form.
result<std::vector<std::uint8_t>> image_url_bytes(std::string_view url, const image_limits& limits = {});

}  // namespace pagoda::vision
