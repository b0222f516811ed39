// llama.cpp's reference outputs and the teacher-forced run (oracle_util.h).
#include "model/oracle_util.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/half.h"
#include "kv/kv_storage.h"

namespace pagoda::test {

std::vector<float> run_teacher_forced(const llama_model& model, std::span<const token_id> tokens, int n_prompt,
                                      int n_threads) {
  const llama_hparams& hp = model.hparams();
  constexpr int k_block_tokens = 16;
  const int n_blocks = (static_cast<int>(tokens.size()) + k_block_tokens - 1) / k_block_tokens;
  auto kv = kv_storage::create(
      kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, k_block_tokens, kv_type::f32, kv_type::f32), n_blocks);
  EXPECT_TRUE(kv.ok()) << kv.error().message();
  if (!kv.ok()) return {};
  std::vector<block_id> table;
  for (int i = 0; i < n_blocks; ++i) table.emplace_back(i);
  llama_context ctx(model, **kv, n_threads);
  std::vector<float> out, logits;
  forward_seq prompt = forward_seq::consecutive(tokens.first(static_cast<std::size_t>(n_prompt)), 0, table, true);
  status st = ctx.forward({&prompt, 1}, logits);
  EXPECT_TRUE(st.ok()) << st.message();
  out.insert(out.end(), logits.begin(), logits.end());
  for (std::size_t k = static_cast<std::size_t>(n_prompt); k < tokens.size() && st.ok(); ++k) {
    forward_seq one = forward_seq::consecutive(tokens.subspan(k, 1), static_cast<int>(k), table, false);
    st = ctx.forward({&one, 1}, logits);
    EXPECT_TRUE(st.ok()) << st.message();
    out.insert(out.end(), logits.begin(), logits.end());
  }
  return out;
}

std::string oracle_dir() { return std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle"; }

std::vector<std::string> oracle_case_names() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(oracle_dir() + "/ref"))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

namespace {

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

oracle_case load_oracle_case(const std::string& name) {
  const std::string dir = oracle_dir();
  std::ifstream in(dir + "/ref/" + name + ".json");
  const nlohmann::json j = nlohmann::json::parse(in);
  oracle_case c;
  c.name = name;
  c.family = j["family"].get<std::string>();
  c.arch = j.contains("arch") ? j["arch"].get<std::string>() : "llama";
  c.gguf_path = dir + "/gguf/" + std::filesystem::path(j["gguf"].get<std::string>()).filename().string();
  c.tokens = j["tokens"].get<std::vector<token_id>>();
  c.n_prompt = j["n_prompt"].get<int>();
  c.n_vocab = j["n_vocab"].get<int>();
  c.greedy = j["greedy"].get<std::vector<token_id>>();
  c.margins = j["greedy_margins"].get<std::vector<float>>();
  for (const auto& [type, n] : j["type_counts"].items()) c.type_counts.emplace_back(type, n.get<int>());
  // The architecture references are verbatim f32 (their tolerances are at
  // float level); the weight-format ones were shrunk to fp16 (README.md).
  const std::string f32 = dir + "/ref/" + name + ".logits.f32";
  if (std::filesystem::exists(f32)) {
    const std::vector<char> raw = read_bytes(f32);
    c.logits.resize(raw.size() / 4);
    std::memcpy(c.logits.data(), raw.data(), raw.size());
  } else {
    const std::vector<char> half = read_bytes(dir + "/ref/" + name + ".logits.f16");
    c.logits.resize(half.size() / 2);
    for (std::size_t i = 0; i < c.logits.size(); ++i) {
      fp16_t h;
      std::memcpy(&h, half.data() + 2 * i, 2);
      c.logits[i] = fp16_to_f32(h);
    }
  }
  const std::string deq = dir + "/ref/" + name + ".deq.logits.f32";
  if (std::filesystem::exists(deq)) {
    const std::vector<char> raw = read_bytes(deq);
    c.deq_logits.resize(raw.size() / 4);
    std::memcpy(c.deq_logits.data(), raw.data(), raw.size());
  }
  return c;
}

logit_diff compare_logits(const std::vector<float>& got, const std::vector<float>& want, int n_vocab) {
  logit_diff d;
  EXPECT_EQ(got.size(), want.size());
  const std::size_t n = std::min(got.size(), want.size());
  double sq = 0;
  d.row_max.assign(n / static_cast<std::size_t>(n_vocab), 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(e)) e = INFINITY;  // a NaN logit must fail, not vanish in max()
    d.max_abs = std::max(d.max_abs, e);
    d.row_max[i / static_cast<std::size_t>(n_vocab)] = std::max(d.row_max[i / static_cast<std::size_t>(n_vocab)], e);
    sq += e * e;
  }
  d.rms = n ? std::sqrt(sq / static_cast<double>(n)) : 0.0;
  return d;
}

}  // namespace pagoda::test
