// The engine core: one model, one KV backend, a scheduler and a runner, and
// the step that joins them (DESIGN.md):
//
//   plan = scheduler.schedule()       which sequences, how many tokens, which block ops
//   runner.execute(plan, out)         block ops, loads, one batched forward pass, samples
//   scheduler.update(plan, out, ...)  commit what was computed and sampled, finish by tokens
//   output.process(events)            text, stop strings, latencies (output_processor.h)
//
// One thread owns an engine core (no locks inside); engine_loop puts it on a
// thread of its own for servers. `pagoda run`, `perplexity`, `batch` and
// `serve` all drive this same core.
//
// Batch invariance: with f32 KV a sequence's logits do not depend on what else
// shares its steps, so greedy results under any load equal those of running it
// alone (the forward pass and attention keep every row independent).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/assert.h"
#include "kv/kv_storage.h"
#include "model/llama.h"
#include "pagoda/events.h"
#include "pagoda/request.h"
#include "pagoda/status.h"
#include "sched/cpu_runner.h"
#include "sched/output_processor.h"
#include "sched/scheduler.h"

namespace pagoda {

// A class of KV blocks of another type, for prompt segments that ask for it
// (kv_manager.h, kv_storage.h): its layout (the default's shape, its own
// formats), its blocks, and the type as the user named it.
struct kv_segment_class {
  std::string name;
  kv_layout layout;
  std::int64_t n_blocks = 0;
};

// One KV group of an engine (kv_group.h): its kind, its layers, its blocks per class.
struct engine_kv_group {
  kv_group_kind kind = kv_group_kind::full;
  int window_tokens = 0;
  std::vector<int> layers;
  std::vector<std::int64_t> class_blocks;  // [class]: 0 the default type, then kv_classes'
  // The draft model's KV (speculative `draft`): `layers` are its layers, in
  // layouts of its own shape (draft_kv_layout), blocks as many as group 0's.
  bool draft = false;
  // The mirror of the KV that speculative `self:view=int4|int2` drafts read
  // (cpu_runner_draft.cpp): every model layer, in layouts of the model's
  // shape in this KV type (mirror_kv_layout), blocks as many as group 0's.
  // Empty: not a mirror.
  std::string mirror;
};

struct engine_core_config {
  int n_threads = 0;                  // 0: every core
  int max_model_len = 0;              // 0: the model's trained context
  int max_num_seqs = 64;              // sequences running at once (also the staging slots of sealed KV formats)
  int max_num_batched_tokens = 2048;  // tokens per step (decode + prompt chunks)
  bool enable_prefix_caching = true;
  cache_eviction prefix_cache_eviction = cache_eviction::lfu;  // scheduler_config::prefix_cache_eviction
  kv_layout kv;                       // types and block size (n_layers etc. must match the model)
  std::int64_t n_blocks = 0;          // pool size in blocks (the default type's; classes have their own)
  bool kv_huge_pages = false;         // the pool's tiles in huge pages, faulted in at create (kv_pool_memory)
  std::vector<kv_segment_class> kv_classes;  // extra KV classes, 1, 2, ... (none: one type)
  std::map<std::string, std::int32_t> tenant_quota_blocks;
  int max_waiting = 1 << 20;          // requests queued at once (the server sets a limit)
  scheduling_policy scheduling = scheduling_policy::cache_aware;  // scheduler_config::scheduling
  int max_passed_steps = 16;
  int attention_stats_window = -1;    // >= 0: collect attention statistics (scheduler.h)
  std::string kv_policy = "none";     // the default KV policy of requests (policy/kv_policy.h)
  std::string kv_image_type;          // of image spans that name none (scheduler_config::kv_image_type)
  std::string kv_image_policy;
  int n_embd = 0;                     // the width of image rows (create() sets the model's)
  std::string speculative = "none";   // the default speculative decoding of requests (spec/speculative.h)
  // The draft model of speculative `draft` (--draft-model), or null. Its
  // vocabulary must be the model's; its KV is one more KV group. It must
  // outlive the engine.
  const llama_model* draft_model = nullptr;
  // Sliding-window layers keep only their window in a KV group of their own
  // (kv_group.h): beside full-attention layers (Gemma 2/3) a small group of
  // window_blocks blocks per class (0: planned by plan_kv_groups); when every
  // layer slides (Mistral v0.1) the one group is a sliding window. Off
  // (--swa-full): every layer in one full-attention group, as llama.cpp's swa_full.
  bool free_out_of_window = true;
  std::int64_t window_blocks = 0;
  // The groups create() planned (plan_kv_groups), group 0 first.
  std::vector<engine_kv_group> groups;
};

// The KV groups of a model under this configuration: one full-attention
// group of every layer; or, when sliding-window layers keep only their
// window, a full group of the others and a sliding-window group of about one
// window plus a step's tokens per sequence (unless that would not be fewer
// blocks than the full group's: then one full group), or one sliding-window
// group of every layer when every layer slides. Group 0's class blocks are
// config.n_blocks and the kv_classes' own.
std::vector<engine_kv_group> plan_kv_groups(const llama_hparams& hp, const engine_core_config& config);
// The layout's KV layers by the attention of the layers that read them:
// full, and sliding-window. Shared KV layers count once (kv_layout::layer_map).
void split_kv_layers(const llama_hparams& hp, const kv_layout& kv, std::vector<int>& full, std::vector<int>& windowed);
// The blocks per class a sliding-window group of this model needs at most.
std::int64_t window_group_blocks(const llama_hparams& hp, const engine_core_config& config);

// The layout of a draft model's KV for one KV class: the class's formats of
// its first layer on every draft layer, in the draft's shape (calibrated
// static scales are the target's: the draft's KV is f16 where the class has them).
kv_layout draft_kv_layout(const kv_layout& target_class, const llama_hparams& draft);

// The layout of the KV mirror of type `type` ("int4", "int2", as
// --kv-cache-dtype takes it) for one KV class: target_class's shape over
// every layer, in that type's default formats, without key summaries.
result<kv_layout> mirror_kv_layout(const kv_layout& target_class, const std::string& type);

// The class whose blocks have the formats `kv_type` (as --kv-cache-dtype
// takes it) gives every layer: 0 for the default layout, i + 1 for
// config.kv_classes[i]. Errors name the types the engine keeps.
result<std::uint8_t> find_kv_class(const engine_core_config& config, const std::string& kv_type);

class engine_core {
 public:
  static result<std::unique_ptr<engine_core>> create(const llama_model& model, const engine_core_config& config);
  ~engine_core();

