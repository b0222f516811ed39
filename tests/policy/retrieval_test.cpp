#include "policy/retrieval.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "attention/gather_attention.h"
#include "core/cpu.h"
#include "core/half.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"
#include "retrieval_test_util.h"

namespace pagoda {
namespace {

// Rounded to f16, so the HNSW index (f16 copies) ranks the same values as
// the exact f32 reference.
std::vector<float> f16_exact(std::vector<float> x) {
  for (float& v : x) v = fp16_to_f32(f32_to_fp16(v));
  return x;
}

double dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// --- indexes ----------------------------------------------------------------

TEST(retrieval_index, exact_top_k_by_hand) {
  // Keys along the axes with lengths 1..4; q = (1, -1): scores 1, -2, 3, -4.
  const float keys[] = {1, 0, 0, 2, 3, 0, 0, 4};
  const std::int32_t slots[] = {10, 11, 12, 13};
  const float q[] = {1, -1};
  std::vector<std::int32_t> out;
  exact_top_k(q, keys, slots, 4, 2, 2, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{12, 10}));
  out.clear();
  exact_top_k(q, keys, slots, 4, 2, 9, out);  // k past n: all of them, best first
  EXPECT_EQ(out, (std::vector<std::int32_t>{12, 10, 11, 13}));
}

TEST(retrieval_index, l2sq_f16_matches_reference_at_every_level) {
  auto a = gaussian(200, 1), b = gaussian(200, 2);
  std::vector<std::uint16_t> ha(200), hb(200);
  for (int i = 0; i < 200; ++i) {
    ha[i] = f32_to_fp16(a[i]);
    hb[i] = f32_to_fp16(b[i]);
  }
  test::simd_level_guard guard;
  for (simd_level l : test::simd_levels_to_run()) {
    set_simd_level(l);
    for (int n : {0, 1, 15, 16, 17, 128, 200}) {
      const float want = l2sq_f16_ref(ha.data(), hb.data(), n);
      // Float sums in another order: a few ulps of the sum (about 2n).
      EXPECT_NEAR(l2sq_f16(ha.data(), hb.data(), n), want, 1e-5 * (n + 1)) << simd_level_name(l) << " n=" << n;
    }
  }
}

TEST(retrieval_index, dots_f32_matches_reference_at_every_level) {
  test::simd_level_guard guard;
  for (simd_level l : test::simd_levels_to_run()) {
    set_simd_level(l);
    for (int dim : {1, 7, 8, 9, 16, 128, 130})
      for (int n_rows : {0, 1, 3, 4, 5, 9}) {
        const auto q = gaussian(static_cast<std::size_t>(dim), 11);
        const auto rows = gaussian(static_cast<std::size_t>(dim) * n_rows, 12);
        std::vector<float> got(static_cast<std::size_t>(n_rows)), want(got.size());
        dots_f32(q.data(), rows.data(), n_rows, dim, got.data());
        dots_f32_ref(q.data(), rows.data(), n_rows, dim, want.data());
        double mag = 0;  // sum |q_d r_d| bounds the rounding of any summation order
        for (int i = 0; i < n_rows; ++i) {
          mag = 0;
          for (int d = 0; d < dim; ++d) mag += std::fabs(q[d] * rows[static_cast<std::size_t>(i) * dim + d]);
          EXPECT_NEAR(got[i], want[i], 1e-6 * dim * mag + 1e-30) << simd_level_name(l) << " dim=" << dim << " row " << i;
        }
      }
  }
}

// Recall of `got` against the exact top-k of the same keys.
double recall(const std::vector<std::int32_t>& got, const std::vector<std::int32_t>& exact) {
  std::set<std::int32_t> e(exact.begin(), exact.end());
  int hit = 0;
  for (std::int32_t s : got) hit += static_cast<int>(e.count(s));
  return static_cast<double>(hit) / static_cast<double>(exact.size());
}

// HNSW with ef_search >= the number of keys visits the whole (connected)
// graph: its top-k is the exact one, by inner product (the Euclidean
// transform ranks exactly by q.k). Keys and queries are f16 values, so the
// only difference from the reference is the order of float sums; a swap at
// the k-th place is allowed only between scores within 1e-4.
TEST(retrieval_index, hnsw_with_large_ef_is_exact) {
  const int n = 400, hd = 16, k = 10;
  // The second half three times longer: its add raises the norm bound, and
  // the graph is rebuilt.
  auto raw = gaussian(static_cast<std::size_t>(n) * hd, 3);
  for (std::size_t i = raw.size() / 2; i < raw.size(); ++i) raw[i] *= 3.0f;
  const auto keys = f16_exact(raw);
  const auto slots = iota_slots(n, 1000);
  auto ix = make_hnsw_index(hd, hnsw_params{8, 200, 1000});
  ASSERT_TRUE(ix->add(keys.data(), slots.data(), n / 2).ok());
  ASSERT_TRUE(ix->add(&keys[n / 2 * hd], &slots[n / 2], n / 2).ok());
  EXPECT_EQ(ix->size(), n);
  for (int t = 0; t < 50; ++t) {
    const auto q = f16_exact(gaussian(hd, 100 + t));
    std::vector<std::int32_t> got, want;
    ix->search(q.data(), k, got);
    exact_top_k(q.data(), keys.data(), slots.data(), n, hd, k, want);
    ASSERT_EQ(got.size(), static_cast<std::size_t>(k));
    const double kth = dot(q.data(), &keys[static_cast<std::size_t>(want.back() - 1000) * hd], hd);
    for (std::int32_t s : got) EXPECT_GE(dot(q.data(), &keys[static_cast<std::size_t>(s - 1000) * hd], hd), kth - 1e-4);
  }
}

// IVF-PQ is approximate even when every list is probed (the PQ codes lose
// information), so the test bounds recall. Before training it is exact.
TEST(retrieval_index, ivfpq_exact_until_trained_then_bounded_recall) {
  const int hd = 16, k = 10;
  ivfpq_params p;
  p.nlist = 8;
  p.m = 8;  // 2 dimensions per sub-quantizer
  p.nbits = 6;
  p.nprobe = 8;  // every list
  p.n_train = 1000;
  ASSERT_TRUE(check_ivfpq_params(p, hd).ok());
  auto ix = make_ivfpq_index(hd, p);
  const int n = 3000;
  // Clustered keys (as real keys are): 20 centres, spread 0.3.
  const auto centres = gaussian(20 * hd, 4, 2.0f);
  auto keys = gaussian(static_cast<std::size_t>(n) * hd, 5, 0.3f);
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < hd; ++d) keys[static_cast<std::size_t>(i) * hd + d] += centres[(i * 7 % 20) * hd + d];
  const auto slots = iota_slots(n);
  ASSERT_TRUE(ix->add(keys.data(), slots.data(), 600).ok());  // below n_train: exact
  const auto q0 = gaussian(hd, 6);
  std::vector<std::int32_t> got, want;
  ix->search(q0.data(), k, got);
  exact_top_k(q0.data(), keys.data(), slots.data(), 600, hd, k, want);
  EXPECT_EQ(got, want);
  const std::size_t untrained_bytes = ix->memory_bytes();
  EXPECT_GE(untrained_bytes, 600u * hd * sizeof(float));

