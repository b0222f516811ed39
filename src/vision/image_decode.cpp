// Image decoding: PNG through libpng's simplified API, JPEG through
// TurboJPEG, data: URLs through OpenSSL's base64 (image_decode.h).
#include "vision/image_decode.h"

#include <openssl/evp.h>
#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include <fmt/format.h>

namespace pagoda::vision {

namespace {

constexpr std::uint8_t k_png_magic[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

bool starts_with(std::span<const std::uint8_t> b, std::span<const std::uint8_t> prefix) {
  return b.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), b.begin());
}

bool starts_with(std::span<const std::uint8_t> b, std::string_view prefix, std::size_t at = 0) {
  return b.size() >= at + prefix.size() && std::memcmp(b.data() + at, prefix.data(), prefix.size()) == 0;
}

// The header's size against the limits, before a pixel is allocated.
status check_size(std::int64_t nx, std::int64_t ny, const image_limits& limits, const char* what) {
  if (nx <= 0 || ny <= 0) return error(errc::invalid_argument, "{} image of {} x {} pixels", what, nx, ny);
  if (nx > limits.max_side || ny > limits.max_side || nx * ny > limits.max_pixels)
    return error(errc::out_of_range,
                 "{} image of {} x {} pixels is over the limit ({} pixels a side, {} pixels in all)", what, nx, ny,
                 limits.max_side, limits.max_pixels);
  return ok_status();
}

result<rgb_image> decode_png(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  png_image img;
  std::memset(&img, 0, sizeof img);
  img.version = PNG_IMAGE_VERSION;
  // png_image_free on every path, also when a read fails half way.
  const std::unique_ptr<png_image, void (*)(png_imagep)> guard(&img, png_image_free);
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size()))
    return error(errc::invalid_argument, "PNG image: {}", img.message);
  PAGODA_RETURN_IF_ERROR(check_size(img.width, img.height, limits, "PNG"));
  // RGBA, then alpha dropped (as stb_image's 3-channel load does); 8-bit
  // output with alpha is not premultiplied.
  img.format = PNG_FORMAT_RGBA;
  std::vector<std::uint8_t> rgba(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, rgba.data(), 0, nullptr))
    return error(errc::invalid_argument, "PNG image: {}", img.message);
  rgb_image out;
  out.nx = static_cast<int>(img.width);
  out.ny = static_cast<int>(img.height);
  const std::size_t n = static_cast<std::size_t>(out.nx) * static_cast<std::size_t>(out.ny);
  out.rgb.resize(n * 3);
  for (std::size_t i = 0; i < n; ++i) std::memcpy(&out.rgb[3 * i], &rgba[4 * i], 3);
  return out;
}

result<rgb_image> decode_jpeg(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  const std::unique_ptr<void, int (*)(tjhandle)> tj(tjInitDecompress(), tjDestroy);
  if (!tj) return error(errc::internal, "JPEG image: TurboJPEG could not start: {}", tjGetErrorStr2(nullptr));
  // TurboJPEG 2.x takes a non-const buffer it does not write.
  auto* buf = const_cast<unsigned char*>(bytes.data());
  const auto size = static_cast<unsigned long>(bytes.size());
  int nx = 0, ny = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj.get(), buf, size, &nx, &ny, &subsamp, &colorspace) != 0)
    return error(errc::invalid_argument, "JPEG image: {}", tjGetErrorStr2(tj.get()));
  PAGODA_RETURN_IF_ERROR(check_size(nx, ny, limits, "JPEG"));
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK)
    return error(errc::invalid_argument, "JPEG image: CMYK images are not supported (save it as RGB)");
  rgb_image out;
  out.nx = nx;
  out.ny = ny;
  out.rgb.resize(static_cast<std::size_t>(nx) * static_cast<std::size_t>(ny) * 3);
  // Warnings (a truncated or damaged stream, which would decode grey in
  // part) are errors; progressive scans are limited (a hostile file's
  // thousands of scans cost minutes).
  if (tjDecompress2(tj.get(), buf, size, out.rgb.data(), nx, 0, ny, TJPF_RGB,
                    TJFLAG_ACCURATEDCT | TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS) != 0)
    return error(errc::invalid_argument, "JPEG image: {}", tjGetErrorStr2(tj.get()));
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

constexpr const char* k_accepted = "send the image as a data: URL (data:image/png;base64,... or data:image/jpeg;base64,...)";

}  // namespace

