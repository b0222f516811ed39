// A runner without a model, for scheduler tests. It keeps its own simulated
// KV (a token id and a position per slot of every block), changed only by the
// block ops, loads and writes the plans ask for, and its "model" reads that KV
// back: the logits of a query row are one-hot on a hash of every (token,
// position) the row can see through its block table. So any bookkeeping slip
// (a wrong table, a stale or unwritten block shared, a position off by one)
// changes the generated tokens, and results can be compared with a run of the
// same request alone. Its per-sequence state (block tables, positions,
// samplers) is the real runner_state's, brought up to date by the plans'
// deltas like any runner's: a delta the scheduler forgets shows up the same
// way, and positions_match says whether the stored positions it holds are
// those its KV slots were written at.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "sched/runner_state.h"
#include "sched/step_plan.h"

namespace pagoda::test {

// The fake model: the next token after seeing `visible` (token, position) pairs.
inline token_id fake_next(const std::vector<std::pair<token_id, std::int32_t>>& visible, int n_vocab) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& [t, p] : visible) {
    h ^= static_cast<std::uint64_t>(t) * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(p);
    h *= 1099511628211ull;
  }
  return static_cast<token_id>(3 + h % static_cast<std::uint64_t>(n_vocab - 3));  // never BOS/EOS/unk
}

class fake_runner final : public model_runner {
 public:
  static constexpr token_id k_poison = -7;

  // make_policy: where sparse-read selectors come from (none by default: the fake reads everything).
  fake_runner(std::int32_t n_blocks, std::int32_t block_size, int n_vocab, runner_state::policy_factory make_policy = {})
      : bs_(block_size),
        n_vocab_(n_vocab),
        kv_(static_cast<std::size_t>(n_blocks) * block_size, {k_poison, -1}),
        state_(runner_shape{1, 1, 8, block_size}, std::move(make_policy)) {}

  // The step (counted from 0) that fails part way: its sequences' K/V are
  // written, then the step reports an error.
  std::optional<int> fail_at;
  // What the external source holds: key -> the block's slots.
  std::map<block_key, std::vector<std::pair<token_id, std::int32_t>>> source;
  // Evicted blocks, as the eviction hook would store them.
  std::map<block_key, std::vector<std::pair<token_id, std::int32_t>>> evicted;
  std::vector<step_plan> plans;  // every plan executed, for inspection
  int n_steps = 0;
  // Attention statistics to report: every visible slot gets this weight per row.
  int stats_layers = 1, stats_heads = 1;

  std::pair<token_id, std::int32_t>& slot(block_id b, int i) {
    return kv_[static_cast<std::size_t>(b.value) * bs_ + static_cast<std::size_t>(i)];
  }

  // The hooks see what the fake KV holds: a block's (token, position) pairs as bytes.
  void set_eviction_hook(eviction_hook hook) override { on_evict_ = std::move(hook); }
  void set_commit_hook(commit_hook hook) override { on_cache_ = std::move(hook); }
  // Loads read `source` (a fake_source answers for it), not this.
  void set_kv_source(kv_block_source* source) override { source_ = source; }

  // The runner's copy of seq's table of group 0 (empty when it holds none).
  std::vector<block_id> table_of(seq_id seq) {
    const runner_state::sequence* s = state_.find(seq);
    return s && !s->tables.empty() ? s->tables.front() : std::vector<block_id>{};
  }
  const runner_state& state() const { return state_; }

