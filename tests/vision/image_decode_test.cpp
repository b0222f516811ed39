// Image decoding (src/vision/image_decode.h): PNG exact, JPEG within the
// codec's own loss, data: URLs, and every bad input an error that names it.
// Test images are written here with libpng's and TurboJPEG's encoders from
// pixels the test knows.
#include <cstring>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "common/image_files.h"
#include "vision/image_decode.h"

namespace pagoda::vision {
namespace {

// A deterministic picture: gradients and noise, so every channel and pixel differs.
rgb_image picture(int nx, int ny, unsigned seed = 1) {
  rgb_image im;
  im.nx = nx;
  im.ny = ny;
  im.rgb.resize(static_cast<std::size_t>(nx) * ny * 3);
  std::mt19937 rng(seed);
  for (int y = 0; y < ny; ++y)
    for (int x = 0; x < nx; ++x) {
      std::uint8_t* p = &im.rgb[(static_cast<std::size_t>(y) * nx + x) * 3];
      p[0] = static_cast<std::uint8_t>(x * 255 / std::max(1, nx - 1));
      p[1] = static_cast<std::uint8_t>(y * 255 / std::max(1, ny - 1));
      p[2] = static_cast<std::uint8_t>(rng() & 0xff);
    }
  return im;
}

std::vector<std::uint8_t> write_png(const void* pixels, int nx, int ny, png_uint_32 format) {
  auto out = test::write_png(pixels, nx, ny, format);
  EXPECT_FALSE(out.empty()) << "libpng could not write the test image";
  return out;
}

std::vector<std::uint8_t> write_jpeg(const rgb_image& im, int quality, int subsamp = TJSAMP_444) {
  auto out = test::write_jpeg(im.rgb.data(), im.nx, im.ny, quality, subsamp);
  EXPECT_FALSE(out.empty()) << "TurboJPEG could not write the test image";
  return out;
}

std::string base64(std::span<const std::uint8_t> b) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < b.size(); i += 3) {
    const std::uint32_t v = (b[i] << 16) | ((i + 1 < b.size() ? b[i + 1] : 0) << 8) | (i + 2 < b.size() ? b[i + 2] : 0);
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += i + 1 < b.size() ? k[(v >> 6) & 63] : '=';
    out += i + 2 < b.size() ? k[v & 63] : '=';
  }
  return out;
}

