// Image preprocessing as llama.cpp's mtmd does it before the encoder: an RGB
// image of 8-bit pixels becomes one or more planar float images, each
// normalised per channel as (v / 255 - mean) / std.
//
// idefics3 (tools/mtmd/mtmd-image.cpp, mtmd_image_preprocessor_idefics3, in
// the order mtmd_tokenize gives its chunks): the slices of a refined copy,
// image_size tiles row-major, then the overview, the image resized to
// image_size x image_size (corner-aligned bilinear, truncated to 8 bits). The
// refined copy's size is the image scaled so its longest side is
// longest_edge, both sides rounded up to multiples of image_size; the image is
// scaled into it bicubically keeping its aspect ratio (sides rounded up) and
// centred on black. A side already at its size is copied.
//
// gemma3 (mtmd_image_preprocessor_fixed_size with gemma3's settings): one
// chunk, the image scaled to fit image_size x image_size keeping its aspect
// ratio (sides rounded up; corner-aligned bilinear, truncated to 8 bits),
// centred on black; an image already that size is copied.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "pagoda/status.h"
#include "vision/mmproj.h"

namespace pagoda::vision {

struct rgb_image {
  int nx = 0;
  int ny = 0;
  std::vector<std::uint8_t> rgb;  // [ny][nx][3], interleaved R, G, B
};

struct planar_image {
  int nx = 0;
  int ny = 0;
  std::vector<float> data;  // [3][ny][nx]
};

// The refined size idefics3 slices: the image scaled so that its longest side
// is longest_edge, each side rounded up to a multiple of image_size.
std::array<int, 2> idefics3_refined_size(int nx, int ny, int image_size, int longest_edge);

// (v / 255 - mean[c]) / std[c] per channel, planar.
planar_image normalize(const rgb_image& image, const std::array<float, 3>& mean, const std::array<float, 3>& std);

// The encoder's inputs for one image, in llama.cpp's order (the overview last).
result<std::vector<planar_image>> preprocess(const rgb_image& image, const vision_hparams& hp);

}  // namespace pagoda::vision
