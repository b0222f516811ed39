// The batched forward pass: every new token of every sequence in the step goes
// through each weight matrix together (one read of the weights per step);
// attention then runs per (sequence, KV head) over the paged cache.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "model/llama.h"

#include "attention/gather_attention.h"
#include "model/vec_ops.h"

namespace pagoda {
namespace {

constexpr double k_min_parallel_flops = 2e5;

// Rotates pairs of q or k in place for one token at position pos: adjacent pairs
// (x[2i], x[2i+1]) for llama, halves (x[i], x[i + rope_dim/2]) for NeoX style.
void apply_rope(float* x, int n_heads, int head_dim, int rope_dim, bool neox, const float* cos_t, const float* sin_t) {
  const int half = rope_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + static_cast<std::size_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      int a = neox ? i : 2 * i;
      int b = neox ? i + half : 2 * i + 1;
      float x0 = v[a], x1 = v[b];
      v[a] = x0 * cos_t[i] - x1 * sin_t[i];
      v[b] = x0 * sin_t[i] + x1 * cos_t[i];
    }
  }
}

// The cos/sin tables of every token of the step for one kind of layer:
// [tokens][rope_dim / 2] each, with YaRN's magnitude factor.
struct rope_tables {
  std::vector<float> cos_t, sin_t;
  void fill(const std::vector<std::int32_t>& positions, int n_tok, const rope_angles& angles) {
    const std::size_t half = static_cast<std::size_t>(angles.n_pairs());
    cos_t.resize(static_cast<std::size_t>(n_tok) * half);
    sin_t.resize(cos_t.size());
    for (int i = 0; i < n_tok; ++i) angles.at(positions[i], true, &cos_t[i * half], &sin_t[i * half]);
  }
};

// Per-row RMSNorm of n rows of width w, in place, with one weight vector.
void rms_norm_rows(float* x, int n, int w, const std::vector<float>& weight, float eps) {
  for (int i = 0; i < n; ++i) rms_norm(x + static_cast<std::size_t>(i) * w, weight.data(), w, eps, x + static_cast<std::size_t>(i) * w);
}

}  // namespace

// Whether sparse ranges hold scattered tokens rather than whole blocks: less
// than half the slots of the blocks they touch.
bool scattered(std::span<const slot_range> ranges, int block_size) {
  std::int64_t selected = 0, touched = 0;
  std::int32_t last_block = -1;
  for (const slot_range& r : ranges) {
    selected += r.end - r.begin;
    const std::int32_t b0 = std::max(r.begin / block_size, last_block + 1), b1 = (r.end - 1) / block_size;
    if (b1 >= b0) touched += b1 - b0 + 1;
    last_block = std::max(last_block, b1);
  }
  return 2 * selected < touched * block_size;
}

void rotate_keys(const llama_hparams& hp, int layer, float* k, int n, const std::int32_t* delta) {
  const std::size_t half = static_cast<std::size_t>(hp.rope_dim) / 2;
  std::vector<float> c(half), s(half);
  // A pure rotation: the key already carries YaRN's magnitude from its forward pass.
  const rope_angles angles = hp.layer_rope_angles(layer);
  for (int i = 0; i < n; ++i) {
    angles.at(delta[i], false, c.data(), s.data());
    apply_rope(k + static_cast<std::size_t>(i) * hp.kv_dim(), hp.n_head_kv, hp.head_dim, hp.rope_dim, hp.rope_neox,
               c.data(), s.data());
  }
}

bool llama_context::select_reads(const forward_seq& s, attention_task& t, int layer, attention_scratch& sc) const {
  // The selector sees the queries as attention will: pre-scaled, one row per
  // (token, query head of this KV head's group).
  const int rows = t.n_tokens * t.n_rep;
  sc.select_q.resize(static_cast<std::size_t>(rows) * t.head_dim);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* src = t.q + static_cast<std::size_t>(i) * t.q_stride +
                         static_cast<std::size_t>(t.kv_head * t.n_rep + j) * t.head_dim;
      float* dst = sc.select_q.data() + static_cast<std::size_t>(i * t.n_rep + j) * t.head_dim;
      for (int d = 0; d < t.head_dim; ++d) dst[d] = src[d] * t.scale;
    }
  kv_select_query q;
  q.layer = layer;
  q.kv_head = t.kv_head;
  q.k = t.k;
  q.kv = &kv_;
  q.kv_pos = std::span<const std::int32_t>(t.kv_pos, static_cast<std::size_t>(t.n_kv));
  q.n_kv = t.n_kv;
  q.q = sc.select_q.data();
  q.n_rows = rows;
  q.n_rep = t.n_rep;
  q.head_dim = t.head_dim;
  q.q_pos = std::span<const std::int32_t>(t.q_pos, static_cast<std::size_t>(t.n_tokens));
  sc.select_ranges.clear();
  if (!s.selector->select(q, sc.select_ranges)) return false;
  t.ranges = sc.select_ranges;
  return true;
}

