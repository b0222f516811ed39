// Mixture of experts (model/moe.h, qwen3moe): routing by hand-computed
// cases, synth files that load with their experts read in place, the batched
// expert path against its reference twin and against an independent f64
// pass over the dequantized weights at every SIMD level, a batch of
// sequences against each alone, and load errors that name their key. The
// F32 oracle (llama.cpp's logits) is in oracle_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <functional>
#include <random>
#include <tuple>

#include "common/synth_model.h"
#include "kv/kv_storage.h"
#include "model/gguf_util.h"
#include "model/llama.h"
#include "model/vec_ops.h"
#include "model/simd_level_util.h"
#include "model/synth.h"

namespace pagoda {
namespace {

using gguf::tensor_type;
using ::testing::HasSubstr;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/moe_" + name + "_" + std::to_string(getpid()) + ".gguf";
}

std::unique_ptr<llama_model> synth_moe(tensor_type type, synth_mix mix = synth_mix::none,
                                       const char* preset = "tiny-qwen3moe") {
  synth_options o;
  o.preset = preset;
  o.weight_type = type;
  o.mix = mix;
  o.n_threads = 1;
  return test::load_synth(o, std::string("moe_") + preset + "_" + gguf::tensor_type_name(type));
}

// ---------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------

TEST(moe_route, softmax_top_k_with_renormalised_weights) {
  moe_config c;
  c.n_expert = 5;
  c.n_expert_used = 2;
  // Token 0: experts 1 and 3 tie at the top (lowest id first), then 2.
  // Token 1: expert 4 alone on top, then 0.
  const float logits[] = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f,  //
                          0.5f, -2.0f, 0.0f, 0.25f, 4.0f};
  std::int32_t ex[4];
  float w[4];
  moe_route(c, logits, 2, ex, w);
  EXPECT_EQ(ex[0], 1);
  EXPECT_EQ(ex[1], 3);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  EXPECT_EQ(ex[2], 4);
  EXPECT_EQ(ex[3], 0);
  // Renormalised over the chosen two: e^4 / (e^4 + e^0.5) and e^0.5 / (...).
  const double a = std::exp(4.0), b = std::exp(0.5);
  EXPECT_NEAR(w[2], a / (a + b), 1e-6);
  EXPECT_NEAR(w[3], b / (a + b), 1e-6);
}

TEST(moe_route, weights_as_routed_and_scaled_when_a_file_says_so) {
  moe_config c;
  c.n_expert = 3;
  c.n_expert_used = 2;
  c.norm_weights = false;
  c.weights_scale = 2.5f;
  const float logits[] = {0.0f, std::log(2.0f), std::log(5.0f)};  // probabilities 1/8, 2/8, 5/8
  std::int32_t ex[2];
  float w[2];
  moe_route(c, logits, 1, ex, w);
  EXPECT_EQ(ex[0], 2);
  EXPECT_EQ(ex[1], 1);
  EXPECT_NEAR(w[0], 2.5 * 5.0 / 8.0, 1e-6);
  EXPECT_NEAR(w[1], 2.5 * 2.0 / 8.0, 1e-6);
}

// gpt-oss: the experts with the largest logits, weighed by the softmax over
// those alone (so a far-off third expert changes nothing).
TEST(moe_route, softmax_weight_gating_chooses_by_logit) {
  moe_config c;
  c.n_expert = 4;
  c.n_expert_used = 2;
  c.gating = moe_gating::softmax_weight;
  c.norm_weights = false;
  const float logits[] = {1.0f, -3.0f, 2.5f, 0.5f,  //
                          0.0f, 0.0f, -1.0f, 7.0f};
  std::int32_t ex[4];
  float w[4];
  moe_route(c, logits, 2, ex, w);
  EXPECT_EQ(ex[0], 2);
  EXPECT_EQ(ex[1], 0);
  EXPECT_NEAR(w[0], 1.0 / (1.0 + std::exp(-1.5)), 1e-6);
  EXPECT_NEAR(w[1], 1.0 / (1.0 + std::exp(1.5)), 1e-6);
  EXPECT_EQ(ex[2], 3);
  EXPECT_EQ(ex[3], 0);  // 0 and 1 tie: the lower id
  EXPECT_NEAR(w[2], 1.0 / (1.0 + std::exp(-7.0)), 1e-6);
  EXPECT_NEAR(w[2] + w[3], 1.0, 1e-6);
}

