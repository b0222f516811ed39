// The public engine (pagoda/engine.h): a loaded model and an engine core.
#include "pagoda/engine.h"

#include "sched/engine_core.h"
#include "sched/engine_setup.h"

namespace pagoda {

struct engine::impl {
  std::unique_ptr<llama_model> model;
  std::unique_ptr<llama_model> draft;  // --draft-model; before core, which reads it until it goes
  std::unique_ptr<kv_warehouse> warehouse;  // before core: the core uses it until it goes
  std::unique_ptr<engine_core> core;
  engine_info info;
};

result<std::unique_ptr<engine>> engine::create(const engine_config& config) {
  auto p = std::make_unique<impl>();
  PAGODA_ASSIGN_OR_RETURN(p->model, llama_model::load(config.model_path, {config.use_mmap}));
  PAGODA_ASSIGN_OR_RETURN(engine_core_config core_config, make_engine_core_config(*p->model, config));
  PAGODA_ASSIGN_OR_RETURN(p->draft, load_draft_model(config));
  core_config.draft_model = p->draft.get();
  PAGODA_ASSIGN_OR_RETURN(p->core, engine_core::create(*p->model, core_config));
  PAGODA_ASSIGN_OR_RETURN(p->warehouse, make_warehouse(config, *p->model));
  if (p->warehouse) attach_warehouse(*p->core, *p->warehouse);
  const llama_hparams& hp = p->model->hparams();
  engine_info& i = p->info;
  i.model_path = config.model_path;
  i.model_name = hp.name.empty() ? hp.arch : hp.name;
  i.architecture = hp.arch;
  i.n_vocab = hp.n_vocab;
  i.n_ctx = p->core->config().max_model_len;
  const kv_layout& kv = p->core->config().kv;
  i.kv_layout = kv.describe();
  i.kv_block_size = kv.block_size;
  i.kv_blocks = p->core->config().n_blocks;
  const std::vector<engine_kv_group>& groups = p->core->config().groups;
  i.kv_bytes_per_block = kv.select_layers(groups.front().layers).bytes_per_block();
  for (const engine_kv_group& g : groups)
    if (g.kind == kv_group_kind::sliding_window && &g != &groups.front()) {
      i.kv_window_blocks = g.class_blocks.front();
      i.kv_window_block_bytes = kv.select_layers(g.layers).bytes_per_block();
      i.kv_window_tokens = g.window_tokens;
    }
  i.kv_bytes_per_token = static_cast<double>(i.kv_bytes_per_block) / kv.block_size;
  i.kv_bytes_total = p->core->storage().total_bytes();
  return std::unique_ptr<engine>(new engine(std::move(p)));
}

engine::engine(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
engine::~engine() {
  // The last step's cached blocks reach the warehouse before it closes.
  std::vector<engine_event> events;
  if (impl_->core) impl_->core->flush(events);
}

std::vector<token_id> engine::tokenize(std::string_view text, bool add_bos) const {
  return impl_->model->vocab().encode(text, add_bos && impl_->model->vocab().add_bos_default());
}

std::string engine::detokenize(std::span<const token_id> tokens) const { return impl_->model->vocab().decode(tokens); }

bool engine::is_end_of_generation(token_id token) const { return impl_->model->vocab().is_eog(token); }

status engine::add_request(request req) { return impl_->core->add_request(std::move(req)); }
bool engine::abort_request(const std::string& id) { return impl_->core->abort_request(id); }
bool engine::has_work() const { return impl_->core->has_work(); }
void engine::step(std::vector<engine_event>& events) { impl_->core->step(events); }
const engine_info& engine::info() const { return impl_->info; }

speculation_usage engine::speculation() const {
  speculation_usage u;
  for (const auto& [name, d] : impl_->core->stats().spec_decode) {
    u.n_drafts += d.n_drafts;
    u.n_draft_tokens += d.n_draft_tokens;
    u.n_accepted_tokens += d.n_accepted_tokens;
    u.draft_seconds += d.draft_seconds;
    u.verify_seconds += d.verify_seconds;
  }
  return u;
}

namespace {

// The sliding-window group's peak blocks (0 without one).
std::int32_t window_peak(const kv_metrics& m) {
  for (std::size_t g = 1; g < m.groups.size(); ++g)
    if (m.groups[g].kind == "sliding_window") return m.groups[g].n_used_peak;
  return 0;
}

}  // namespace

kv_usage engine::usage() const {
  const kv_metrics m = impl_->core->kv_stats();
  return {m.n_blocks_used,        m.n_blocks_used_peak, m.n_blocks_cached,
          m.n_prefix_hit_tokens, m.n_preemptions,      window_peak(m)};
}

}  // namespace pagoda
