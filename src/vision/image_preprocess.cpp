#include "vision/image_preprocess.h"

#include <algorithm>
#include <cmath>

namespace pagoda::vision {

std::array<int, 2> idefics3_refined_size(int nx, int ny, int image_size, int longest_edge) {
  // float arithmetic, as llama.cpp's calc_size_preserved_ratio
  const float scale = std::min(static_cast<float>(longest_edge) / static_cast<float>(nx),
                               static_cast<float>(longest_edge) / static_cast<float>(ny));
  auto ceil_to = [image_size](float v) {
    return static_cast<int>(std::ceil(v / static_cast<float>(image_size))) * image_size;
  };
  return {ceil_to(static_cast<float>(nx) * scale), ceil_to(static_cast<float>(ny) * scale)};
}

planar_image normalize(const rgb_image& image, const std::array<float, 3>& mean, const std::array<float, 3>& std) {
  planar_image out;
  out.nx = image.nx;
  out.ny = image.ny;
  const std::size_t plane = static_cast<std::size_t>(image.nx) * static_cast<std::size_t>(image.ny);
  out.data.resize(3 * plane);
  for (std::size_t i = 0; i < plane; ++i) {
    for (int c = 0; c < 3; ++c) {
      const float v = static_cast<float>(image.rgb[i * 3 + static_cast<std::size_t>(c)]) / 255.0f;
      out.data[static_cast<std::size_t>(c) * plane + i] = (v - mean[c]) / std[c];
    }
  }
  return out;
}

namespace {

std::uint8_t pixel(const rgb_image& img, int x, int y, int c) {
  return img.rgb[(static_cast<std::size_t>(y) * static_cast<std::size_t>(img.nx) + static_cast<std::size_t>(x)) * 3 +
                 static_cast<std::size_t>(c)];
}

void set_pixel(rgb_image& img, int x, int y, int c, std::uint8_t v) {
  img.rgb[(static_cast<std::size_t>(y) * static_cast<std::size_t>(img.nx) + static_cast<std::size_t>(x)) * 3 +
          static_cast<std::size_t>(c)] = v;
}

rgb_image blank(int nx, int ny) {
  return rgb_image{nx, ny, std::vector<std::uint8_t>(static_cast<std::size_t>(nx) * static_cast<std::size_t>(ny) * 3)};
}

float lerp(float a, float b, float t) { return a + (b - a) * t; }

// Corner-aligned bilinear resize, truncating to 8 bits (llama.cpp's
// resize_bilinear: the corners map to the corners).
rgb_image resize_bilinear(const rgb_image& src, int nx, int ny) {
  rgb_image dst = blank(nx, ny);
  const float rx = nx > 1 ? static_cast<float>(src.nx - 1) / static_cast<float>(nx - 1) : 0.0f;
  const float ry = ny > 1 ? static_cast<float>(src.ny - 1) / static_cast<float>(ny - 1) : 0.0f;
  for (int y = 0; y < ny; ++y) {
    const float fy = static_cast<float>(y) * ry;
    const int y0 = std::min(static_cast<int>(fy), src.ny - 1);
    const int y1 = std::min(y0 + 1, src.ny - 1);
    const float ty = fy - static_cast<float>(y0);
    for (int x = 0; x < nx; ++x) {
      const float fx = static_cast<float>(x) * rx;
      const int x0 = std::min(static_cast<int>(fx), src.nx - 1);
      const int x1 = std::min(x0 + 1, src.nx - 1);
      const float tx = fx - static_cast<float>(x0);
      for (int c = 0; c < 3; ++c) {
        const float top = lerp(pixel(src, x0, y0, c), pixel(src, x1, y0, c), tx);
        const float bottom = lerp(pixel(src, x0, y1, c), pixel(src, x1, y1, c), tx);
        set_pixel(dst, x, y, c, static_cast<std::uint8_t>(lerp(top, bottom, ty)));
      }
    }
  }
  return dst;
}

// One cubic step through four samples at offsets -1, 0, 1, 2 evaluated at t in
// [0, 1): the polynomial llama.cpp's resize_bicubic uses (coefficients in
// double, rounded to float, evaluated in float).
float cubic(float p0, float p1, float p2, float p3, float t) {
  const float d0 = p0 - p1;
  const float d2 = p2 - p1;
  const float d3 = p3 - p1;
  const float a1 = static_cast<float>(-1.0 / 3 * d0 + d2 - 1.0 / 6 * d3);
  const float a2 = static_cast<float>(1.0 / 2 * d0 + 1.0 / 2 * d2);
  const float a3 = static_cast<float>(-1.0 / 6 * d0 - 1.0 / 2 * d2 + 1.0 / 6 * d3);
  return p1 + a1 * t + a2 * t * t + a3 * t * t * t;
}

// Bicubic resize sampling the source at (j * nx_src / nx, i * ny_src / ny),
// edges clamped, rounded and clamped to 8 bits (llama.cpp's resize_bicubic).
rgb_image resize_bicubic(const rgb_image& src, int nx, int ny) {
  rgb_image dst = blank(nx, ny);
  const float sx = static_cast<float>(src.nx) / static_cast<float>(nx);
  const float sy = static_cast<float>(src.ny) / static_cast<float>(ny);
  auto at = [&](int x, int y, int c) {
    return static_cast<float>(pixel(src, std::clamp(x, 0, src.nx - 1), std::clamp(y, 0, src.ny - 1), c));
  };
  for (int i = 0; i < ny; ++i) {
    const int y = static_cast<int>(sy * static_cast<float>(i));
    const float ty = sy * static_cast<float>(i) - static_cast<float>(y);
    for (int j = 0; j < nx; ++j) {
      const int x = static_cast<int>(sx * static_cast<float>(j));
      const float tx = sx * static_cast<float>(j) - static_cast<float>(x);
      for (int c = 0; c < 3; ++c) {
        float rows[4];
        for (int r = 0; r < 4; ++r)
          rows[r] = cubic(at(x - 1, y - 1 + r, c), at(x, y - 1 + r, c), at(x + 1, y - 1 + r, c), at(x + 2, y - 1 + r, c), tx);
        const float v = cubic(rows[0], rows[1], rows[2], rows[3], ty);
        set_pixel(dst, j, i, c, static_cast<std::uint8_t>(std::min(std::max(std::round(v), 0.0f), 255.0f)));
      }
    }
  }
  return dst;
}

using resize_fn = rgb_image (*)(const rgb_image&, int, int);

// src scaled by `resize` to fit nx x ny with its aspect ratio, sides rounded
// up, centred on black (llama.cpp's PAD_CEIL resize; idefics3's refined copy
// bicubic, gemma3's whole image bilinear).
rgb_image fit_padded(const rgb_image& src, int nx, int ny, resize_fn resize) {
  if (src.nx == nx && src.ny == ny) return src;
  const float scale = std::min(static_cast<float>(nx) / static_cast<float>(src.nx),
                               static_cast<float>(ny) / static_cast<float>(src.ny));
  const int w = std::min(static_cast<int>(std::ceil(static_cast<float>(src.nx) * scale)), nx);
  const int h = std::min(static_cast<int>(std::ceil(static_cast<float>(src.ny) * scale)), ny);
  const rgb_image scaled = resize(src, w, h);
  rgb_image dst = blank(nx, ny);
  const int ox = (nx - w) / 2;
  const int oy = (ny - h) / 2;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) set_pixel(dst, x + ox, y + oy, c, pixel(scaled, x, y, c));
  return dst;
}

rgb_image crop(const rgb_image& src, int x0, int y0, int nx, int ny) {
  rgb_image dst = blank(nx, ny);
  for (int y = 0; y < ny; ++y)
    for (int x = 0; x < nx; ++x)
      for (int c = 0; c < 3; ++c) set_pixel(dst, x, y, c, pixel(src, x0 + x, y0 + y, c));
  return dst;
}

}  // namespace