  ASSERT_TRUE(ix->add(&keys[600 * hd], &slots[600], n - 600).ok());  // trains at 1000, adds the rest
  EXPECT_EQ(ix->size(), n);
  double sum = 0;
  const int n_q = 40;
  for (int t = 0; t < n_q; ++t) {
    auto q = gaussian(hd, 200 + t);
    for (int d = 0; d < hd; ++d) q[d] += centres[(t % 20) * hd + d];
    got.clear();
    want.clear();
    ix->search(q.data(), k, got);
    exact_top_k(q.data(), keys.data(), slots.data(), n, hd, k, want);
    EXPECT_LE(got.size(), static_cast<std::size_t>(k));
    sum += recall(got, want);
  }
  // Chance would be k / n = 0.3%; this seeded case gives 0.48.
  EXPECT_GE(sum / n_q, 0.4) << "mean recall@10 of IVF-PQ with every list probed";
  // Several rows in one call find what one call per row finds.
  const auto rows = gaussian(static_cast<std::size_t>(5) * hd, 300);
  got.clear();
  want.clear();
  ix->search_rows(rows.data(), 5, hd, k, got);
  for (int r = 0; r < 5; ++r) ix->search(&rows[static_cast<std::size_t>(r) * hd], k, want);
  EXPECT_EQ(got, want);
  // PQ codes: 8 bytes a key instead of 64.
  EXPECT_LT(ix->memory_bytes(), static_cast<std::size_t>(n) * hd * sizeof(float));
}

