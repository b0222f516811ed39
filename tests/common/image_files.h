// PNG and JPEG files written in memory from known pixels, with libpng's and
// TurboJPEG's encoders: the image decoder's tests and its fuzz seeds.
#pragma once

#include <png.h>
#include <turbojpeg.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace pagoda::test {

// pixels: rows of PNG_IMAGE_SAMPLE_CHANNELS(format) samples of
// PNG_IMAGE_SAMPLE_COMPONENT_SIZE(format) bytes. Empty on failure.
inline std::vector<std::uint8_t> write_png(const void* pixels, int nx, int ny, png_uint_32 format) {
  png_image img;
  std::memset(&img, 0, sizeof img);
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(nx);
  img.height = static_cast<png_uint_32>(ny);
  img.format = format;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, pixels, 0, nullptr)) return {};
  std::vector<std::uint8_t> out(size);
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, pixels, 0, nullptr)) return {};
  out.resize(size);
  return out;
}

// pixels: RGB (or grey with TJSAMP_GRAY) rows. Empty on failure.
inline std::vector<std::uint8_t> write_jpeg(const std::uint8_t* pixels, int nx, int ny, int quality, int subsamp,
                                            int flags = TJFLAG_ACCURATEDCT) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  std::vector<std::uint8_t> out;
  const int format = subsamp == TJSAMP_GRAY ? TJPF_GRAY : TJPF_RGB;
  if (tj && tjCompress2(tj, pixels, nx, 0, ny, format, &buf, &size, subsamp, quality, flags) == 0)
    out.assign(buf, buf + size);
  tjFree(buf);
  if (tj) tjDestroy(tj);
  return out;
}

}  // namespace pagoda::test
