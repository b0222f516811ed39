// Writes the image fuzz seeds (tests/fuzz/corpus/image): small PNGs (RGB,
// RGBA, grey, palette-free 16-bit) and JPEGs (4:4:4, 4:2:0, progressive,
// grey), and a data: URL. Regenerate with
//   build/release/tests/fuzz/make_image_seeds tests/fuzz/corpus/image
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/image_files.h"

namespace {

bool save(const std::filesystem::path& p, const void* data, std::size_t n) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  return static_cast<bool>(out);
}

std::vector<std::uint8_t> pixels(int nx, int ny, int channels, int bytes_per_sample = 1) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(nx) * ny * channels * bytes_per_sample);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<std::uint8_t>((i * 29) ^ (i >> 3));
  return p;
}

std::vector<std::uint8_t> png(int nx, int ny, png_uint_32 format) {
  const auto px = pixels(nx, ny, PNG_IMAGE_SAMPLE_CHANNELS(format), PNG_IMAGE_SAMPLE_COMPONENT_SIZE(format));
  return pagoda::test::write_png(px.data(), nx, ny, format);
}

std::vector<std::uint8_t> jpeg(int nx, int ny, int subsamp, int flags = 0) {
  const auto px = pixels(nx, ny, subsamp == TJSAMP_GRAY ? 1 : 3);
  return pagoda::test::write_jpeg(px.data(), nx, ny, 80, subsamp, flags);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_image_seeds CORPUS_DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  struct seed {
    const char* name;
    std::vector<std::uint8_t> bytes;
  };
  const seed seeds[] = {
      {"rgb.png", png(7, 5, PNG_FORMAT_RGB)},
      {"rgba.png", png(6, 4, PNG_FORMAT_RGBA)},
      {"grey.png", png(5, 5, PNG_FORMAT_GRAY)},
      {"linear16.png", png(3, 3, PNG_FORMAT_LINEAR_RGB)},
      {"444.jpg", jpeg(16, 8, TJSAMP_444)},
      {"420.jpg", jpeg(17, 9, TJSAMP_420)},
      {"progressive.jpg", jpeg(16, 16, TJSAMP_422, TJFLAG_PROGRESSIVE)},
      {"grey.jpg", jpeg(8, 8, TJSAMP_GRAY)},
  };
  for (const seed& s : seeds) {
    if (s.bytes.empty() || !save(dir / s.name, s.bytes.data(), s.bytes.size())) {
      std::fprintf(stderr, "make_image_seeds: could not make %s\n", s.name);
      return 1;
    }
  }
  // A data: URL of a 1 x 1 PNG (the image_url path).
  const std::string url =
      "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC";
  if (!save(dir / "url.txt", url.data(), url.size())) return 1;
  return 0;
}
