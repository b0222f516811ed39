#include "spec/draft_view.h"

#include <algorithm>

#include "policy/kv_policy.h"

namespace pagoda {

bool window_view_selector::select(const kv_select_query& q, std::vector<slot_range>& out) {
  out.clear();
  // Every query row of the step must see its own newest slots: the window
  // ends at the last slot and reaches back `window` from the first query's.
  const int n_queries = q.n_rep > 0 ? q.n_rows / q.n_rep : 1;
  const std::int64_t begin_recent = static_cast<std::int64_t>(q.n_kv) - n_queries - window_ + 1;
  if (begin_recent <= sinks_) return false;  // the view is the whole cache
  if (sinks_ > 0) out.push_back({0, sinks_});
  out.push_back({static_cast<std::int32_t>(begin_recent), q.n_kv});
  return true;
}

result<std::unique_ptr<kv_read_selector>> make_draft_view(const spec_config& config, int n_layers, int n_kv_heads,
                                                          int head_dim) {
  switch (config.view) {
    case draft_view::full:
    case draft_view::int4:  // the mirror's every slot (cpu_runner_draft.cpp)
    case draft_view::int2: return std::unique_ptr<kv_read_selector>();
    case draft_view::window:
      return std::unique_ptr<kv_read_selector>(std::make_unique<window_view_selector>(config.sinks, config.window));
    case draft_view::quest: {
      PAGODA_ASSIGN_OR_RETURN(const kv_policy_spec spec, parse_kv_policy_spec(quest_view_spec(config)));
      PAGODA_ASSIGN_OR_RETURN(auto policy, make_kv_policy(spec));
      return policy->make_selector(n_layers, n_kv_heads, head_dim);
    }
  }
  return std::unique_ptr<kv_read_selector>();
}

}  // namespace pagoda