// PNG's chunk CRC (ISO 3309, reflected 0xEDB88320), bit by bit.
std::uint32_t png_crc(const std::uint8_t* p, std::size_t n) {
  std::uint32_t c = 0xffffffffu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

void expect_error(const result<rgb_image>& r, errc code, const std::string& says) {
  ASSERT_FALSE(r.ok()) << "decoded what should fail (" << says << ")";
  EXPECT_EQ(r.error().code(), code) << r.error().message();
  EXPECT_NE(r.error().message().find(says), std::string::npos) << r.error().message();
}

TEST(image_decode, png_is_exact) {
  for (auto [nx, ny] : {std::pair{1, 1}, std::pair{37, 23}, std::pair{64, 64}}) {
    const rgb_image im = picture(nx, ny);
    auto r = decode_image(write_png(im.rgb.data(), nx, ny, PNG_FORMAT_RGB));
    ASSERT_TRUE(r.ok()) << r.error().message();
    EXPECT_EQ(r->nx, nx);
    EXPECT_EQ(r->ny, ny);
    EXPECT_EQ(r->rgb, im.rgb);
  }
}

// Alpha is dropped, not composited (as llama.cpp's stb_image load with 3
// channels); grey is repeated into R, G and B; 16-bit samples become 8-bit.
TEST(image_decode, png_alpha_grey_and_16_bit) {
  const rgb_image im = picture(9, 7);
  std::vector<std::uint8_t> rgba;
  for (std::size_t i = 0; i < im.rgb.size() / 3; ++i) {
    rgba.insert(rgba.end(), im.rgb.begin() + 3 * i, im.rgb.begin() + 3 * i + 3);
    rgba.push_back(static_cast<std::uint8_t>(i * 37));  // every alpha, 0 included
  }
  auto r = decode_image(write_png(rgba.data(), 9, 7, PNG_FORMAT_RGBA));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(r->rgb, im.rgb);

  std::vector<std::uint8_t> grey(9 * 7);
  for (std::size_t i = 0; i < grey.size(); ++i) grey[i] = static_cast<std::uint8_t>(i * 5);
  r = decode_image(write_png(grey.data(), 9, 7, PNG_FORMAT_GRAY));
  ASSERT_TRUE(r.ok()) << r.error().message();
  for (std::size_t i = 0; i < grey.size(); ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(r->rgb[3 * i + c], grey[i]) << i;

  // libpng writes 16-bit linear samples; 0 and full scale are exact in any transfer function.
  std::vector<std::uint16_t> wide(4 * 3);
  for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = i % 2 ? 65535 : 0;
  r = decode_image(write_png(wide.data(), 2, 2, PNG_FORMAT_LINEAR_RGB));
  ASSERT_TRUE(r.ok()) << r.error().message();
  for (std::size_t i = 0; i < wide.size(); ++i) EXPECT_EQ(r->rgb[i], i % 2 ? 255 : 0) << i;
}

// At quality 100 and no chroma subsampling the round trip loses little: mean
// absolute error under 1 level, no sample off by more than 8 (the test picture
// has a noise channel, JPEG's hardest case).
TEST(image_decode, jpeg_round_trip_within_the_codec_loss) {
  const rgb_image im = picture(48, 40);
  auto r = decode_image(write_jpeg(im, 100));
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_EQ(r->nx, 48);
  ASSERT_EQ(r->ny, 40);
  double sum = 0;
  int worst = 0;
  for (std::size_t i = 0; i < im.rgb.size(); ++i) {
    const int d = std::abs(static_cast<int>(r->rgb[i]) - im.rgb[i]);
    sum += d;
    worst = std::max(worst, d);
  }
  EXPECT_LT(sum / static_cast<double>(im.rgb.size()), 1.0);
  EXPECT_LE(worst, 8);
  // Subsampled chroma decodes too (the common camera JPEG).
  r = decode_image(write_jpeg(im, 85, TJSAMP_420));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(r->rgb.size(), im.rgb.size());
}

TEST(image_decode, truncated_and_damaged_files_are_errors) {
  const rgb_image im = picture(32, 32);
  const auto png = write_png(im.rgb.data(), 32, 32, PNG_FORMAT_RGB);
  const auto jpeg = write_jpeg(im, 90);
  for (std::size_t cut : {std::size_t{9}, std::size_t{40}, png.size() / 2, png.size() - 13})
    expect_error(decode_image(std::span(png).first(cut)), errc::invalid_argument, "PNG image");
  for (std::size_t cut : {std::size_t{4}, std::size_t{100}, jpeg.size() / 2, jpeg.size() - 2})
    expect_error(decode_image(std::span(jpeg).first(cut)), errc::invalid_argument, "JPEG image");
  // A flipped byte inside the PNG's image data fails its CRC.
  auto bad = png;
  bad[bad.size() / 2] ^= 0x55;
  expect_error(decode_image(bad), errc::invalid_argument, "PNG image");
}

TEST(image_decode, other_formats_are_named) {
  const std::string gif = "GIF89a\x01\x00\x01\x00";
  const std::string webp = std::string("RIFF\x10\x00\x00\x00WEBPVP8 ", 16);
  const std::string text = "hello, this is no image";
  auto bytes = [](const std::string& s) { return std::vector<std::uint8_t>(s.begin(), s.end()); };
  expect_error(decode_image(bytes(gif)), errc::invalid_argument, "GIF is not supported");
  expect_error(decode_image(bytes(webp)), errc::invalid_argument, "WebP is not supported");
  expect_error(decode_image(bytes(text)), errc::invalid_argument, "not a PNG or JPEG");
  expect_error(decode_image({}), errc::invalid_argument, "no bytes");
}

// Limits hold before pixels are allocated: a header claiming 60000 x 60000
// pixels is refused from the header alone (its data is 1 pixel).
TEST(image_decode, limits_are_checked_from_the_header) {
  const rgb_image im = picture(64, 48);
  const auto png = write_png(im.rgb.data(), 64, 48, PNG_FORMAT_RGB);
  image_limits tight;
  tight.max_pixels = 64 * 48 - 1;
  expect_error(decode_image(png, tight), errc::out_of_range, "over the limit");
  tight = {};
  tight.max_side = 63;
  expect_error(decode_image(png, tight), errc::out_of_range, "over the limit");
  tight = {};
  tight.max_bytes = static_cast<std::int64_t>(png.size()) - 1;
  expect_error(decode_image(png, tight), errc::out_of_range, "bytes is over the limit");
  expect_error(decode_image(write_jpeg(im, 90), image_limits{1 << 20, 100, 8192}), errc::out_of_range, "over the limit");

  // The IHDR of a 1 x 1 PNG rewritten to 60000 x 60000 (its CRC recomputed).
  const rgb_image one = picture(1, 1);
  auto huge = write_png(one.rgb.data(), 1, 1, PNG_FORMAT_RGB);
  ASSERT_EQ(std::memcmp(huge.data() + 12, "IHDR", 4), 0);
  for (int at : {16, 20}) {
    const std::uint32_t v = 60000;
    for (int k = 0; k < 4; ++k) huge[static_cast<std::size_t>(at + k)] = static_cast<std::uint8_t>(v >> (24 - 8 * k));
  }
  const std::uint32_t crc = png_crc(huge.data() + 12, 17);
  for (int k = 0; k < 4; ++k) huge[static_cast<std::size_t>(29 + k)] = static_cast<std::uint8_t>(crc >> (24 - 8 * k));
  expect_error(decode_image(huge), errc::out_of_range, "60000 x 60000");
}

TEST(image_decode, data_urls) {
  const rgb_image im = picture(5, 3);
  const auto png = write_png(im.rgb.data(), 5, 3, PNG_FORMAT_RGB);
  const auto jpeg = write_jpeg(im, 90);
  auto r = image_url_bytes("data:image/png;base64," + base64(png));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(*r, png);
  for (std::size_t trim : {0, 1, 2}) {  // every padding length
    std::vector<std::uint8_t> cut(png.begin(), png.end() - static_cast<std::ptrdiff_t>(trim));
    auto c = image_url_bytes("data:image/png;base64," + base64(cut));
    ASSERT_TRUE(c.ok()) << c.error().message();
    EXPECT_EQ(*c, cut);
  }
  r = image_url_bytes("DATA:image/JPEG;base64," + base64(jpeg));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(*r, jpeg);
  ASSERT_TRUE(image_url_bytes("data:image/jpg;base64," + base64(jpeg)).ok());
  // A 1 x 1 PNG as another encoder wrote it (the fuzz corpus's url.txt).
  r = image_url_bytes("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC");
  ASSERT_TRUE(r.ok()) << r.error().message();
  auto one = decode_image(*r);
  ASSERT_TRUE(one.ok()) << one.error().message();
  EXPECT_EQ(one->nx, 1);
  EXPECT_EQ(one->ny, 1);

  auto refused = [](const std::string& url, const std::string& says) {
    auto e = image_url_bytes(url);
    ASSERT_FALSE(e.ok()) << url;
    EXPECT_NE(e.error().message().find(says), std::string::npos) << e.error().message();
  };
  refused("https://example.com/cat.png", "does not fetch images from the network");
  refused("http://127.0.0.1/cat.png", "does not fetch images from the network");
  refused("file:///etc/passwd", "not a data: URL");
  refused("/tmp/cat.png", "not a data: URL");
  refused("data:image/png;base64", "without ','");
  refused("data:image/png," + base64(png), "not base64");
  refused("data:image/gif;base64," + base64(png), "media type 'image/gif' is not supported");
  refused("data:image/jpeg;base64," + base64(png), "says image/jpeg but its bytes are a PNG file");
  refused("data:image/png;base64,iVBORw0KGgo*AAAA", "not valid base64");
  refused("data:image/png;base64,abc", "4-character groups");
  refused("data:image/png;base64,", "empty");
  image_limits small;
  small.max_bytes = 10;
  auto big = image_url_bytes("data:image/png;base64," + base64(png), small);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code(), errc::out_of_range);
}

}  // namespace
}  // namespace pagoda::vision