const char* image_format_name(image_format f) {
  switch (f) {
    case image_format::png: return "PNG";
    case image_format::jpeg: return "JPEG";
    case image_format::gif: return "GIF";
    case image_format::webp: return "WebP";
    case image_format::bmp: return "BMP";
    default: return "unknown";
  }
}

image_format sniff_image_format(std::span<const std::uint8_t> b) {
  if (starts_with(b, std::span<const std::uint8_t>(k_png_magic))) return image_format::png;
  if (b.size() >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return image_format::jpeg;
  if (starts_with(b, "GIF87a") || starts_with(b, "GIF89a")) return image_format::gif;
  if (starts_with(b, "RIFF") && starts_with(b, "WEBP", 8)) return image_format::webp;
  if (starts_with(b, "BM")) return image_format::bmp;
  return image_format::unknown;
}

result<rgb_image> decode_image(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  if (bytes.empty()) return error(errc::invalid_argument, "image: no bytes");
  if (static_cast<std::int64_t>(bytes.size()) > limits.max_bytes)
    return error(errc::out_of_range, "image of {} bytes is over the limit of {} bytes", bytes.size(), limits.max_bytes);
  switch (const image_format f = sniff_image_format(bytes)) {
    case image_format::png: return decode_png(bytes, limits);
    case image_format::jpeg: return decode_jpeg(bytes, limits);
    case image_format::unknown:
      return error(errc::invalid_argument, "image: not a PNG or JPEG file (Pagoda decodes those two)");
    default:
      return error(errc::invalid_argument, "image: {} is not supported (Pagoda decodes PNG and JPEG)",
                   image_format_name(f));
  }
}

result<std::vector<std::uint8_t>> image_url_bytes(std::string_view url, const image_limits& limits) {
  const std::string scheme = lower(url.substr(0, url.find(':') == std::string_view::npos ? 0 : url.find(':') + 1));
  if (scheme != "data:") {
    if (scheme == "http:" || scheme == "https:")
      return error(errc::invalid_argument, "image_url: Pagoda does not fetch images from the network; {}", k_accepted);
    return error(errc::invalid_argument, "image_url: not a data: URL; {}", k_accepted);
  }
  const std::size_t comma = url.find(',');
  if (comma == std::string_view::npos) return error(errc::invalid_argument, "image_url: a data: URL without ','; {}", k_accepted);
  const std::string header = lower(url.substr(5, comma - 5));
  const std::string_view payload = url.substr(comma + 1);
  if (header.size() < 7 || header.compare(header.size() - 7, 7, ";base64") != 0)
    return error(errc::invalid_argument, "image_url: the data: URL is not base64; {}", k_accepted);
  const std::string media = header.substr(0, header.find(';'));
  image_format declared = image_format::unknown;
  if (media == "image/png") declared = image_format::png;
  else if (media == "image/jpeg" || media == "image/jpg") declared = image_format::jpeg;
  else
    return error(errc::invalid_argument, "image_url: media type '{}' is not supported; {}", media, k_accepted);
  // Base64: 4 characters for 3 bytes, '=' padding the last group.
  if (static_cast<std::int64_t>(payload.size() / 4) * 3 > limits.max_bytes)
    return error(errc::out_of_range, "image of about {} bytes is over the limit of {} bytes", payload.size() / 4 * 3,
                 limits.max_bytes);
  if (payload.empty() || payload.size() % 4 != 0)
    return error(errc::invalid_argument, "image_url: the base64 data is empty or not a whole number of 4-character groups");
  std::vector<std::uint8_t> bytes(payload.size() / 4 * 3);
  const int n = EVP_DecodeBlock(bytes.data(), reinterpret_cast<const unsigned char*>(payload.data()),
                                static_cast<int>(payload.size()));
  if (n < 0) return error(errc::invalid_argument, "image_url: the data is not valid base64");
  const std::size_t pad = payload.ends_with("==") ? 2 : payload.ends_with('=') ? 1 : 0;
  bytes.resize(static_cast<std::size_t>(n) - pad);
  const image_format actual = sniff_image_format(bytes);
  if (actual != declared)
    return error(errc::invalid_argument, "image_url: the data: URL says {} but its bytes are {}", media,
                 actual == image_format::unknown ? std::string("no image format Pagoda knows")
                                                 : fmt::format("a {} file", image_format_name(actual)));
  return bytes;
}

}  // namespace pagoda::vision