// Searching ourselves (own_coarse, the default: the lists picked with SIMD
// inner products, the PQ table in SIMD, the codes summed by pq_scan) finds
// what faiss's own search finds, with a real head_dim and fewer lists probed
// than there are: the same keys, in the same order but where two scores
// tie to the last bits (the inner products are summed in another order).
TEST(retrieval_index, ivfpq_own_search_equals_faiss_search) {
  const int hd = 128, k = 32, n = 12000;
  ivfpq_params p;
  p.nlist = 64;
  p.m = 16;
  p.nprobe = 6;
  p.n_train = 4000;
  ivfpq_params ref = p;
  ref.own_coarse = false;
  ASSERT_TRUE(check_ivfpq_params(p, hd).ok());
  auto mine = make_ivfpq_index(hd, p);
  auto theirs = make_ivfpq_index(hd, ref);
  const auto centres = gaussian(40 * hd, 21, 1.0f);
  auto keys = gaussian(static_cast<std::size_t>(n) * hd, 22, 0.5f);
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < hd; ++d) keys[static_cast<std::size_t>(i) * hd + d] += centres[(i * 13 % 40) * hd + d];
  const auto slots = iota_slots(n);
  for (auto* ix : {mine.get(), theirs.get()}) ASSERT_TRUE(ix->add(keys.data(), slots.data(), n).ok());
  test::simd_level_guard guard;
  for (simd_level l : test::simd_levels_to_run()) {
    set_simd_level(l);
    int same_order = 0;
    double overlap = 0;
    const int n_q = 24;
    for (int t = 0; t < n_q; ++t) {
      const auto rows = gaussian(static_cast<std::size_t>(4) * hd, 400 + t);
      std::vector<std::int32_t> got, want;
      mine->search_rows(rows.data(), 4, hd, k, got);
      theirs->search_rows(rows.data(), 4, hd, k, want);
      ASSERT_EQ(got.size(), want.size()) << simd_level_name(l);
      same_order += got == want;
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      std::vector<std::int32_t> both;
      std::set_intersection(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(both));
      overlap += static_cast<double>(both.size()) / static_cast<double>(want.size());
    }
    EXPECT_GE(same_order, n_q - 2) << simd_level_name(l);
    EXPECT_GE(overlap / n_q, 0.995) << simd_level_name(l);
  }
}

// pq_scan against the sum written out, code by code, in m order: bit for bit.
TEST(retrieval_index, pq_scan_sums_the_table_in_order) {
  for (int m_sub : {1, 4, 16}) {
    const auto table = gaussian(static_cast<std::size_t>(m_sub) * 256, 31);
    for (int n : {0, 1, 3, 4, 5, 17}) {
      std::vector<std::uint8_t> codes(static_cast<std::size_t>(n) * m_sub);
      for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>((i * 37 + 11) % 256);
      std::vector<float> got(static_cast<std::size_t>(n));
      pq_scan(table.data(), m_sub, codes.data(), n, 0.25f, got.data());
      for (int i = 0; i < n; ++i) {
        float want = 0.25f;
        for (int m = 0; m < m_sub; ++m) want += table[static_cast<std::size_t>(m) * 256 + codes[static_cast<std::size_t>(i) * m_sub + m]];
        EXPECT_EQ(got[i], want) << "m_sub " << m_sub << " n " << n << " code " << i;
      }
    }
  }
}

TEST(retrieval_index, remove_from_and_clear) {
  const int n = 300, hd = 8;
  const auto keys = f16_exact(gaussian(static_cast<std::size_t>(n) * hd, 9));
  const auto slots = iota_slots(n);
  ivfpq_params ip;
  ip.nlist = 4;
  ip.m = 4;
  ip.nbits = 2;
  ip.nprobe = 4;
  ip.n_train = 160;  // trains at 160 (faiss wants 39 keys per centroid: 156)
  std::vector<std::unique_ptr<key_index>> all;
  all.push_back(make_exact_index(hd));
  all.push_back(make_hnsw_index(hd, hnsw_params{8, 100, 400}));
  all.push_back(make_ivfpq_index(hd, ip));
  for (auto& ix : all) {
    ASSERT_TRUE(ix->add(keys.data(), slots.data(), n).ok());
    ix->remove_from(200);
    EXPECT_EQ(ix->size(), 200);
    for (int t = 0; t < 10; ++t) {
      std::vector<std::int32_t> got;
      ix->search(gaussian(hd, 50 + t).data(), 50, got);
      EXPECT_FALSE(got.empty());
      for (std::int32_t s : got) EXPECT_LT(s, 200);
    }
    // Slots forgotten can come back (a rollback, then the block is written again).
    ASSERT_TRUE(ix->add(&keys[200 * hd], &slots[200], 100).ok());
    EXPECT_EQ(ix->size(), n);
    EXPECT_GT(ix->memory_bytes(), 0u);
    ix->clear();
    EXPECT_EQ(ix->size(), 0);
    std::vector<std::int32_t> got;
    ix->search(keys.data(), 5, got);
    EXPECT_TRUE(got.empty());
  }
}