// gpt-oss's clamped SwiGLU, by hand: the gate is clamped above at 7 only,
// the up projection to [-7, 7], then x sigmoid(1.702 x) (y + 1).
TEST(moe_activation, swiglu_oai_clamps_as_gpt_oss) {
  const float g[] = {0.0f, 1.0f, -2.0f, 9.0f, -30.0f, 3.0f};
  const float u[] = {1.0f, -0.5f, 2.0f, 0.0f, 1.0f, -12.0f};
  float out[6];
  swiglu_oai_mul(g, u, 6, out);
  auto f = [](double x, double y) { return x / (1 + std::exp(-1.702 * x)) * (y + 1); };
  EXPECT_NEAR(out[0], 0.0, 1e-7);
  EXPECT_NEAR(out[1], f(1, -0.5), 1e-6);
  EXPECT_NEAR(out[2], f(-2, 2), 1e-6);
  EXPECT_NEAR(out[3], f(7, 0), 1e-5);       // gate 9 clamped to 7
  EXPECT_NEAR(out[4], f(-30, 1), 1e-9);     // no lower clamp on the gate: ~0
  EXPECT_NEAR(out[5], f(3, -7), 1e-5);      // up -12 clamped to -7
}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

// synth -> load: the keys, the router, and each expert a slice of its 3-D
// tensor read in place (expert e at e x n_out x row_bytes), in Q4_K_M's mix.
TEST(moe_load, synth_experts_are_slices_of_the_file) {
  auto m = synth_moe(tensor_type::q4_k, synth_mix::q4_k_m);
  ASSERT_TRUE(m);
  const llama_hparams& hp = m->hparams();
  const synth_shape& s = *find_synth_preset("tiny-qwen3moe");
  EXPECT_EQ(hp.arch, "qwen3moe");
  EXPECT_TRUE(hp.qk_norm);
  EXPECT_TRUE(hp.rope_neox);
  EXPECT_EQ(hp.moe.n_expert, s.n_expert);
  EXPECT_EQ(hp.moe.n_expert_used, s.n_expert_used);
  EXPECT_EQ(hp.moe.n_ff_exp, s.n_ff_exp);
  EXPECT_TRUE(hp.moe.norm_weights);
  EXPECT_EQ(hp.moe.weights_scale, 1.0f);
  for (int l = 0; l < hp.n_layer; ++l) {
    const llama_layer& L = m->layers()[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    EXPECT_EQ(L.w_gate.data, nullptr);
    const gguf::tensor_info* router = m->gguf().find_tensor(p + "ffn_gate_inp.weight");
    ASSERT_TRUE(router);
    EXPECT_EQ(router->type, tensor_type::f32);  // llama-quantize never quantizes the router
    EXPECT_EQ(L.moe.router.data, router->data);
    EXPECT_EQ(L.moe.router.n_out, s.n_expert);
    for (auto [w, name, n_out] : {std::tuple{&L.moe.gate, "ffn_gate_exps.weight", s.n_ff_exp},
                                  std::tuple{&L.moe.up, "ffn_up_exps.weight", s.n_ff_exp},
                                  std::tuple{&L.moe.down, "ffn_down_exps.weight", s.n_embd}}) {
      const gguf::tensor_info* t = m->gguf().find_tensor(p + name);
      ASSERT_TRUE(t) << name;
      EXPECT_EQ(w->n_expert, s.n_expert);
      EXPECT_EQ(w->first.type, t->type);
      EXPECT_EQ(w->first.n_out, n_out);
      EXPECT_EQ(w->expert_bytes * static_cast<std::size_t>(s.n_expert), t->size_bytes) << name;
      for (int e = 0; e < s.n_expert; ++e)
        EXPECT_EQ(static_cast<const std::byte*>(w->expert(e).data), t->data + e * w->expert_bytes) << name;
    }
  }
  // Q4_K_M's rules: ffn_down_exps as ffn_down (q6_K where use_more_bits: of
  // 2 layers, layer 1 only), q4_K gate/up experts; with 8 experts q8_0
  // attn_k/attn_v and q5_K attn_output.
  EXPECT_EQ(m->layers()[0].moe.down.first.type, tensor_type::q4_k);
  EXPECT_EQ(m->layers()[1].moe.down.first.type, tensor_type::q6_k);
  EXPECT_EQ(m->layers()[0].moe.gate.first.type, tensor_type::q4_k);
  EXPECT_EQ(m->layers()[0].wv.type, tensor_type::q8_0);
  EXPECT_EQ(m->layers()[0].wk.type, tensor_type::q8_0);
  EXPECT_EQ(m->layers()[0].wo.type, tensor_type::q5_k);
  // The parameters a token computes with: all but 6 of 8 experts' 3 matrices per layer.
  EXPECT_EQ(m->n_active_params(),
            m->n_params() - std::int64_t{2} * 6 * 3 * s.n_embd * s.n_ff_exp);
}

// The real shapes: qwen3-30b-a3b with one layer writes and loads.
TEST(moe_load, qwen3_30b_a3b_preset_has_the_real_shapes) {
  synth_options o;
  o.preset = "qwen3-30b-a3b";
  o.n_layer = 1;
  o.weight_type = tensor_type::q4_k;
  o.n_threads = 1;
  const synth_shape s = *resolve_synth_shape(o);
  EXPECT_EQ(s.n_embd, 2048);
  EXPECT_EQ(s.n_head, 32);
  EXPECT_EQ(s.n_head_kv, 4);
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.n_expert, 128);
  EXPECT_EQ(s.n_expert_used, 8);
  EXPECT_EQ(s.n_ff_exp, 768);
  EXPECT_EQ(find_synth_preset("qwen3-30b-a3b")->n_layer, 48);
  // One layer's experts: 3 x 128 x 2048 x 768 weights in q4_K (144 bytes per 256).
  const std::uint64_t expert_bytes = std::uint64_t{3} * 128 * 2048 * 768 / 256 * 144;
  EXPECT_GT(*synth_model_size_bytes(o), expert_bytes);
  auto m = test::load_synth(o, "moe_30b");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->hparams().moe.n_expert, 128);
  EXPECT_EQ(m->hparams().q_dim(), 4096);
}