  // See scheduler::add_request / abort_request.
  status add_request(request req);
  bool abort_request(const std::string& id);
  bool has_work() const { return sched_.has_work(); }
  bool has_pending_ops() const { return sched_.has_pending_ops(); }
  // Applies the block ops a finished run left (see scheduler::has_pending_ops),
  // so that the commit hook has seen every cached block. Call it when has_work()
  // turns false and before tearing down a warehouse.
  void flush(std::vector<engine_event>& events);

  // Runs one step and appends what it produced. A runner failure (an error
  // status or an exception such as std::bad_alloc) fails the requests of that
  // step with "error" events; the engine stays usable. Returns whether the
  // step computed anything (false: nothing could run, e.g. everything is pending).
  bool step(std::vector<engine_event>& events);

  // Hooks (step_plan.h, model_runner): the eviction hook gets every block
  // evicted from the prefix cache with its bytes; the source feeds the load path.
  void set_eviction_hook(eviction_hook hook) { runner_->set_eviction_hook(std::move(hook)); }
  void set_commit_hook(commit_hook hook) { runner_->set_commit_hook(std::move(hook)); }
  // Refs name each block's layout: its group's layers in its class's formats.
  void set_kv_source(kv_block_source* source);
  // [KV group][KV class]: the layout fingerprint that group's blocks of that class are stored under.
  std::vector<std::vector<std::uint64_t>> block_layouts() const;
  // Puts another runner in front of the CPU one (failure injection in tests,
  // instrumentation): `wrap` receives the current runner and returns its
  // replacement, which forwards the hooks (runner_wrapper) to it.
  void wrap_runner(const std::function<std::unique_ptr<model_runner>(std::unique_ptr<model_runner>)>& wrap) {
    runner_ = wrap(std::move(runner_));
  }

  kv_metrics kv_stats() const { return sched_.kv().metrics(); }
  const engine_stats& stats() const { return sched_.stats(); }
  const engine_core_config& config() const { return config_; }
  const llama_model& model() const { return model_; }
  const kv_storage& storage() const { return *storage_; }
  kv_manager& kv() { return sched_.kv(); }
  scheduler& sched() { return sched_; }

 private:
  engine_core(const llama_model& model, const engine_core_config& config, std::unique_ptr<kv_storage> storage);

  const llama_model& model_;
  engine_core_config config_;
  std::unique_ptr<kv_storage> storage_;
  std::unique_ptr<kv_group_backend> draft_kv_;  // the draft model's view of its group (config.draft_model)
  std::unique_ptr<kv_group_backend> mirror_kv_;  // the mirror group as the model's backend (engine_kv_group::mirror)
  scheduler sched_;
  output_processor output_;
  std::unique_ptr<model_runner> runner_;
};

// The scheduler's view of an engine configuration.
scheduler_config scheduler_config_of(const engine_core_config& config);

}  // namespace pagoda