// --- parameters -------------------------------------------------------------

kv_policy_spec spec(std::vector<std::pair<std::string, std::string>> params) {
  kv_policy_spec s;
  s.name = "retrieval";
  s.params = std::move(params);
  return s;
}

// memory_bytes() keeps a running count between calls (the engine asks every
// step): asked after every change, it ends where an index asked only at the
// end does, through growth, a rebuild for a longer key, removal and clear.
TEST(retrieval_index, hnsw_memory_count_is_the_same_asked_often_or_once) {
  const int n = 400, hd = 8;
  auto raw = gaussian(static_cast<std::size_t>(n) * hd, 11);
  for (int d = 0; d < hd; ++d) raw[static_cast<std::size_t>(300 * hd + d)] *= 8.0f;  // a longer key: a rebuild
  const auto keys = f16_exact(raw);
  const auto slots = iota_slots(n);
  // Asked after every change; asked once after the additions; asked once at the end.
  auto often = make_hnsw_index(hd, hnsw_params{8, 100, 64});
  auto mid = make_hnsw_index(hd, hnsw_params{8, 100, 64});
  auto once = make_hnsw_index(hd, hnsw_params{8, 100, 64});
  std::size_t last = 0;
  auto both = [&](auto op) {
    op(*often);
    op(*once);
    last = often->memory_bytes();
  };
  for (int at = 0; at < n; at += 50) {
    both([&](key_index& ix) { ASSERT_TRUE(ix.add(&keys[static_cast<std::size_t>(at) * hd], &slots[at], 50).ok()); });
    ASSERT_TRUE(mid->add(&keys[static_cast<std::size_t>(at) * hd], &slots[at], 50).ok());
    EXPECT_GT(last, 0u);
  }
  EXPECT_EQ(last, mid->memory_bytes());
  both([&](key_index& ix) { ix.remove_from(200); });
  both([&](key_index& ix) { ix.clear(); });
  EXPECT_EQ(last, 0u);
  both([&](key_index& ix) { ASSERT_TRUE(ix.add(keys.data(), slots.data(), 100).ok()); });
  EXPECT_EQ(often->memory_bytes(), once->memory_bytes());
  EXPECT_GT(once->memory_bytes(), 0u);
}

TEST(retrieval_params, defaults_and_values) {
  auto p = parse_retrieval_params(spec({}));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->index, retrieval_index_kind::auto_);
  EXPECT_EQ(p->auto_min, 16384);
  EXPECT_EQ(p->exact_max, 1024);
  EXPECT_TRUE(p->background);
  EXPECT_EQ(p->resolve_k(100000), 128);
  p = parse_retrieval_params(spec({{"auto_min", "20000"}, {"nprobe", "8"}, {"background", "0"}, {"recall_every", "0"}}));
  ASSERT_TRUE(p.ok()) << p.error().message();  // auto builds IVF-PQ: its parameters apply
  EXPECT_EQ(p->auto_min, 20000);
  EXPECT_EQ(p->index_from(), 20000);
  EXPECT_EQ(p->ivfpq.nprobe, 8);
  EXPECT_FALSE(p->background);
  EXPECT_EQ(p->recall_every, 0);
  p = parse_retrieval_params(spec({{"k", "1%"}, {"index", "ivfpq"}, {"nlist", "64"}, {"pq_m", "8"}, {"sinks", "0"}}));
  ASSERT_TRUE(p.ok()) << p.error().message();
  EXPECT_EQ(p->resolve_k(1000), 10);
  EXPECT_EQ(p->resolve_k(10), 1);
  EXPECT_EQ(p->ivfpq.nlist, 64);
  EXPECT_EQ(p->sinks, 0);
  p = parse_retrieval_params(spec({{"k", "0.25"}, {"index", "hnsw"}, {"ef_search", "200"}}));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->resolve_k(1000), 250);
  EXPECT_EQ(p->hnsw.ef_search, 200);
  EXPECT_TRUE(make_retrieval_policy(spec({{"index", "exact"}})).ok());
}