// ---------------------------------------------------------------------------
// The expert path at every SIMD level
// ---------------------------------------------------------------------------

std::vector<float> random_rows(int n_rows, int width, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n_rows) * width);
  for (float& v : x) v = g(rng);
  return x;
}

double rms_of(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s / static_cast<double>(x.size()));
}

struct diff {
  double max_abs = 0, rms = 0;
};
diff compare(const std::vector<float>& a, const std::vector<float>& b) {
  diff d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(static_cast<double>(a[i]) - b[i]);
    d.max_abs = std::max(d.max_abs, e);
    d.rms += e * e;
  }
  d.rms = std::sqrt(d.rms / static_cast<double>(a.size()));
  return d;
}

// An independent f64 pass over exactly dequantized weights (dequantize_row),
// with f32 activations: its own soft-max, top-k and weights, written from
// model/moe.h's description.
std::vector<float> dequantized_moe(const moe_config& c, const moe_weights& w, const std::vector<float>& x, int n_tok) {
  const std::int64_t n_embd = w.router.n_in, n_ff = c.n_ff_exp;
  auto rows_of = [](const weight_view& v) {
    std::vector<float> out(static_cast<std::size_t>(v.n_out * v.n_in));
    for (std::int64_t r = 0; r < v.n_out; ++r) dequantize_row(v, r, out.data() + r * v.n_in);
    return out;
  };
  auto dot = [](const float* a, const float* b, std::int64_t n) {
    double s = 0;
    for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
  };
  const std::vector<float> router = rows_of(w.router);
  const bool gpt_oss = c.gating == moe_gating::softmax_weight;
  auto bias = [](const std::vector<float>& b, int e, std::int64_t n, std::int64_t i) {
    return b.empty() ? 0.0 : static_cast<double>(b[static_cast<std::size_t>(e * n + i)]);
  };
  std::vector<float> out(x.size());
  for (int t = 0; t < n_tok; ++t) {
    const float* xt = x.data() + static_cast<std::size_t>(t) * n_embd;
    std::vector<double> p(static_cast<std::size_t>(c.n_expert));
    for (int e = 0; e < c.n_expert; ++e) p[e] = dot(router.data() + e * n_embd, xt, n_embd) + bias(w.router_bias, e, 1, 0);
    std::vector<int> order(p.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    // softmax over all (qwen3moe) or over the chosen logits (gpt-oss).
    const int n_soft = gpt_oss ? c.n_expert_used : c.n_expert;
    const double mx = p[order[0]];
    double z = 0;
    for (int j = 0; j < n_soft; ++j) z += std::exp(p[order[j]] - mx);
    for (int j = 0; j < n_soft; ++j) p[order[j]] = std::exp(p[order[j]] - mx) / z;
    double chosen = 0;
    for (int j = 0; j < c.n_expert_used; ++j) chosen += p[order[j]];
    if (!c.norm_weights) chosen = 1;
    std::vector<double> acc(static_cast<std::size_t>(n_embd), 0.0);
    for (int j = 0; j < c.n_expert_used; ++j) {
      const int e = order[j];
      const std::vector<float> gate = rows_of(w.gate.expert(e)), up = rows_of(w.up.expert(e)),
                               down = rows_of(w.down.expert(e));
      std::vector<float> h(static_cast<std::size_t>(n_ff));
      for (std::int64_t f = 0; f < n_ff; ++f) {
        double g = dot(gate.data() + f * n_embd, xt, n_embd) + bias(w.gate_bias, e, n_ff, f);
        double u = dot(up.data() + f * n_embd, xt, n_embd) + bias(w.up_bias, e, n_ff, f);
        if (gpt_oss) {  // clamped SwiGLU
          g = std::min(g, 7.0);
          u = std::clamp(u, -7.0, 7.0);
          h[f] = static_cast<float>(g / (1.0 + std::exp(-1.702 * g)) * (u + 1));
        } else {
          h[f] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
        }
      }
      const double wj = p[e] / chosen;
      for (std::int64_t i = 0; i < n_embd; ++i)
        acc[i] += wj * (dot(down.data() + i * n_ff, h.data(), n_ff) + bias(w.down_bias, e, n_embd, i));
    }
    for (std::int64_t i = 0; i < n_embd; ++i) out[static_cast<std::size_t>(t) * n_embd + i] = static_cast<float>(acc[i]);
  }
  return out;
}

// For each weight type, a tiny-qwen3moe and a tiny-gpt-oss model (whose rows
// of 128 take no super-block types) and n_tok random input rows:
// check(type, hparams, layer weights, inputs, the batched path's outputs,
// its active experts, layer) for every layer.
template <typename Check>
void for_each_moe_layer(std::initializer_list<tensor_type> types, int n_tok, unsigned seed, Check&& check) {
  for (const char* preset : {"tiny-qwen3moe", "tiny-gpt-oss"})
  for (tensor_type t : types) {
    if (std::string_view(preset) == "tiny-gpt-oss" && t == tensor_type::q4_k) continue;
    SCOPED_TRACE(std::string(preset) + " " + gguf::tensor_type_name(t));
    auto m = synth_moe(t, synth_mix::none, preset);
    ASSERT_TRUE(m);
    const llama_hparams& hp = m->hparams();
    const std::vector<float> x = random_rows(n_tok, hp.n_embd, seed);
    thread_pool pool(2);
    matmul_scratch mm;
    moe_scratch s;
    for (int l = 0; l < hp.n_layer; ++l) {
      const moe_weights& w = m->layers()[l].moe;
      std::vector<float> fast(x.size());
      const int active = moe_ffn(hp.moe, w, x.data(), n_tok, fast.data(), pool, mm, s);
      check(t, hp, w, x, fast, active, l);
    }
  }
}

class moe_levels : public ::testing::TestWithParam<simd_level> {};

// The batched path (gather, one product per active expert, weighted scatter)
// against its reference twin (token by token through matmul_ref, the same
// activation quantization): each token's output equal to float rounding, 1e-5
// of the output's RMS. Except, rarely, where the SwiGLU activations (summed
// in f32 by one, f64 by the other) straddle a q8 rounding boundary: one
// activation then moves by one quantization step, and that token's outputs by
// that step times a down weight, about 1e-3 of the RMS. At most 2 of the 37
// tokens may do so, each within 3e-3 (seen: one token of one layer, q8_0, 1.4e-3).
TEST_P(moe_levels, batched_path_matches_its_reference_twin) {
  test::level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int n_tok = 37;
  for_each_moe_layer({tensor_type::f32, tensor_type::q8_0, tensor_type::q4_k}, n_tok, 5,
                     [&](tensor_type, const llama_hparams& hp, const moe_weights& w, const std::vector<float>& x,
                         const std::vector<float>& fast, int active, int l) {
                       EXPECT_EQ(active, hp.moe.n_expert);  // 74 routed rows reach every one of 8 experts
                       std::vector<float> ref(x.size());
                       moe_ffn_ref(hp.moe, w, x.data(), n_tok, ref.data());
                       const double scale = rms_of(ref);
                       int flipped = 0;
                       double worst = 0;
                       for (int i = 0; i < n_tok; ++i) {
                         double token_max = 0;
                         for (int j = 0; j < hp.n_embd; ++j) {
                           const std::size_t k = static_cast<std::size_t>(i) * hp.n_embd + j;
                           token_max = std::max(token_max, std::fabs(static_cast<double>(fast[k]) - ref[k]));
                         }
                         if (token_max > 1e-5 * scale) ++flipped;
                         worst = std::max(worst, token_max);
                       }
                       EXPECT_LE(flipped, 2) << "layer " << l;
                       EXPECT_LE(worst, 3e-3 * scale) << "layer " << l;
                     });
}

// Quantized experts against the exactly dequantized weights in f64 with f32
// activations. The only difference is the activation quantization of each
// product (q8_0 blocks of 32 for q8_0 weights, q8_K blocks of 256 for q4_K):
// each activation moves by at most half a step, amax / 254 of its block, a
// relative error of about 0.6% (q8_0) to 0.8% (q8_K) RMS per product,
// twice over (x into gate/up, the SwiGLU output into down, whose products
// of two Gaussians have heavier tails, so larger block maxima). Bound: RMS
// difference 4% and max difference 20% of the output's RMS (measured: 1.1%
// and 5.6% with q8_0, 1.9% and 8.6% with q4_K); a wrong expert, slice or
// weight moves outputs by their whole size, 100%.
TEST_P(moe_levels, quantized_experts_match_the_dequantized_reference) {
  test::level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int n_tok = 21;
  for_each_moe_layer({tensor_type::q8_0, tensor_type::q4_k}, n_tok, 9,
                     [&](tensor_type t, const llama_hparams& hp, const moe_weights& w, const std::vector<float>& x,
                         const std::vector<float>& fast, int, int l) {
                       const std::vector<float> ref = dequantized_moe(hp.moe, w, x, n_tok);
                       const double scale = rms_of(ref);
                       const diff d = compare(fast, ref);
                       EXPECT_LE(d.rms, 0.04 * scale) << "layer " << l;
                       EXPECT_LE(d.max_abs, 0.20 * scale) << "layer " << l;
                       std::printf("[ moe ] %-5s %-6s layer %d: max abs %.3g, rms %.3g, of output rms %.3g\n",
                                   gguf::tensor_type_name(t), simd_level_name(GetParam()), l, d.max_abs, d.rms, scale);
                     });
}

INSTANTIATE_TEST_SUITE_P(levels, moe_levels, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

// ---------------------------------------------------------------------------
// A batch of sequences in one step
// ---------------------------------------------------------------------------

// Runs each sequence's prompt (all logits), then `decode` steps of one token
// each, every sequence in the same steps (together) or each on its own.
// Returns each sequence's logits rows and, through runs, the expert FFNs run.
std::vector<std::vector<float>> run_sequences(const llama_model& m, const std::vector<std::vector<token_id>>& prompts,
                                              int decode, bool together, std::int64_t& prompt_runs) {
  const llama_hparams& hp = m.hparams();
  constexpr int k_block = 16;
  std::vector<std::vector<block_id>> tables(prompts.size());
  int next_block = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const int n_blocks = (static_cast<int>(prompts[i].size()) + decode + k_block - 1) / k_block;
    for (int b = 0; b < n_blocks; ++b) tables[i].emplace_back(next_block++);
  }
  auto kv = kv_storage::create(
      kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, k_block, kv_type::f32, kv_type::f32), next_block);
  EXPECT_TRUE(kv.ok());
  std::vector<std::vector<float>> out(prompts.size());
  std::vector<std::vector<token_id>> tokens = prompts;
  prompt_runs = 0;
  const std::vector<std::size_t> all = [&] {
    std::vector<std::size_t> v(prompts.size());
    std::iota(v.begin(), v.end(), 0);
    return v;
  }();
  std::vector<std::vector<std::size_t>> groups;
  if (together) groups.push_back(all);
  else
    for (std::size_t i : all) groups.push_back({i});
  for (const std::vector<std::size_t>& group : groups) {
    llama_context ctx(m, **kv, 2);
    std::vector<float> logits;
    for (int step = 0; step <= decode; ++step) {
      std::vector<forward_seq> seqs;
      for (std::size_t i : group) {
        const std::vector<token_id>& t = tokens[i];
        if (step == 0) seqs.push_back(forward_seq::consecutive(t, 0, tables[i], true));
        else
          seqs.push_back(forward_seq::consecutive(std::span<const token_id>(t).last(1), static_cast<int>(t.size()) - 1,
                                                  tables[i], false));
      }
      const std::int64_t before = ctx.moe_expert_runs();
      status st = ctx.forward(seqs, logits);
      EXPECT_TRUE(st.ok()) << st.message();
      if (step == 0) prompt_runs += ctx.moe_expert_runs() - before;
      std::size_t row = 0;
      for (std::size_t i : group) {
        const std::size_t n_rows = step == 0 ? tokens[i].size() : 1;
        const auto* first = logits.data() + row * hp.n_vocab;
        out[i].insert(out[i].end(), first, first + n_rows * hp.n_vocab);
        // The next token: a fixed function of the sequence and step, not of the logits.
        if (step < decode) tokens[i].push_back(static_cast<token_id>(3 + (7 * i + 13 * step) % (hp.n_vocab - 3)));
        row += n_rows;
      }
    }
  }
  return out;
}

