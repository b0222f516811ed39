// The running sequences as a server's /slots shows them (scheduler.h,
// running_sequence): copied on the engine thread into the snapshot readers
// take without waiting for a step.
#include "sched/scheduler_internal.h"

namespace pagoda {

std::vector<running_sequence> scheduler::running_sequences() const {
  std::vector<running_sequence> out;
  out.reserve(running_.size());
  for (const sequence* s : running_) {
    if (s->chunk >= 0) continue;  // a chunk computed alone for reuse: no completion of its own
    const request& req = s->req->req;
    running_sequence r;
    r.seq = s->id.value;
    r.request_id = req.id;
    r.index = s->index;
    r.tenant = req.tenant;
    r.loading = s->phase == seq_phase::loading;
    r.n_prompt = s->n_prompt;
    r.n_cached_prompt = s->req->cached_tokens;
    r.n_computed = s->n_computed;
    r.n_generated = s->n_generated;
    r.max_tokens = req.max_tokens;
    if (s->in_kv && kv_.contains(s->id)) {
      r.n_stored_tokens = kv_.n_stored_tokens(s->id);
      r.n_blocks = static_cast<int>(kv_.block_table(s->id).size());
    }
    r.sampling = req.sampling;
    r.ignore_eos = req.ignore_eos;
    r.kv_policy = req.kv_policy;
    r.speculative = s->spec != nullptr;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace pagoda