TEST(retrieval_params, bad_values_are_rejected_with_the_parameter_named) {
  const std::vector<std::pair<std::vector<std::pair<std::string, std::string>>, std::string>> bad = {
      {{{"ef", "3"}}, "unknown parameter 'ef'"},
      {{{"index", "lsh"}}, "index=lsh"},
      {{{"k", "0"}}, "k=0"},
      {{{"k", "1.5"}}, "k=1.5"},
      {{{"k", "abc"}}, "k=abc"},
      {{{"k", "-3"}}, "k=-3"},
      {{{"recent", "0"}}, "recent=0"},
      {{{"sinks", "x"}}, "sinks=x"},
      {{{"index", "ivfpq"}, {"ef_search", "10"}}, "ef_search applies to index=hnsw"},
      {{{"index", "exact"}, {"nprobe", "4"}}, "nprobe applies to index=ivfpq"},
      {{{"index", "ivfpq"}, {"auto_min", "4"}}, "auto_min applies to index=auto"},
      {{{"background", "2"}}, "background=2"},
      {{{"recall_every", "-1"}}, "recall_every=-1"},
      {{{"index", "ivfpq"}, {"nlist", "8"}, {"nprobe", "9"}}, "nprobe 9"},
      {{{"index", "ivfpq"}, {"train", "100"}}, "train 100"},
      {{{"index", "hnsw"}, {"m", "1"}}, "m=1"},
  };
  for (const auto& [params, words] : bad) {
    auto p = make_retrieval_policy(spec(params));
    ASSERT_FALSE(p.ok()) << words;
    EXPECT_NE(p.error().message().find(words), std::string::npos) << p.error().message();
  }
  EXPECT_FALSE(check_ivfpq_params(ivfpq_params{256, 12, 8, 16, 0}, 128).ok());  // 12 does not divide 128
}

// --- the selector -----------------------------------------------------------

retrieval_params exact_params(int k) {
  retrieval_params p;
  p.index = retrieval_index_kind::exact;
  p.k_tokens = k;
  p.sinks = 4;
  p.recent = 8;
  p.background = false;
  return p;
}

// Blocks enter the index when they fill, not before; the partial block and
// the recent window are read exactly; the rest is the union of each query
// row's top-k.
TEST(retrieval_selector, indexes_sealed_blocks_and_selects_sinks_topk_window) {
  sequence s("f16", 200);
  retrieval_selector sel(exact_params(5), 1, s.n_kv_heads, s.head_dim);
  s.write(10, sel);
  EXPECT_EQ(sel.sealed_end(0), 0);
  s.write(30, sel);  // 40 slots: blocks 0 and 1 are full
  EXPECT_EQ(sel.sealed_end(0), 32);
  for (int i = 0; i < 7; ++i) s.write(1, sel);  // decode steps: 47 slots
  EXPECT_EQ(sel.sealed_end(0), 32);
  s.write(1, sel);
  EXPECT_EQ(sel.sealed_end(0), 48);
  s.write(100, sel);  // 148
  EXPECT_EQ(sel.sealed_end(0), 144);
  EXPECT_EQ(sel.index_size(0, 1), 0);  // exact: no index

  const paged_kv_view kv = s.kview();
  const auto q = gaussian(static_cast<std::size_t>(2 * s.n_rep) * s.head_dim, 30);
  std::vector<slot_range> out;
  ASSERT_TRUE(sel.select(query(s, kv, 1, q, 2), out));
  // Expected: sinks [0, 4), window [140, 148) (recent 8; the copies end at
  // 144), and each of the 4 query rows' exact top-5 among the sealed keys
  // (decoded f16) of [4, 140).
  std::set<std::int32_t> want;
  for (int i = 0; i < 4; ++i) want.insert(i);
  for (int i = 140; i < 148; ++i) want.insert(i);
  std::vector<float> keys(static_cast<std::size_t>(144) * s.head_dim);
  for (int b = 0; b < 9; ++b) decode_kv_rows(kv, 1, b * 16, 16, &keys[static_cast<std::size_t>(b) * 16 * s.head_dim]);
  const auto slots = iota_slots(136, 4);  // the exact path ranks only the slots it may add
  for (int r = 0; r < 2 * s.n_rep; ++r) {
    std::vector<std::int32_t> top;
    exact_top_k(&q[static_cast<std::size_t>(r) * s.head_dim], &keys[4 * static_cast<std::size_t>(s.head_dim)],
                slots.data(), 136, s.head_dim, 5, top);
    want.insert(top.begin(), top.end());
  }
  std::set<std::int32_t> got;
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_LT(out[i].begin, out[i].end);
    if (i > 0) {
      ASSERT_LT(out[i - 1].end, out[i].begin) << "ranges sorted, disjoint, not touching";
    }
    for (int x = out[i].begin; x < out[i].end; ++x) got.insert(x);
  }
  EXPECT_EQ(got, want);
  EXPECT_GT(sel.memory_bytes(), 2u * 144 * s.head_dim * sizeof(std::uint16_t));  // the f16 copies

  // A prompt chunk past max_tokens reads everything.
  const auto big = gaussian(static_cast<std::size_t>(9 * s.n_rep) * s.head_dim, 31);
  EXPECT_FALSE(sel.select(query(s, kv, 0, big, 9), out));
}