// Several sequences (prompts of different lengths, then decode steps) in one
// step give each sequence's logits bit for bit as it alone does, with q8_0
// and q4_K experts (and gpt-oss's sinks, windows and biases with q8_0); the
// step runs each active expert once for all of them (at most n_expert FFNs
// per layer), not once per sequence.
TEST(moe_batch, sequences_together_equal_each_alone) {
  for (auto [preset, t] : {std::pair{"tiny-qwen3moe", tensor_type::q8_0}, std::pair{"tiny-qwen3moe", tensor_type::q4_k},
                           std::pair{"tiny-gpt-oss", tensor_type::q8_0}}) {
    SCOPED_TRACE(std::string(preset) + " " + gguf::tensor_type_name(t));
    auto m = synth_moe(t, synth_mix::none, preset);
    ASSERT_TRUE(m);
    const llama_hparams& hp = m->hparams();
    std::vector<std::vector<token_id>> prompts;
    std::mt19937 rng(3);
    for (int n : {5, 9, 1, 14}) {  // past tiny-gpt-oss's window of 8
      std::vector<token_id> p(static_cast<std::size_t>(n));
      for (token_id& x : p) x = 3 + static_cast<token_id>(rng() % static_cast<unsigned>(hp.n_vocab - 3));
      prompts.push_back(p);
    }
    std::int64_t runs_together = 0, runs_alone = 0;
    const auto together = run_sequences(*m, prompts, 6, true, runs_together);
    const auto alone = run_sequences(*m, prompts, 6, false, runs_alone);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(together[i].size(), (prompts[i].size() + 6) * static_cast<std::size_t>(hp.n_vocab));
      ASSERT_EQ(together[i].size(), alone[i].size());
      for (std::size_t k = 0; k < together[i].size(); ++k)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(together[i][k]), std::bit_cast<std::uint32_t>(alone[i][k]))
            << "sequence " << i << " value " << k;
    }
    EXPECT_LE(runs_together, static_cast<std::int64_t>(hp.n_layer) * hp.moe.n_expert);
    EXPECT_LT(runs_together, runs_alone);
    std::printf("[ moe ] %s prompt step: %lld expert FFNs for 4 sequences together, %lld one at a time\n",
                gguf::tensor_type_name(t), static_cast<long long>(runs_together), static_cast<long long>(runs_alone));
  }
}