result<std::vector<planar_image>> preprocess(const rgb_image& image, const vision_hparams& hp) {
  if (image.nx <= 0 || image.ny <= 0 ||
      image.rgb.size() != static_cast<std::size_t>(image.nx) * static_cast<std::size_t>(image.ny) * 3)
    return error(errc::invalid_argument, "image of {}x{} pixels with {} bytes of RGB", image.nx, image.ny,
                 image.rgb.size());
  const int side = hp.image_size;
  if (hp.projector == projector_kind::gemma3) {
    std::vector<planar_image> out;
    out.push_back(normalize(fit_padded(image, side, side, resize_bilinear), hp.image_mean, hp.image_std));
    return out;
  }
  const auto [rx, ry] = idefics3_refined_size(image.nx, image.ny, side, hp.longest_edge);
  std::vector<planar_image> out;
  const rgb_image refined = fit_padded(image, rx, ry, resize_bicubic);
  for (int y = 0; y < ry; y += side)
    for (int x = 0; x < rx; x += side)
      out.push_back(normalize(crop(refined, x, y, side, side), hp.image_mean, hp.image_std));
  const bool same = image.nx == side && image.ny == side;
  out.push_back(normalize(same ? image : resize_bilinear(image, side, side), hp.image_mean, hp.image_std));
  return out;
}

}  // namespace pagoda::vision
