// What a model drafter (self, early-exit; speculative.h) reads of the
// target's KV in its draft passes: a sparse-read selector (kv_selector.h)
// made per sequence from the drafter's spec, used only in those passes. The
// KV itself is the target's: a selector view reads less of it, never other
// bytes; the mirror views (int4, int2) read a cheaper copy of it instead.
#pragma once

#include <memory>

#include "attention/kv_selector.h"
#include "pagoda/status.h"
#include "spec/speculative.h"

namespace pagoda {

// The first `sinks` slots and the newest `window` (StreamingLLM's view of a
// cache: attention sinks plus a recent window). Reads everything while the
// context fits in sinks + window.
class window_view_selector final : public kv_read_selector {
 public:
  window_view_selector(int sinks, int window) : sinks_(sinks), window_(window) {}
  bool select(const kv_select_query& q, std::vector<slot_range>& out) override;

 private:
  int sinks_;
  int window_;
};

// The selector of config's view for a model of this shape; nullptr for
// view=full and the mirror views int4, int2 (the draft passes read every
// slot, of the cache or of its mirror). Errors: a quest view the
// policy code refuses (its budget).
result<std::unique_ptr<kv_read_selector>> make_draft_view(const spec_config& config, int n_layers, int n_kv_heads,
                                                          int head_dim);

}  // namespace pagoda