  void execute(const step_plan& plan, step_output& out) override {
    const int step = n_steps++;
    plans.push_back(plan);
    out.result = ok_status();
    for (const kv_op& op : plan.ops) apply(op);
    out.loaded.assign(plan.loads.size(), 0);
    for (std::size_t i = 0; i < plan.loads.size(); ++i) {
      const auto it = source.find(plan.loads[i].ref.key);
      if (it == source.end()) continue;
      for (int j = 0; j < bs_; ++j) slot(plan.loads[i].block, j) = it->second[static_cast<std::size_t>(j)];
      out.loaded[i] = 1;
    }
    out.result = state_.apply(plan);
    if (!out.result.ok()) return;
    out.stats.resize(plan.seqs.size());
    for (std::size_t si = 0; si < plan.seqs.size(); ++si) {
      const scheduled_seq& q = plan.seqs[si];
      const runner_state::sequence& s = *state_.find(q.seq);
      const std::vector<block_id>& table = s.tables.front();
      for (int i = 0; i < q.n_stored; ++i) {  // what the runner holds agrees with what its KV holds
        const block_id b = table[static_cast<std::size_t>(i / bs_)];
        if (b.valid() && slot(b, i % bs_).second != s.positions[static_cast<std::size_t>(i)]) positions_match = false;
      }
      for (std::size_t j = 0; j < q.tokens.size(); ++j) {
        const std::size_t at = static_cast<std::size_t>(q.n_stored) + j;
        slot(table[at / bs_], static_cast<int>(at % bs_)) = {q.tokens[j], q.positions[j]};
      }
    }
    if (fail_at && step == *fail_at) {
      out.result = error(errc::internal, "injected failure at step {}", step);
      return;
    }
    std::vector<float> logits;
    for (std::size_t si = 0; si < plan.seqs.size(); ++si) {
      const scheduled_seq& q = plan.seqs[si];
      const std::vector<block_id>& table = state_.find(q.seq)->tables.front();
      const int n_kv = q.n_stored + static_cast<int>(q.tokens.size());
      if (q.stats_window >= 0) {
        // The window's rows (SnapKV's observation window): each of the step's
        // last stats_window tokens weighs every slot it sees alike.
        const int n_window = std::min(q.stats_window, static_cast<int>(q.tokens.size()));
        out.stats[si].reset(stats_layers, stats_heads, n_kv, n_window);
        for (int w = 0; w < n_window; ++w) {
          const std::int32_t at = q.positions[q.tokens.size() - static_cast<std::size_t>(n_window - w)];
          for (int s = 0; s < n_kv; ++s)
            if (slot(table[static_cast<std::size_t>(s / bs_)], s % bs_).second <= at)
              for (int l = 0; l < stats_layers; ++l)
                for (int h = 0; h < stats_heads; ++h)
                  out.stats[si].window_at(l, h)[static_cast<std::size_t>(w) * n_kv + static_cast<std::size_t>(s)] = 1.0f;
        }
      }
      const std::size_t first_row = q.every_row() ? 0 : q.tokens.size() - 1;
      for (std::size_t j = first_row; j < q.tokens.size(); ++j) {
        std::vector<std::pair<token_id, std::int32_t>> visible;
        for (int s = 0; s < n_kv; ++s) {
          const auto& v = slot(table[static_cast<std::size_t>(s / bs_)], s % bs_);
          if (v.second <= q.positions[j]) {
            visible.push_back(v);
            if (q.stats_window >= 0)
              for (int l = 0; l < stats_layers; ++l)
                for (int h = 0; h < stats_heads; ++h) out.stats[si].accumulated_at(l, h)[s] += 1.0f;
          }
        }
        std::vector<float> row(static_cast<std::size_t>(n_vocab_), 0.0f);
        row[static_cast<std::size_t>(fake_next(visible, n_vocab_))] = 10.0f;
        logits.insert(logits.end(), row.begin(), row.end());
      }
    }
    out.result = state_.sample(plan, logits, n_vocab_, out);
  }