// ---------------------------------------------------------------------------
// Load errors
// ---------------------------------------------------------------------------

// A preset's F32 file, opened.
std::unique_ptr<gguf::file> synth_file(const std::string& preset) {
  synth_options o;
  o.preset = preset;
  o.weight_type = tensor_type::f32;
  o.n_threads = 1;
  const std::string path = temp_path(preset);
  EXPECT_TRUE(write_synth_model(o, path).ok());
  auto f = gguf::file::open(path);
  std::remove(path.c_str());
  EXPECT_TRUE(f.ok());
  return f.ok() ? std::move(*f) : nullptr;
}

std::string load_error(const std::vector<std::byte>& bytes) {
  auto f = gguf::file::from_memory(bytes);
  if (!f.ok()) return "unreadable: " + f.error().message();
  auto m = llama_model::from_gguf(std::move(*f));
  return m.ok() ? "loaded" : m.error().message();
}

TEST(moe_load_errors, name_the_key_or_tensor) {
  auto f = synth_file("tiny-qwen3moe");
  ASSERT_TRUE(f);
  auto with = [&](std::initializer_list<std::string_view> drop, const std::function<void(gguf::writer&)>& add) {
    return load_error(test::rewrite_gguf(*f, drop, add));
  };
  EXPECT_EQ(with({}, [](gguf::writer&) {}), "loaded");
  EXPECT_THAT(with({}, [](gguf::writer& w) { w.add_u32("qwen3moe.expert_gating_func", 2); }),
              HasSubstr("qwen3moe.expert_gating_func = 2 (sigmoid): qwen3moe models gate with softmax only"));
  EXPECT_EQ(with({}, [](gguf::writer& w) { w.add_u32("qwen3moe.expert_gating_func", 1); }), "loaded");
  EXPECT_THAT(with({}, [](gguf::writer& w) { w.add_u32("qwen3moe.expert_shared_count", 1); }),
              HasSubstr("qwen3moe.expert_shared_count = 1: shared experts are not supported"));
  EXPECT_THAT(with({}, [](gguf::writer& w) { w.add_u32("qwen3moe.expert_group_count", 4); }),
              HasSubstr("qwen3moe.expert_group_count = 4: expert groups are not supported"));
  EXPECT_THAT(with({"qwen3moe.expert_count"}, [](gguf::writer&) {}),
              HasSubstr("qwen3moe.expert_count = 0: a qwen3moe model needs 1 to 512 experts"));
  EXPECT_THAT(with({"qwen3moe.expert_used_count"}, [](gguf::writer& w) { w.add_u32("qwen3moe.expert_used_count", 9); }),
              HasSubstr("qwen3moe.expert_used_count = 9 must be in 1..8"));
  // Experts of another width than the key says.
  EXPECT_THAT(with({"qwen3moe.expert_feed_forward_length"},
                   [](gguf::writer& w) { w.add_u32("qwen3moe.expert_feed_forward_length", 128); }),
              HasSubstr("tensor blk.0.ffn_gate_exps.weight has shape [256, 256, 8, 1], expected [256, 128, 8]"));
  // A shared expert's tensor.
  const std::vector<float> zeros(256 * 256, 0.0f);
  EXPECT_THAT(with({},
                   [&](gguf::writer& w) {
                     const std::int64_t ne[] = {256, 256};
                     w.add_tensor("blk.1.ffn_up_shexp.weight", tensor_type::f32, ne,
                                  std::as_bytes(std::span<const float>(zeros)));
                   }),
              HasSubstr("tensor blk.1.ffn_up_shexp.weight: this mixture-of-experts feature is not supported"));
  // The normalisation and the scale are honoured, not refused.
  auto m = llama_model::from_gguf(std::move(*gguf::file::from_memory(test::rewrite_gguf(*f, {}, [](gguf::writer& w) {
    w.add_bool("qwen3moe.expert_weights_norm", false);
    w.add_f32("qwen3moe.expert_weights_scale", 2.5f);
  }))));
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_FALSE((*m)->hparams().moe.norm_weights);
  EXPECT_EQ((*m)->hparams().moe.weights_scale, 2.5f);
}