llama_context::llama_context(const llama_model& model, kv_backend& kv, int n_threads)
    : model_(model), kv_(kv), pool_(n_threads) {
  attn_scratch_.resize(pool_.size());
  gather_scratch_.resize(pool_.size());
  gather_slots_.resize(pool_.size());
}

void llama_context::ensure_capacity(int n_tokens) {
  if (n_tokens <= capacity_) return;
  const llama_hparams& hp = model_.hparams();
  std::size_t n = static_cast<std::size_t>(n_tokens);
  x_.resize(n * hp.n_embd * sizeof(float));
  xn_.resize(n * std::max(hp.n_embd, hp.q_dim()) * sizeof(float));
  q_.resize(n * hp.q_dim() * sizeof(float));
  k_.resize(n * hp.kv_dim() * sizeof(float));
  v_.resize(n * hp.kv_dim() * sizeof(float));
  attn_out_.resize(n * hp.q_dim() * sizeof(float));
  tmp_.resize(n * hp.n_embd * sizeof(float));
  const std::size_t dense_ff = hp.moe.n_expert > 0 ? 0 : static_cast<std::size_t>(hp.n_ff);  // MoE: moe_scratch
  gate_.resize(n * dense_ff * sizeof(float));
  up_.resize(n * dense_ff * sizeof(float));
  capacity_ = n_tokens;
}

namespace {
std::span<const block_id> table_of(const forward_seq& s, int group) {
  return s.tables.empty() ? s.blocks : s.tables[static_cast<std::size_t>(group)];
}
}  // namespace

namespace {

// The slots a sequence's rows [first, first + n) read: the stored ones and the
// new ones up to the part's last; rows rewriting in place read the stored ones.
int n_kv_of(const forward_seq& s, int first, int n) { return s.slots.empty() ? s.n_stored + first + n : s.n_stored; }

}  // namespace