 private:
  void apply(const kv_op& op) {
    switch (op.kind) {
      case kv_op_kind::copy:
        for (int i = 0; i < op.n_tokens; ++i) slot(op.block, i) = slot(op.src, i);
        break;
      case kv_op_kind::truncate:
        for (int i = op.n_tokens; i < bs_; ++i) slot(op.block, i) = {k_poison, -1};
        break;
      case kv_op_kind::release:
        for (int i = 0; i < bs_; ++i) slot(op.block, i) = {k_poison, -1};
        break;
      case kv_op_kind::evict: {
        auto& saved = evicted[op.key];
        saved.clear();
        for (int i = 0; i < bs_; ++i) {
          // The bytes are intact when the eviction is reported.
          if (slot(op.block, i).first != op.tokens[static_cast<std::size_t>(i)]) bytes_intact = false;
          saved.push_back(slot(op.block, i));
        }
        if (on_evict_) on_evict_(bytes_of(op, saved));
        for (int i = 0; i < bs_; ++i) slot(op.block, i) = {k_poison, -1};
        break;
      }
      case kv_op_kind::gather: {
        // Row 0 stands for every row (the fake KV has one).
        const kv_gather& g = *op.gather;
        std::vector<std::pair<token_id, std::int32_t>> moved;
        for (int i = 0; i < g.n; ++i) {
          const std::int32_t src = g.sources[static_cast<std::size_t>(i)];
          moved.push_back(src < 0 ? std::pair<token_id, std::int32_t>{k_poison, -1}
                                  : slot(g.src_table[static_cast<std::size_t>(src / bs_)], src % bs_));
        }
        for (int i = 0; i < g.n; ++i) {
          const int at = g.first + i;
          auto& dst = slot(g.dst_table[static_cast<std::size_t>(at / bs_)], at % bs_);
          dst = moved[static_cast<std::size_t>(i)];
          if (!g.rotate.empty()) dst.second += g.rotate[static_cast<std::size_t>(i)];
        }
        ++n_gathers;
        break;
      }
      case kv_op_kind::cache:
        // A block enters the prefix cache only once its bytes are written.
        if (op.tokens.size() != static_cast<std::size_t>(bs_)) bytes_intact = false;
        for (int i = 0; i < bs_ && i < static_cast<int>(op.tokens.size()); ++i)
          if (slot(op.block, i).first != op.tokens[static_cast<std::size_t>(i)]) bytes_intact = false;
        if (on_cache_) {
          std::vector<std::pair<token_id, std::int32_t>> slots;
          for (int i = 0; i < bs_; ++i) slots.push_back(slot(op.block, i));
          on_cache_(bytes_of(op, slots));
        }
        break;
    }
  }

 public:
  bool bytes_intact = true;
  bool positions_match = true;
  int n_gathers = 0;

 private:
  static kv_block_bytes bytes_of(const kv_op& op, const std::vector<std::pair<token_id, std::int32_t>>& slots) {
    return kv_block_bytes{0, op.key, op.parent, op.tenant, op.tokens,
                          std::as_bytes(std::span(slots.data(), slots.size()))};
  }

  std::int32_t bs_;
  int n_vocab_;
  std::vector<std::pair<token_id, std::int32_t>> kv_;  // [n_blocks][block_size]
  runner_state state_;
  eviction_hook on_evict_;
  commit_hook on_cache_;
  kv_block_source* source_ = nullptr;
};

// An external KV source over a fake runner's `source` map (the runner reads
// the blocks itself); `claimed` keys are announced even when the map lacks them.
class fake_source final : public kv_block_source {
 public:
  explicit fake_source(const fake_runner& r) : r_(r) {}
  int n_available(std::string_view, std::span<const stored_block_ref> refs) override {
    ++n_lookups;
    if (pending_lookups > 0) {
      --pending_lookups;
      return k_source_pending;
    }
    int n = 0;
    while (n < static_cast<int>(refs.size()) && (r_.source.contains(refs[static_cast<std::size_t>(n)].key) ||
                                                 claimed.contains(refs[static_cast<std::size_t>(n)].key)))
      ++n;
    return n;
  }
  std::set<block_key> claimed;
  // n_available() answers k_source_pending this many times (a remote lookup in flight).
  int pending_lookups = 0;
  // settled() answers false this many times after each prefetch (a slow tier).
  int settle_after = 0;
  int n_prefetches = 0;
  void prefetch(std::string_view, std::span<const stored_block_ref> refs) override {
    ++n_prefetches;
    n_held += static_cast<int>(refs.size());
    pending_ = settle_after;
  }
  bool settled(std::string_view, std::span<const stored_block_ref>) override { return pending_-- <= 0; }
  // The fake runner reads the map itself.
  int read(std::string_view, const stored_block_ref&, std::span<std::byte>) override { return -1; }
  void release(std::string_view, std::span<const stored_block_ref> refs) override {
    n_held -= static_cast<int>(refs.size());
  }
  int n_lookups = 0;
  int n_held = 0;  // prefetched and not released: 0 once no sequence loads

 private:
  const fake_runner& r_;
  int pending_ = 0;
};

}  // namespace pagoda::test