// A dense architecture with experts (Mixtral is `llama` with expert_count 8)
// is refused by its key, not run without its experts.
// gpt-oss: its parts are required, other gating is refused, and qwen3moe
// (whose llama.cpp graph has no biases) refuses the biases gpt-oss uses.
TEST(moe_load_errors, gpt_oss_parts_are_required_and_biases_stay_gpt_oss_only) {
  auto g = synth_file("tiny-gpt-oss");
  ASSERT_TRUE(g);
  auto with = [&](const gguf::file& f, std::initializer_list<std::string_view> drop,
                  const std::function<void(gguf::writer&)>& add) { return load_error(test::rewrite_gguf(f, drop, add)); };
  EXPECT_EQ(with(*g, {}, [](gguf::writer&) {}), "loaded");
  EXPECT_THAT(with(*g, {"blk.1.attn_sinks.weight"}, [](gguf::writer&) {}),
              HasSubstr("missing tensor blk.1.attn_sinks.weight"));
  EXPECT_THAT(with(*g, {"blk.0.ffn_down_exps.bias"}, [](gguf::writer&) {}),
              HasSubstr("missing tensor blk.0.ffn_down_exps.bias"));
  EXPECT_THAT(with(*g, {"gpt-oss.expert_feed_forward_length"}, [](gguf::writer&) {}),
              HasSubstr("missing required key gpt-oss.expert_feed_forward_length"));
  EXPECT_THAT(with(*g, {"gpt-oss.attention.sliding_window"}, [](gguf::writer&) {}),
              HasSubstr("missing required key gpt-oss.attention.sliding_window"));
  EXPECT_THAT(with(*g, {}, [](gguf::writer& w) { w.add_u32("gpt-oss.expert_gating_func", 1); }),
              HasSubstr("gpt-oss.expert_gating_func = 1 (softmax): gpt-oss models gate with softmax_weight only"));
  EXPECT_EQ(with(*g, {}, [](gguf::writer& w) { w.add_u32("gpt-oss.expert_gating_func", 3); }), "loaded");
  auto q = synth_file("tiny-qwen3moe");
  ASSERT_TRUE(q);
  const std::vector<float> zeros(8, 0.0f);
  EXPECT_THAT(with(*q, {},
                   [&](gguf::writer& w) {
                     const std::int64_t ne[] = {8};
                     w.add_tensor("blk.0.ffn_gate_inp.bias", tensor_type::f32, ne,
                                  std::as_bytes(std::span<const float>(zeros)));
                   }),
              HasSubstr("tensor blk.0.ffn_gate_inp.bias: this mixture-of-experts feature is not supported"));
}

TEST(moe_load_errors, a_dense_architecture_with_experts_is_refused) {
  auto f = synth_file("tiny");
  ASSERT_TRUE(f);
  EXPECT_THAT(load_error(test::rewrite_gguf(*f, {}, [](gguf::writer& w) { w.add_u32("llama.expert_count", 8); })),
              HasSubstr("llama.expert_count = 8: mixture-of-experts llama models are not supported (qwen3moe and gpt-oss are)"));
}

}  // namespace
}  // namespace pagoda