// Retrieval with k = the context length is full attention: the ranges cover
// every slot, and gather_attention over them equals paged_attention's
// reference, for each index kind and a quantized KV.
TEST(retrieval_selector, k_at_context_length_is_full_attention) {
  for (const char* kv_spec : {"f16", "int4"}) {
    for (retrieval_index_kind kind : {retrieval_index_kind::hnsw, retrieval_index_kind::ivfpq, retrieval_index_kind::exact}) {
      sequence s(kv_spec, 300);
      retrieval_params p;
      p.index = kind;
      p.k_tokens = 300;
      p.ivfpq = ivfpq_params{4, 4, 2, 2, 160};
      p.background = false;
      retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
      s.write(250, sel);
      s.write(1, sel);
      s.write(1, sel);  // 252: a partial last block (staged for int4 keys)
      ASSERT_TRUE(sel.error_status().ok()) << sel.error_status().message();
      const paged_kv_view kv = s.kview(), vv = s.vview();
      const auto q = gaussian(s.row() * s.n_rep, 40);
      std::vector<float> got(q.size(), NAN), want(q.size(), NAN);
      gather_scratch sc;
      for (int h = 0; h < s.n_kv_heads; ++h) {
        std::vector<slot_range> ranges;
        ASSERT_TRUE(sel.select(query(s, kv, h, q, 1), ranges));
        ASSERT_EQ(ranges, (std::vector<slot_range>{{0, s.n}}));
        std::vector<std::int32_t> slots;
        append_slots_of_ranges(ranges, slots);
        attention_task t;
        t.k = &kv;
        t.v = &vv;
        t.kv_head = h;
        t.n_rep = s.n_rep;
        t.head_dim = s.head_dim;
        t.scale = 0.25f;
        t.q = q.data();
        t.q_stride = s.row() * s.n_rep;
        t.n_tokens = 1;
        t.q_pos = &s.pos[s.n - 1];
        t.kv_pos = s.pos.data();
        t.n_kv = s.n;
        t.out = got.data();
        t.out_stride = t.q_stride;
        gather_attention(t, slots, sc, sel.key_rows_of(0, h));  // f16: sealed keys from the selector's copy
        t.out = want.data();
        paged_attention_ref(t);
      }
      // Tolerances of gather_attention_test.cpp: the AVX-512 integer kernels
      // quantize the query (2e-3); float rounding otherwise.
      const double tol = std::string(kv_spec) == "f16" ? 2e-5 : 2e-3;
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << kv_spec << " i=" << i;
    }
  }
}

