// Vision oracle files and the forward pass with embeddings input (vision_util.h).
#include "vision/vision_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "kv/kv_storage.h"

namespace pagoda::test {

std::string vision_dir() { return std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision"; }

std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(raw.size() % sizeof(float), 0u) << path;
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
  return out;
}

vision::rgb_image read_ppm(const std::string& path) {
  vision::rgb_image img;
  std::ifstream in(path, std::ios::binary);
  std::string magic;
  int maxval = 0;
  in >> magic >> img.nx >> img.ny >> maxval;
  EXPECT_TRUE(in && magic == "P6" && maxval == 255 && img.nx > 0 && img.ny > 0) << path;
  if (!in || img.nx <= 0 || img.ny <= 0) return {};
  in.get();  // the one whitespace byte after maxval
  img.rgb.resize(static_cast<std::size_t>(img.nx) * static_cast<std::size_t>(img.ny) * 3);
  in.read(reinterpret_cast<char*>(img.rgb.data()), static_cast<std::streamsize>(img.rgb.size()));
  EXPECT_TRUE(in) << path << ": truncated";
  return img;
}

diff compare(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  if (a.size() != b.size() || a.empty()) return {INFINITY, INFINITY};
  diff d;
  double sq = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double e = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(e)) e = INFINITY;  // a NaN must fail, not vanish in max()
    d.max_abs = std::max(d.max_abs, e);
    sq += e * e;
  }
  d.rms = std::sqrt(sq / static_cast<double>(a.size()));
  return d;
}

diff expect_close(std::span<const float> a, std::span<const float> b, double max_abs, double rms, const std::string& what) {
  const diff d = compare(a, b);
  EXPECT_LE(d.max_abs, max_abs) << what;
  EXPECT_LE(d.rms, rms) << what;
  std::printf("[ vision ] %s max abs diff %.3g rms %.3g (%zu values)\n", what.c_str(), d.max_abs, d.rms, a.size());
  return d;
}

std::vector<float> logits_after_embeddings(const llama_model& model, std::span<const token_id> prompt,
                                           std::span<const float> embeddings, int n_threads, bool bidirectional,
                                           std::span<const token_id> after) {
  const llama_hparams& hp = model.hparams();
  const int n_rows = static_cast<int>(embeddings.size() / static_cast<std::size_t>(hp.n_embd));
  constexpr int k_block_tokens = 16;
  const int n_total = static_cast<int>(prompt.size()) + n_rows + static_cast<int>(after.size());
  const int n_blocks = (n_total + k_block_tokens - 1) / k_block_tokens;
  auto kv = kv_storage::create(
      kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, k_block_tokens, kv_type::f32, kv_type::f32), n_blocks);
  EXPECT_TRUE(kv.ok()) << kv.error().message();
  if (!kv.ok()) return {};
  std::vector<block_id> table;
  for (int i = 0; i < n_blocks; ++i) table.emplace_back(i);
  llama_context ctx(model, **kv, n_threads);
  std::vector<float> logits;
  forward_seq first = forward_seq::consecutive(prompt, 0, table, false);
  status st = ctx.forward({&first, 1}, logits);
  EXPECT_TRUE(st.ok()) << st.message();
  // The ids only count the rows: the embeddings stand in for them.
  const std::vector<token_id> placeholders(static_cast<std::size_t>(n_rows), token_id{0});
  forward_seq image = forward_seq::consecutive(placeholders, static_cast<int>(prompt.size()), table, true);
  image.embeddings = embeddings;
  const std::vector<std::int32_t> last(static_cast<std::size_t>(n_rows), static_cast<std::int32_t>(prompt.size()) + n_rows - 1);
  if (bidirectional) image.see_until = last;
  st = ctx.forward({&image, 1}, logits);
  EXPECT_TRUE(st.ok()) << st.message();
  if (after.empty()) return logits;
  std::vector<float> tail;
  forward_seq next = forward_seq::consecutive(after, static_cast<int>(prompt.size()) + n_rows, table, true);
  st = ctx.forward({&next, 1}, tail);
  EXPECT_TRUE(st.ok()) << st.message();
  logits.insert(logits.end(), tail.begin(), tail.end());
  return logits;
}

}  // namespace pagoda::test
