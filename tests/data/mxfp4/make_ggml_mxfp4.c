/* Writes ggml_mxfp4.bin: MXFP4 blocks and ggml's own decoding of them, the
 * independent reference for Pagoda's mxfp4 decoder (tests/model/mxfp4_test.cpp).
 * Built against llama.cpp's libggml-base; see tests/data/README.md. Not part of
 * Pagoda's build.
 *
 * File layout (little-endian): char magic[8] = "MXFP4REF", uint32 n_blocks,
 * then n_blocks blocks of 17 bytes (ggml's block_mxfp4), then n_blocks * 32
 * float32: ggml's dequantize_row_mxfp4 of those blocks.
 *
 * Blocks (seeded, deterministic):
 *   0..159    ggml's quantize_row_mxfp4_ref of random floats, block scales
 *             2^-40 .. 2^40, some elements zero or -0, some single outliers;
 *   160..183  the same at extreme scales (max |x| from 2^-125 to 2^127, the
 *             range ggml's quantizer maps to exponents 0..252);
 *   184..191  all-zero and all -0 inputs;
 *   192..255  hand-made blocks with exponent bytes 0, 1, 2, 3, 126, 127, 128,
 *             253, 254, 255 (which ggml's quantizer never writes but its
 *             decoder reads) and random code bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ggml.h"

enum { k_blocks = 256, k_qk = 32, k_block_bytes = 17 };

static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void) { /* splitmix64 */
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double uniform(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; } /* [0, 1) */
static int uniform_int(int lo, int hi) { return lo + (int)(next_u64() % (uint64_t)(hi - lo + 1)); }

static void random_block(float* x, int log2_scale) {
  for (int j = 0; j < k_qk; ++j) x[j] = (float)ldexp(2.0 * uniform() - 1.0, log2_scale);
  const int kind = uniform_int(0, 3);
  if (kind == 1) /* a few zeros of either sign */
    for (int k = 0; k < 6; ++k) x[uniform_int(0, k_qk - 1)] = (k % 2) ? -0.0f : 0.0f;
  if (kind == 2) /* one outlier */
    x[uniform_int(0, k_qk - 1)] *= 7.0f;
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "ggml_mxfp4.bin";
  const struct ggml_type_traits* tr = ggml_get_type_traits(GGML_TYPE_MXFP4);
  if (tr->blck_size != k_qk || tr->type_size != k_block_bytes) {
    fprintf(stderr, "unexpected mxfp4 traits\n");
    return 1;
  }
  static uint8_t blocks[k_blocks][k_block_bytes];
  static float out[k_blocks * k_qk];
  float x[k_qk];
  for (int b = 0; b < 184; ++b) {
    const int log2_scale = b < 160 ? uniform_int(-40, 40) : (b % 2 ? uniform_int(-122, -110) : uniform_int(110, 126));
    random_block(x, log2_scale);
    if (b == 160) { /* the smallest max |x| ggml maps without wrapping: exponent byte 0 */
      for (int j = 0; j < k_qk; ++j) x[j] = ldexpf((float)uniform(), -125);
      x[5] = ldexpf(1.0f, -125);
    }
    if (b == 162) x[0] = ldexpf(1.9f, 127); /* the largest: floor(log2) = 127 */
    tr->from_float_ref(x, blocks[b], k_qk);
  }
  for (int b = 184; b < 192; ++b) {
    for (int j = 0; j < k_qk; ++j) x[j] = (b % 2) ? -0.0f : 0.0f;
    tr->from_float_ref(x, blocks[b], k_qk);
  }
  static const uint8_t k_exponents[] = {0, 1, 2, 3, 126, 127, 128, 253, 254, 255};
  for (int b = 192; b < k_blocks; ++b) {
    blocks[b][0] = k_exponents[(b - 192) % (sizeof k_exponents)];
    for (int j = 1; j < k_block_bytes; ++j) blocks[b][j] = (uint8_t)uniform_int(0, 255);
  }
  tr->to_float(blocks, out, (int64_t)k_blocks * k_qk);

  FILE* f = fopen(path, "wb");
  if (!f) {
    perror(path);
    return 1;
  }
  const uint32_t n = k_blocks;
  fwrite("MXFP4REF", 1, 8, f);
  fwrite(&n, sizeof n, 1, f);
  fwrite(blocks, k_block_bytes, k_blocks, f);
  fwrite(out, sizeof(float), (size_t)k_blocks * k_qk, f);
  return fclose(f) == 0 ? 0 : 1;
}