// Rollbacks forget the slots past the last whole block left; a compaction
// forgets everything, and the next write indexes the sealed blocks again.
TEST(retrieval_selector, slots_changed) {
  sequence s("f16", 200);
  retrieval_params p = exact_params(3);
  p.index = retrieval_index_kind::hnsw;
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
  s.write(100, sel);
  EXPECT_EQ(sel.indexed_end(0, 0), 96);
  s.n = 70;  // the engine truncated to 70 slots: block 4 keeps 6, blocks 5 and 6 none
  s.kv->truncate_block(s.table[4], 6);
  s.kv->truncate_block(s.table[5], 0);
  s.kv->truncate_block(s.table[6], 0);
  sel.on_slots_changed(70, true);
  EXPECT_EQ(sel.indexed_end(0, 1), 64);
  EXPECT_EQ(sel.index_size(0, 0), 64);
  const paged_kv_view kv = s.kview();
  const auto q = gaussian(s.row(), 50);
  std::vector<slot_range> out;
  ASSERT_TRUE(sel.select(query(s, kv, 0, q, 1), out));
  EXPECT_EQ(out.back(), (slot_range{62, 70}));  // recent 8
  for (const slot_range& r : out) EXPECT_LE(r.end, 70);
  s.write(30, sel);  // 100 again: blocks 4 and 5 come back
  EXPECT_EQ(sel.indexed_end(0, 0), 96);
  EXPECT_EQ(sel.index_size(0, 1), 96);

  sel.on_slots_changed(100, false);
  EXPECT_EQ(sel.indexed_end(0, 0), 0);
  EXPECT_EQ(sel.index_size(0, 0), 0);
  s.write(1, sel);
  EXPECT_EQ(sel.indexed_end(0, 1), 96);
  EXPECT_EQ(sel.index_size(0, 0), 96);
}

// The token-major key copy (key_rows_of) holds exactly the decoded keys of
// the indexed slots (zeros for dead ones) and follows rollbacks and
// compactions; quantized keys that f16 does not hold exactly get no copy.
TEST(retrieval_selector, key_rows_copy_the_indexed_keys) {
  auto expect_copy = [](const sequence& s, const retrieval_selector& sel) {
    const paged_kv_view kv = s.kview();
    std::vector<float> x(s.head_dim);
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const key_rows r = sel.key_rows_of(0, h);
      ASSERT_EQ(r.n_slots, sel.sealed_end(0));
      for (int slot = 0; slot < r.n_slots; ++slot) {
        decode_kv_rows(kv, h, slot, 1, x.data());
        for (int d = 0; d < s.head_dim; ++d)
          ASSERT_EQ(fp16_to_f32(r.row(slot, s.head_dim)[d]), s.pos[slot] < 0 ? 0.0f : x[d])
              << "slot " << slot;
      }
    }
  };
  sequence s("f16", 200);
  for (int i = 0; i < 5; ++i) s.pos[i] = -1;
  retrieval_selector sel(exact_params(3), 1, s.n_kv_heads, s.head_dim);
  s.write(40, sel);
  expect_copy(s, sel);
  s.write(60, sel);
  expect_copy(s, sel);
  EXPECT_EQ(sel.key_rows_of(0, 1).n_slots, 96);
  s.n = 70;
  s.kv->truncate_block(s.table[4], 6);
  s.kv->truncate_block(s.table[5], 0);
  s.kv->truncate_block(s.table[6], 0);
  sel.on_slots_changed(70, true);
  EXPECT_EQ(sel.key_rows_of(0, 0).n_slots, 64);
  s.write(30, sel);
  expect_copy(s, sel);
  sel.on_slots_changed(100, false);
  EXPECT_EQ(sel.key_rows_of(0, 0).n_slots, 0);
  s.write(1, sel);
  expect_copy(s, sel);

  sequence q("int8", 100);
  retrieval_selector qsel(exact_params(3), 1, q.n_kv_heads, q.head_dim);
  q.write(100, qsel);
  EXPECT_EQ(qsel.sealed_end(0), 96);
  EXPECT_EQ(qsel.key_rows_of(0, 0).chunks, nullptr);
  EXPECT_EQ(qsel.key_rows_of(0, 0).n_slots, 0);
}

// Dead slots lead the row: they are never indexed and the sinks are the
// first live slots.
TEST(retrieval_selector, dead_slots_are_skipped) {
  sequence s("f32", 100);
  for (int i = 0; i < 20; ++i) s.pos[i] = -1;
  retrieval_params p = exact_params(2);
  p.index = retrieval_index_kind::hnsw;
  retrieval_selector sel(p, 1, s.n_kv_heads, s.head_dim);
  s.write(100, sel);
  EXPECT_EQ(sel.index_size(0, 0), 96 - 20);
  const paged_kv_view kv = s.kview();
  const auto q = gaussian(s.row(), 60);
  std::vector<slot_range> out;
  ASSERT_TRUE(sel.select(query(s, kv, 0, q, 1), out));
  EXPECT_EQ(out.front(), (slot_range{20, 24}));
}

}  // namespace
}  // namespace pagoda