status llama_context::forward(std::span<const forward_seq> seqs, std::vector<float>& logits, int n_layers,
                              bool kv_only) {
  const llama_hparams& hp = model_.hparams();
  const kv_layout& layout = kv_.layout();
  if (layout.n_model_layers() != hp.n_layer || layout.n_kv_heads != hp.n_head_kv || layout.head_dim != hp.head_dim)
    return error(errc::invalid_argument, "KV storage layout does not match the model");
  if (n_layers < 0 || n_layers > hp.n_layer)
    return error(errc::invalid_argument, "a forward pass through {} of the model's {} layers", n_layers, hp.n_layer);
  const int n_run = n_layers > 0 ? n_layers : hp.n_layer;

  int n_tok = 0, n_rows = 0;
  std::size_t n_kv_total = 0;
  for (const forward_seq& s : seqs) {
    if (s.tokens.empty()) return error(errc::invalid_argument, "a sequence in the step has no tokens");
    const bool in_place = !s.slots.empty();
    std::int64_t end = static_cast<std::int64_t>(s.n_stored) + (in_place ? 0 : static_cast<std::int64_t>(s.tokens.size()));
    if (in_place) {
      if (s.slots.size() != s.tokens.size())
        return error(errc::invalid_argument, "{} new tokens rewrite {} slots", s.tokens.size(), s.slots.size());
      if (s.rows_as_steps || s.stats || s.selector || s.row_positions)
        return error(errc::invalid_argument, "tokens rewritten in place read the cache as it is: no statistics, "
                     "selector, per-row positions or per-row steps");
      for (std::size_t j = 0; j < s.slots.size(); ++j) {
        if (s.slots[j] < 0 || s.slots[j] >= s.n_stored || (j > 0 && s.slots[j] <= s.slots[j - 1]))
          return error(errc::invalid_argument, "rewritten slot {} is not an increasing stored slot (of {})",
                       s.slots[j], s.n_stored);
        const std::int32_t stored = s.stored_positions.empty() ? s.slots[j] : s.stored_positions[s.slots[j]];
        if (!s.positions.empty() && s.positions[j] != stored)
          return error(errc::invalid_argument, "a token rewriting slot {} at position {}, which holds position {}",
                       s.slots[j], s.positions[j], stored);
      }
      if (layout.has_sealed())
        return error(errc::unsupported, "a sealed KV format encodes whole blocks: its slots are not rewritten one by one");
    }
    if (!s.tables.empty() && s.tables.size() != static_cast<std::size_t>(kv_.n_groups()))
      return error(errc::invalid_argument, "{} block tables for {} KV groups", s.tables.size(), kv_.n_groups());
    for (int g = 0; g < kv_.n_groups(); ++g) {
      const std::span<const block_id> table = table_of(s, g);
      if (s.n_stored < 0 || end > static_cast<std::int64_t>(table.size()) * layout.block_size)
        return error(errc::out_of_range, "sequence needs {} KV slots but its block table holds {}", end,
                     table.size() * layout.block_size);
      // NULL entries only where no new token writes (a sliding window's past).
      for (std::size_t i = 0; i < table.size(); ++i) {
        const block_id b = table[i];
        if (!b.valid() && static_cast<std::int64_t>(i + 1) * layout.block_size <= s.n_stored) continue;
        if (b.value < 0 || b.value >= kv_.n_blocks() || kv_.group_of(b) != g)
          return error(errc::invalid_argument, "block id {} is outside the pool of {} or of another KV group",
                       b.value, kv_.n_blocks());
      }
    }
    if (!s.positions.empty() && s.positions.size() != s.tokens.size())
      return error(errc::invalid_argument, "{} new tokens but {} positions", s.tokens.size(), s.positions.size());
    if (!s.stored_positions.empty() && s.stored_positions.size() != static_cast<std::size_t>(s.n_stored))
      return error(errc::invalid_argument, "{} stored slots but {} stored positions", s.n_stored,
                   s.stored_positions.size());
    for (token_id t : s.tokens)
      if (t < 0 || t >= hp.n_vocab) return error(errc::invalid_argument, "token id {} outside the vocabulary of {}", t, hp.n_vocab);
    if (!s.embeddings.empty() && s.embeddings.size() != s.tokens.size() * static_cast<std::size_t>(hp.n_embd))
      return error(errc::invalid_argument, "{} input embedding values for {} new tokens of width {}",
                   s.embeddings.size(), s.tokens.size(), hp.n_embd);
    if (!s.embedded.empty() && (s.embeddings.empty() || s.embedded.size() != s.tokens.size()))
      return error(errc::invalid_argument, "an embedding mask of {} entries for {} new tokens{}", s.embedded.size(),
                   s.tokens.size(), s.embeddings.empty() ? " without embeddings" : "");
    if (!s.see_until.empty()) {
      if (s.see_until.size() != s.tokens.size() || in_place || s.rows_as_steps)
        return error(errc::invalid_argument, "{} visibility bounds for {} new tokens{}", s.see_until.size(),
                     s.tokens.size(), in_place || s.rows_as_steps ? " rewritten in place or read as steps" : "");
      const std::size_t n = s.tokens.size();
      auto pos = [&](std::size_t j) { return s.positions.empty() ? s.n_stored + static_cast<std::int32_t>(j) : s.positions[j]; };
      for (std::size_t j = 0; j < n; ++j)
        if (s.see_until[j] < pos(j) || s.see_until[j] > pos(n - 1))
          return error(errc::invalid_argument, "new token {} at position {} sees up to position {}, outside [{}, {}]", j,
                       pos(j), s.see_until[j], pos(j), pos(n - 1));
    }
    n_tok += static_cast<int>(s.tokens.size());
    n_rows += s.all_logits ? static_cast<int>(s.tokens.size()) : 1;
    n_kv_total += static_cast<std::size_t>(end);
  }
  if (n_tok == 0) {
    logits.clear();
    return {};
  }
  ensure_capacity(n_tok);

  const int E = hp.n_embd, QD = hp.q_dim(), KVD = hp.kv_dim(), FF = hp.n_ff, HD = hp.head_dim;
  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* q = q_.as<float>();
  float* k = k_.as<float>();
  float* v = v_.as<float>();
  float* attn = attn_out_.as<float>();
  float* tmp = tmp_.as<float>();
  float* gate = gate_.as<float>();
  float* up = up_.as<float>();

  // Positions: of every new token (RoPE, masks), and per sequence of every KV
  // slot it sees (stored, then new), strictly increasing.
  positions_.resize(n_tok);
  see_.clear();
  kv_positions_.resize(n_kv_total);
  std::vector<std::size_t> kv_pos_at(seqs.size());
  {
    int i = 0;
    std::size_t at = 0;
    for (std::size_t si = 0; si < seqs.size(); ++si) {
      const forward_seq& s = seqs[si];
      kv_pos_at[si] = at;
      for (int j = 0; j < s.n_stored; ++j) kv_positions_[at++] = s.stored_positions.empty() ? j : s.stored_positions[j];
      for (std::size_t j = 0; j < s.tokens.size(); ++j, ++i) {
        if (!s.slots.empty()) {  // rewriting stored slots: at their positions, which are stored already
          positions_[i] = s.stored_positions.empty() ? s.slots[j] : s.stored_positions[s.slots[j]];
          continue;
        }
        positions_[i] = s.positions.empty() ? s.n_stored + static_cast<int>(j) : s.positions[j];
        kv_positions_[at++] = positions_[i];
      }
      if (!s.see_until.empty()) {  // a bidirectional span in the step: bounds for every row (causal: its own)
        if (see_.empty()) see_.assign(static_cast<std::size_t>(n_tok), -1);
        std::copy(s.see_until.begin(), s.see_until.end(), see_.begin() + (i - static_cast<int>(s.tokens.size())));
      }
      for (std::size_t j = kv_pos_at[si] + 1; j < at && !s.row_positions; ++j)
        if (kv_positions_[j] <= kv_positions_[j - 1])
          return error(errc::invalid_argument, "KV positions must increase: {} follows {}", kv_positions_[j],
                       kv_positions_[j - 1]);
      if (s.stats) s.stats->reset(layout.n_layers, hp.n_head_kv, static_cast<int>(at - kv_pos_at[si]),
                                  std::clamp(s.stats_window, 0, static_cast<int>(s.tokens.size())));
    }
    // Input rows: the token's embedding (scaled on gemma), or the caller's
    // embedding as it is (llama.cpp scales neither an image's embeddings).
    i = 0;
    for (const forward_seq& s : seqs) {
      for (std::size_t j = 0; j < s.tokens.size(); ++j, ++i) {
        float* row = x + static_cast<std::size_t>(i) * E;
        if (!s.embeddings.empty() && (s.embedded.empty() || s.embedded[j] != 0)) {
          std::copy_n(s.embeddings.data() + j * static_cast<std::size_t>(E), E, row);
          continue;
        }
        dequantize_row(model_.token_embd(), s.tokens[j], row);
        if (hp.embd_scale != 1.0f)
          for (int e = 0; e < E; ++e) row[e] *= hp.embd_scale;
      }
    }
  }
  // RoPE tables: one set for the global layers, one more when local layers
  // rotate with another base or scale (gemma3).
  rope_tables rope_global, rope_local;
  rope_global.fill(positions_, n_tok, rope_angles(hp.rope_scaling, hp.rope_dim, hp.rope_base, hp.rope_freq_scale));
  for (int l = 0; l < hp.n_layer; ++l)
    if (hp.layer_rope_base(l) != hp.rope_base || hp.layer_rope_scale(l) != hp.rope_freq_scale) {
      rope_local.fill(positions_, n_tok, hp.layer_rope_angles(l));
      break;
    }

  // Attention parts: a sequence's rows [first, first + n), read through views
  // of its first n_stored + first + n slots. One part per sequence, but
  // rows_as_steps cuts before each row at a block's last slot (forward_seq):
  // the rows before it read their block staged, it and the rows after it
  // (in the next block) read it as codes.
  struct attn_part {
    int seq;
    int first;
    int n;
    int row0;  // first row of the part in the step
  };
  std::vector<attn_part> parts;
  std::vector<int> full_part(seqs.size());  // per sequence: its part that views every slot (its last)
  {
    int row0 = 0;
    for (int si = 0; si < static_cast<int>(seqs.size()); ++si) {
      const forward_seq& s = seqs[si];
      const int n = static_cast<int>(s.tokens.size());
      // Statistics and sparse reads are per step: each row its own part, read,
      // selected and counted as plain decoding would. Otherwise rows share a
      // part up to a block's last slot (a sealed format's staged read).
      const bool each_row = s.rows_as_steps && (s.stats || s.selector);
      const bool split = s.rows_as_steps && !each_row;
      for (int first = 0; first < n;) {
        int end = first + 1;
        while (end < n && !each_row && !(split && (s.n_stored + end) % layout.block_size == layout.block_size - 1))
          ++end;
        parts.push_back({si, first, end - first, row0 + first});
        first = end;
      }
      full_part[si] = static_cast<int>(parts.size()) - 1;
      row0 += n;
    }
  }
  // Attention work items: (part, KV head), split statically over threads.
  struct attn_item {
    int seq;
    int part;
    int head;
  };
  std::vector<attn_item> items;
  for (int pi = 0; pi < static_cast<int>(parts.size()); ++pi)
    for (int h = 0; h < hp.n_head_kv; ++h) items.push_back({parts[pi].seq, pi, h});
  std::vector<paged_kv_view> k_views(parts.size()), v_views(parts.size());
  std::vector<std::uint8_t> sparse_items(items.size(), 0);  // per item: its selector read less than everything
  std::vector<kv_read_counts> read_items(items.size());     // per item, this layer: for forward_seq::reads
  double attn_flops = 0;
  for (const forward_seq& s : seqs)
    attn_flops += 4.0 * s.tokens.size() * (s.n_stored + s.tokens.size()) * hp.n_head * hp.head_dim;

  // MiniCache (kv/kv_merge.h): a merged pair's lower layer keeps its K/V of
  // this step's tokens here for the upper layer, which merges its own into them.
  std::vector<float> merge_k, merge_v;
  for (int l = 0; l < n_run; ++l) {
    const llama_layer& L = model_.layers()[l];
    const rope_tables& rope = hp.is_swa(l) && !rope_local.cos_t.empty() ? rope_local : rope_global;
    const int window = hp.is_swa(l) ? hp.sliding_window : 0;
    for (int i = 0; i < n_tok; ++i)
      rms_norm(x + static_cast<std::size_t>(i) * E, L.attn_norm.data(), E, hp.rms_eps, xn + static_cast<std::size_t>(i) * E);
    // Cross-layer sharing (kv_layout::layer_map): the layer reads KV layer
    // kvl, and computes and writes it only as its producer. A layer without
    // K/V projections writes nothing either: its KV comes from elsewhere.
    const int kvl = layout.kv_layer_of(l);
    // A merged pair's upper layer computes its K/V too and stores them merged.
    const bool merges = layout.merges_kv(l) && L.wk.data != nullptr;
    const bool computes_kv = (layout.writes_kv(l) || merges) && L.wk.data != nullptr;
    const bool last_kv_only = kv_only && l == n_run - 1;  // its K/V, nothing after them
    if (!last_kv_only) matmul(L.wq, xn, n_tok, q, pool_, mm_scratch_);
    if (computes_kv) {
      matmul(L.wk, xn, n_tok, k, pool_, mm_scratch_);
      matmul(L.wv, xn, n_tok, v, pool_, mm_scratch_);
    }
    for (int i = 0; i < n_tok; ++i) {
      if (!L.bq.empty() && !last_kv_only) add_inplace(q + static_cast<std::size_t>(i) * QD, L.bq.data(), QD);
      if (!L.bk.empty() && computes_kv) {
        add_inplace(k + static_cast<std::size_t>(i) * KVD, L.bk.data(), KVD);
        add_inplace(v + static_cast<std::size_t>(i) * KVD, L.bv.data(), KVD);
      }
      if (!L.q_norm.empty() && !last_kv_only)  // per head, before RoPE
        rms_norm_rows(q + static_cast<std::size_t>(i) * QD, hp.n_head, HD, L.q_norm, hp.rms_eps);
      if (!L.k_norm.empty() && computes_kv)
        rms_norm_rows(k + static_cast<std::size_t>(i) * KVD, hp.n_head_kv, HD, L.k_norm, hp.rms_eps);
      const float* ct = &rope.cos_t[static_cast<std::size_t>(i) * hp.rope_dim / 2];
      const float* st = &rope.sin_t[static_cast<std::size_t>(i) * hp.rope_dim / 2];
      if (!last_kv_only) apply_rope(q + static_cast<std::size_t>(i) * QD, hp.n_head, HD, hp.rope_dim, hp.rope_neox, ct, st);
      if (computes_kv)
        apply_rope(k + static_cast<std::size_t>(i) * KVD, hp.n_head_kv, HD, hp.rope_dim, hp.rope_neox, ct, st);
    }
    if (computes_kv && !merges && layout.merged(kvl)) {
      merge_k.assign(k, k + static_cast<std::size_t>(n_tok) * KVD);
      merge_v.assign(v, v + static_cast<std::size_t>(n_tok) * KVD);
    }
    {
      int row0 = 0;
      // Rows [at, at + run) of this step into slots [slot, slot + run).
      auto store = [&](int kv_layer, std::span<const block_id> table, int slot, int run, int at) {
        const std::size_t off = static_cast<std::size_t>(at) * KVD;
        if (merges) kv_.merge_write(kv_layer, table, slot, run, k + off, v + off, merge_k.data() + off, merge_v.data() + off);
        else kv_.write(kv_layer, table, slot, run, k + off, v + off);
      };
      for (std::size_t si = 0; si < seqs.size(); ++si) {
        const forward_seq& s = seqs[si];
        int n = static_cast<int>(s.tokens.size());
        const std::span<const block_id> table = table_of(s, kv_.layer_group(kvl));
        if (computes_kv && s.slots.empty()) store(kvl, table, s.n_stored, n, row0);
        for (int j = 0; computes_kv && j < n && !s.slots.empty();) {  // in place: runs of consecutive slots
          int run = 1;
          while (j + run < n && s.slots[j + run] == s.slots[j] + run) ++run;
          store(kvl, table, s.slots[j], run, row0 + j);
          j += run;
        }
        for (int pi = full_part[si]; pi >= 0 && parts[pi].seq == static_cast<int>(si); --pi) {
          const int n_slots = n_kv_of(s, parts[pi].first, parts[pi].n);
          k_views[pi] = kv_.k_view(kvl, table, n_slots);
          v_views[pi] = kv_.v_view(kvl, table, n_slots);
          if (merges) kv_.attach_merge(kvl, k_views[pi], v_views[pi]);
        }
        if (s.selector && !hp.is_swa(l) && computes_kv && !merges)
          s.selector->on_layer_written(
              kvl, k_views[full_part[si]],
              std::span<const std::int32_t>(kv_positions_.data() + kv_pos_at[si], static_cast<std::size_t>(s.n_stored + n)),
              s.n_stored + n);
        row0 += n;
      }
    }
    if (last_kv_only) break;
    auto attend = [&](int ith, int nth) {
      std::size_t b, e;
      split_range(items.size(), ith, nth, 1, b, e);
      for (std::size_t it = b; it < e; ++it) {
        const attn_item& a = items[it];
        const forward_seq& s = seqs[a.seq];
        const attn_part& part = parts[a.part];
        attention_task t;
        t.k = &k_views[a.part];
        t.v = &v_views[a.part];
        t.kv_head = a.head;
        t.n_rep = hp.n_rep();
        t.head_dim = HD;
        t.scale = hp.attn_scale;
        t.window = window;
        t.softcap = hp.attn_softcap;
        t.sinks = L.attn_sinks.empty() ? nullptr : L.attn_sinks.data();
        t.q = q + static_cast<std::size_t>(part.row0) * QD;
        t.q_stride = QD;
        t.n_tokens = part.n;
        t.q_pos = positions_.data() + part.row0;
        t.q_see = see_.empty() || s.see_until.empty() ? nullptr : see_.data() + part.row0;
        t.kv_pos = s.row_positions
                       ? s.row_positions + static_cast<std::size_t>(kvl * hp.n_head_kv + a.head) * s.row_stride
                       : kv_positions_.data() + kv_pos_at[a.seq];
        t.n_kv = n_kv_of(s, part.first, part.n);
        t.out = attn + static_cast<std::size_t>(part.row0) * QD;
        t.out_stride = QD;
        if (s.stats) t.stats = s.stats->out(kvl, a.head);  // a shared KV layer's readers add up
        if (s.stats && s.rows_as_steps) {
          // One row per part, parts in parallel: a row adds its weights to
          // its own window row only (forward_seq::rows_as_steps).
          const int row = part.first - (static_cast<int>(s.tokens.size()) - s.stats->n_window);
          t.stats.accumulated = nullptr;
          t.stats.window = row >= 0 ? t.stats.window + static_cast<std::size_t>(row) * s.stats->n_kv : nullptr;
          t.stats.n_window = row >= 0 ? 1 : 0;
        }
        // A bidirectional span's step reads densely: a selector chooses by causal positions.
        const bool sparse =
            s.selector && !hp.is_swa(l) && s.see_until.empty() && select_reads(s, t, kvl, attn_scratch_[ith]);
        if (s.reads && s.slots.empty())
          read_items[it] = count_reads(t.n_kv, t.n_tokens, window, layout.block_size, sparse, t.ranges);
        if (sparse) {
          sparse_items[it] = 1;
          // Scattered tokens (retrieval's top-k) are gathered one by one;
          // runs of whole blocks (Quest's pages) go through paged attention.
          if (!s.stats && !t.k->merge && scattered(t.ranges, layout.block_size)) {
            std::vector<std::int32_t>& slots = gather_slots_[ith];
            slots.clear();
            append_slots_of_ranges(t.ranges, slots);
            gather_attention(t, slots, gather_scratch_[ith], s.selector->key_rows_of(kvl, a.head));
            continue;
          }
        }
        paged_attention(t, attn_scratch_[ith]);
      }
    };
    // Waking threads costs microseconds; tiny attention (small models, short
    // contexts) runs on the calling thread. Results are the same either way.
    if (attn_flops < k_min_parallel_flops) attend(0, 1);
    else pool_.run(attend);
    for (std::size_t it = 0; it < items.size(); ++it) {
      const forward_seq& s = seqs[items[it].seq];
      if (sparse_items[it] && s.sparse) *s.sparse = true;
      if (s.reads) *s.reads += read_items[it];
    }
    matmul(L.wo, attn, n_tok, tmp, pool_, mm_scratch_);
    if (!L.bo.empty())
      for (int i = 0; i < n_tok; ++i) add_inplace(tmp + static_cast<std::size_t>(i) * E, L.bo.data(), E);
    if (!L.post_attn_norm.empty()) rms_norm_rows(tmp, n_tok, E, L.post_attn_norm, hp.rms_eps);
    add_inplace(x, tmp, static_cast<std::int64_t>(n_tok) * E);

    for (int i = 0; i < n_tok; ++i)
      rms_norm(x + static_cast<std::size_t>(i) * E, L.ffn_norm.data(), E, hp.rms_eps, xn + static_cast<std::size_t>(i) * E);
    if (!L.moe.empty()) {  // routed experts instead of the dense FFN (model/moe.h)
      moe_ffn(hp.moe, L.moe, xn, n_tok, tmp, pool_, mm_scratch_, moe_);
      add_inplace(x, tmp, static_cast<std::int64_t>(n_tok) * E);
      continue;
    }
    matmul(L.w_gate, xn, n_tok, gate, pool_, mm_scratch_);
    matmul(L.w_up, xn, n_tok, up, pool_, mm_scratch_);
    if (hp.gelu) gelu_mul(gate, up, static_cast<std::int64_t>(n_tok) * FF, gate);
    else silu_mul(gate, up, static_cast<std::int64_t>(n_tok) * FF, gate);
    matmul(L.w_down, gate, n_tok, tmp, pool_, mm_scratch_);
    if (!L.post_ffn_norm.empty()) rms_norm_rows(tmp, n_tok, E, L.post_ffn_norm, hp.rms_eps);
    add_inplace(x, tmp, static_cast<std::int64_t>(n_tok) * E);
  }

  if (kv_only) {
    logits.clear();
    return {};
  }
  // Final norm and logits only for the rows asked for.
  {
    int i = 0, r = 0;
    for (const forward_seq& s : seqs) {
      int n = static_cast<int>(s.tokens.size());
      int first = s.all_logits ? 0 : n - 1;
      for (int j = first; j < n; ++j, ++r)
        rms_norm(x + static_cast<std::size_t>(i + j) * E, model_.output_norm().data(), E, hp.rms_eps,
                 xn + static_cast<std::size_t>(r) * E);
      i += n;
    }
  }
  logits.resize(static_cast<std::size_t>(n_rows) * hp.n_vocab);
  matmul(model_.output(), xn, n_rows, logits.data(), pool_, mm_scratch_);
  if (hp.final_softcap > 0)
    for (int r = 0; r < n_rows; ++r)
      softcap_inplace(logits.data() + static_cast<std::size_t>(r) * hp.n_vocab, hp.n_vocab, hp.final_softcap);
  return {};
}

}  // namespace pagoda
