// pagoda plan: which KV configuration to run a model with in a memory budget.
// Every configuration the engine supports for the model, with its bytes per
// token (info's figures), the sequences and tokens that fit once weights,
// activations and the pool's staging are paid, decode attention cost against
// f16 and quality cost from measured profiles, a recommendation within a
// quality budget, and the block size a request-length mix wastes least in.
// The arithmetic is in cli/plan.h; docs/plan.md explains the columns.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/plan.h"
#include "kv/kv_arena.h"
#include "model/synth.h"

namespace pagoda::cli {
namespace {

constexpr double k_mib = 1024.0 * 1024.0;
// Headroom beside weights, activations and the pool: the process, its thread
// stacks and the allocator's slack.
constexpr double k_reserve_bytes = 256.0 * k_mib;

struct plan_options {
  std::string model_path;
  std::string preset;
  std::string weight_type = "q8_0";
  std::string memory;          // "" : the machine's available memory
  double pool_mib = 0;         // --kv-cache-size: the pool given (memory accounting skipped)
  std::int64_t n_ctx = 0;      // 0: the model's trained context (capped by the mix's longest request)
  std::int64_t users = 0;
  std::string lengths_path;
  int default_max_tokens = 256;
  int block_size = 16;
  int max_num_batched_tokens = 2048;
  double max_kl = -1;
  double max_ppl_change = -1;  // from max_ppl_change_text
  std::string max_ppl_change_text;
  std::vector<std::string> profile_paths;
  bool no_profiles = false;
  bool json = false;
};

// What plan knows of the model: its shape, weights and identity.
struct plan_model {
  llama_hparams hp;
  kv_type auto_type = kv_type::f16;
  double weights_bytes = 0;
  std::string name;
  std::string fingerprint;  // "" for a preset (random weights: no quality to measure)
  std::string source;       // the file or "synth preset NAME (WEIGHTS weights)"
  std::unique_ptr<llama_model> loaded;
};

// Sliding-window layers as the loader marks them (model/llama_model.cpp):
// the file's pattern, else gemma2 and gpt-oss every other layer, gemma3 five of six.
void mark_window_layers(const synth_shape& s, llama_hparams& hp) {
  hp.swa_layer.assign(static_cast<std::size_t>(hp.n_layer), false);
  if (s.sliding_window <= 0) return;
  const std::string arch = s.arch;
  const int pattern = s.swa_pattern > 0 ? s.swa_pattern : arch == "gemma2" || arch == "gpt-oss" ? 2 : arch == "gemma3" ? 6 : 0;
  for (int l = 0; l < hp.n_layer; ++l) hp.swa_layer[static_cast<std::size_t>(l)] = pattern == 0 || l % pattern < pattern - 1;
}

result<plan_model> preset_model(const plan_options& o) {
  synth_options so;
  so.preset = o.preset;
  so.n_vocab = 0;  // the real model's vocabulary: its embeddings and logits are what memory pays for
  PAGODA_ASSIGN_OR_RETURN(synth_weights w, parse_synth_weights(o.weight_type));
  so.weight_type = w.type;
  so.mix = w.mix;
  PAGODA_ASSIGN_OR_RETURN(synth_shape s, resolve_synth_shape(so));
  PAGODA_ASSIGN_OR_RETURN(std::uint64_t bytes, synth_model_size_bytes(so));
  plan_model m;
  llama_hparams& hp = m.hp;
  hp.arch = s.arch;
  hp.name = s.name;
  hp.n_vocab = s.n_vocab;
  hp.n_embd = s.n_embd;
  hp.n_layer = s.n_layer;
  hp.n_head = s.n_head;
  hp.n_head_kv = s.n_head_kv;
  hp.head_dim = s.head_dim;
  hp.n_ff = s.n_ff;
  hp.n_ctx_train = s.n_ctx;
  hp.sliding_window = s.sliding_window;
  hp.moe.n_expert = s.n_expert;
  hp.moe.n_expert_used = s.n_expert_used;
  hp.moe.n_ff_exp = s.n_ff_exp;
  mark_window_layers(s, hp);
  m.auto_type = w.mix == synth_mix::none && w.type == gguf::tensor_type::f32 ? kv_type::f32 : kv_type::f16;
  m.weights_bytes = static_cast<double>(bytes);
  m.name = s.name;
  m.source = fmt::format("synth preset {} ({} weights, no file)", s.name, o.weight_type);
  return m;
}

result<plan_model> file_model(const plan_options& o) {
  auto loaded = llama_model::load(o.model_path);
  if (!loaded.ok()) return loaded.error().with_context(o.model_path);
  plan_model m;
  m.loaded = std::move(*loaded);
  const llama_model& model = *m.loaded;
  m.hp = model.hparams();
  m.auto_type = model.layers().front().wq.type == gguf::tensor_type::f32 ? kv_type::f32 : kv_type::f16;
  for (const gguf::tensor_info& t : model.gguf().tensors()) m.weights_bytes += static_cast<double>(t.size_bytes);
  m.name = m.hp.name.empty() ? o.model_path : m.hp.name;
  m.fingerprint = fingerprint_text(model_fingerprint(model));
  m.source = o.model_path;
  return m;
}

std::string opt_number(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : std::string("unknown");
}

std::string row_name(const plan_row& r) {
  std::string name = r.layout.empty() ? r.config.flags() : r.layout;
  if (!r.config.kv_policy.empty()) name += " " + r.config.kv_policy;
  if (!r.config.kv_share.empty()) name += " share " + r.config.kv_share;
  return name;
}

struct plan_answer {
  plan_memory memory;
  std::int64_t n_ctx = 0;
  std::int64_t run_seqs = 0;  // --max-num-seqs the rows are sized for
  std::vector<plan_row> rows;
  int best = -1;
  std::vector<block_size_row> block_sizes;
  int block_size = 0;  // recommended; 0 without a mix
  std::vector<std::string> notes;
  std::vector<std::string> quality_profiles, speed_profiles;
};

plan_row make_row(const plan_model& m, const plan_options& o, const plan_config& c, const plan_answer& a) {
  plan_row r;
  r.config = c;
  engine_config cfg;
  cfg.block_size = o.block_size;
  cfg.kv_cache_dtype = c.kv_cache_dtype;
  cfg.kv_layer_types = c.kv_layer_types;
  cfg.kv_share = c.kv_share;
  auto layout = make_kv_layout(m.hp, m.auto_type, cfg);
  if (!layout.ok()) {
    r.error = layout.error().message();
    return r;
  }
  const kv_layout& l = *layout;
  r.layout = l.describe();
  r.bits_per_element = l.bits_per_element();
  r.bytes_per_token = l.bytes_per_token();
  r.staging_bytes_per_seq = static_cast<std::int64_t>(l.staging_bytes_per_slot()) * k_staging_slots_per_sequence;
  r.blocks_per_seq = blocks_per_sequence(l, c, a.n_ctx, o.max_num_batched_tokens);
  r.bytes_per_seq = static_cast<double>(r.blocks_per_seq) * static_cast<double>(l.bytes_per_block()) +
                    static_cast<double>(r.staging_bytes_per_seq);
  // What `--kv-cache-size pool_mib` gives: pool_blocks' accounting, the budget rounded down to a MiB.
  r.pool_mib = static_cast<std::int64_t>(std::floor(std::max(a.memory.pool_bytes(), 0.0) / k_mib));
  const double pool = static_cast<double>(r.pool_mib) * k_mib;
  r.max_users = max_sequences(l, pool, r.blocks_per_seq);
  const std::int64_t seqs = a.run_seqs > 0 ? a.run_seqs : std::max<std::int64_t>(r.max_users, 1);
  const double block_room = pool - static_cast<double>(l.static_bytes()) -
                            static_cast<double>(l.staging_bytes_per_slot()) * k_staging_slots_per_sequence * seqs;
  r.max_tokens = block_room > 0 ? static_cast<std::int64_t>(block_room / static_cast<double>(l.bytes_per_block())) *
                                      l.block_size
                                : 0;
  r.fits = r.max_users >= std::max<std::int64_t>(o.users, 1);
  return r;
}

// Fills the quality and speed columns: the profiles given, else the shipped
// ones (quality only for this model's fingerprint), with notes on where
// they come from or that there are none.
status add_profiles(const plan_model& m, const plan_options& o, plan_answer& a) {
  std::vector<profile> quality, speed;
  for (const std::string& path : o.profile_paths) {
    PAGODA_ASSIGN_OR_RETURN(profile p, read_profile(path));
    if (p.doc.contains("quality")) {
      if (p.fingerprint() != m.fingerprint)
        a.notes.push_back(fmt::format("{}: measured on {} ({}), not this model: its quality figures are that "
                                      "model's", path, p.model_name(), p.fingerprint()));
      quality.push_back(p);
    }
    if (p.doc.contains("speed")) speed.push_back(p);
  }
  if (!o.no_profiles) {
    const std::string dir = shipped_profile_dir();
    if (o.profile_paths.empty())
      for (profile& p : find_profiles(dir, m.fingerprint)) quality.push_back(std::move(p));
    if (speed.empty())
      for (profile& p : find_speed_profiles(dir)) speed.push_back(std::move(p));
  }
  for (const profile& p : quality) a.quality_profiles.push_back(p.path);
  for (const profile& p : speed) {
    a.speed_profiles.push_back(p.path);
    // Where the figures come from: a benchmark of one machine, under its load then.
    if (const nlohmann::json& src = p.doc.value("speed_source", nlohmann::json::object()); src.is_object() && !src.empty())
      a.notes.push_back(fmt::format("attention speed: {} ({}; {}, SIMD {}, host {}, load average {}): decode attention "
                                    "alone; the rest of a decode step (the weights) is the same for every KV format",
                                    p.path, src.value("benchmark", "?"), src.value("shape", "?"), src.value("simd", "?"),
                                    src.value("host", "?"), src.contains("load_average") ? src["load_average"].dump() : "?"));
  }
  if (quality.empty())
    a.notes.push_back(m.fingerprint.empty()
                          ? "quality: unknown (a synth preset has random weights; measure a real model with "
                            "`pagoda perplexity --kl-divergence --profile-out FILE` and pass --profile FILE)"
                          : "quality: unknown (no profile for this model; write one with `pagoda perplexity "
                            "--kl-divergence --profile-out FILE`)");
  if (speed.empty()) a.notes.push_back("attention speed: unknown (no speed profile found)");
  apply_profiles(a.rows, quality, speed);
  return {};
}

result<plan_answer> make_answer(const plan_model& m, const plan_options& o) {
  plan_answer a;
  const llama_hparams& hp = m.hp;
  std::vector<std::int64_t> mix;
  if (!o.lengths_path.empty()) {
    token_counter count;
    if (m.loaded)
      count = [&m](const std::string& text) {
        return static_cast<std::int64_t>(m.loaded->vocab().encode(text, m.loaded->vocab().add_bos_default()).size());
      };
    PAGODA_ASSIGN_OR_RETURN(mix, read_length_mix(o.lengths_path, count, o.default_max_tokens));
    a.block_sizes = block_size_rows(mix);
    a.block_size = recommend_block_size(a.block_sizes);
  }
  a.n_ctx = o.n_ctx > 0 ? o.n_ctx : !mix.empty() ? *std::max_element(mix.begin(), mix.end()) : hp.n_ctx_train;
  if (!mix.empty() && o.n_ctx <= 0)
    a.notes.push_back(fmt::format("context: the mix's longest request, {} tokens (--ctx to choose)", a.n_ctx));
  a.run_seqs = o.users;
  plan_memory& mem = a.memory;
  if (o.pool_mib > 0) {
    // The pool is given: size nothing else.
    mem.budget_bytes = o.pool_mib * k_mib;
    a.notes.push_back("--kv-cache-size given: the pool is that size; weights and activations are not counted");
  } else {
    if (!o.memory.empty()) {
      PAGODA_ASSIGN_OR_RETURN(mem.budget_bytes, parse_memory_size(o.memory));
    } else {
      mem.budget_bytes = available_memory_bytes();
      a.notes.push_back(fmt::format("memory: this machine's available memory, {} (--memory to choose)",
                                    human_bytes(mem.budget_bytes)));
    }
    mem.weights_bytes = m.weights_bytes;
    mem.activation_bytes = activation_bytes(hp, o.max_num_batched_tokens, std::max<std::int64_t>(o.users, 64));
    mem.reserve_bytes = k_reserve_bytes;
    if (mem.pool_bytes() <= 0)
      a.notes.push_back(fmt::format("{} leaves nothing for the KV pool: the weights take {} and activations {}",
                                    human_bytes(mem.budget_bytes), human_bytes(mem.weights_bytes),
                                    human_bytes(mem.activation_bytes)));
  }
  if (const double machine = static_cast<double>(machine_memory_bytes()); machine > 0 && mem.pool_bytes() > machine)
    a.notes.push_back(fmt::format("a {} pool is larger than this machine's memory ({}): serve and batch here refuse "
                                  "it; the plan is for a larger machine",
                                  human_bytes(mem.pool_bytes()), human_bytes(machine)));
  if (hp.n_swa_layers() > 0)
    a.notes.push_back("sliding-window layers are counted at every position (an upper bound: the engine keeps only "
                      "their window in a KV group of their own)");
  for (plan_config& c : plan_configs(hp, a.n_ctx, o.block_size)) {
    c.lossless = c.kv_policy.empty() && c.kv_share.empty() && c.kv_layer_types.empty() &&
                 (c.kv_cache_dtype == "f32" || c.kv_cache_dtype == kv_type_name(m.auto_type));
    plan_row r = make_row(m, o, c, a);
    // Two spellings of one layout ("int4" is int4/channel+int4/token): the first stays.
    const bool seen = r.error.empty() && std::any_of(a.rows.begin(), a.rows.end(), [&](const plan_row& x) {
      return x.layout == r.layout && x.config.kv_policy == c.kv_policy && x.config.kv_share == c.kv_share;
    });
    if (!seen) a.rows.push_back(std::move(r));
  }
  PAGODA_RETURN_IF_ERROR(add_profiles(m, o, a));
  quality_budget budget;
  if (o.max_kl >= 0) budget.max_kl = o.max_kl;
  if (o.max_ppl_change >= 0) budget.max_ppl_change = o.max_ppl_change;
  a.best = recommend(a.rows, budget);
  if (!budget.given())
    a.notes.push_back(fmt::format("no quality budget (--max-kl, --max-ppl-change): only f32 and the model's own type ({}) are "
                                      "recommended", kv_type_name(m.auto_type)));
  return a;
}

std::string run_command(const plan_model& m, const plan_options& o, const plan_answer& a, const plan_row& r) {
  const std::string model = m.loaded ? o.model_path : fmt::format("MODEL.gguf ({})", m.name);
  const std::int64_t seqs = a.run_seqs > 0 ? a.run_seqs : r.max_users;
  std::string cmd = fmt::format("pagoda serve -m {} {} --block-size {} --kv-cache-size {} --max-num-seqs {} --ctx {}",
                                model, r.config.flags(), o.block_size, r.pool_mib, seqs, a.n_ctx);
  // The step size the activations and a policy's peak were counted at, when it is not the engine's default.
  if (o.max_num_batched_tokens != engine_config{}.max_num_batched_tokens)
    cmd += fmt::format(" --max-num-batched-tokens {}", o.max_num_batched_tokens);
  return cmd;
}

nlohmann::json to_json(const plan_model& m, const plan_options& o, const plan_answer& a) {
  const llama_hparams& hp = m.hp;
  nlohmann::json rows = nlohmann::json::array();
  for (const plan_row& r : a.rows) {
    nlohmann::json j = {{"flags", r.config.flags()},
                        {"kv_cache_dtype", r.config.kv_cache_dtype},
                        {"kv_layer_types", r.config.kv_layer_types},
                        {"kv_policy", r.config.kv_policy},
                        {"kv_share", r.config.kv_share},
                        {"lossless", r.config.lossless}};
    if (!r.error.empty()) {
      j["error"] = r.error;
      rows.push_back(j);
      continue;
    }
    auto optional = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
    j.update({{"layout", r.layout},
              {"bits_per_element", r.bits_per_element},
              {"bytes_per_token", r.bytes_per_token},
              {"staging_bytes_per_sequence", r.staging_bytes_per_seq},
              {"blocks_per_sequence", r.blocks_per_seq},
              {"bytes_per_sequence", r.bytes_per_seq},
              {"max_users", r.max_users},
              {"max_tokens", r.max_tokens},
              {"kv_cache_size_mib", r.pool_mib},
              {"fits", r.fits},
              {"decode_attention_vs_f16", optional(r.attention_cost)},
              {"mean_kl", optional(r.mean_kl)},
              {"perplexity_change_percent", optional(r.ppl_change_percent)}});
    rows.push_back(j);
  }
  nlohmann::json j = {
      {"model", {{"name", m.name}, {"source", m.source}, {"fingerprint", m.fingerprint}, {"layers", hp.n_layer},
                 {"kv_heads", hp.n_head_kv}, {"head_dim", hp.head_dim}, {"context_trained", hp.n_ctx_train}}},
      {"formula", "bytes/token = 2 (K and V) x KV layers x KV heads x head_dim x bytes/element (+ scales); "
                  "Llama-3-70B f16: 2 x 80 x 8 x 128 x 2 = 327680"},
      {"memory", {{"budget_bytes", a.memory.budget_bytes}, {"weights_bytes", a.memory.weights_bytes},
                  {"activation_bytes", a.memory.activation_bytes}, {"reserve_bytes", a.memory.reserve_bytes},
                  {"pool_bytes", a.memory.pool_bytes()}, {"machine_bytes", machine_memory_bytes()}}},
      {"workload", {{"ctx", a.n_ctx}, {"users", o.users}, {"block_size", o.block_size}}},
      {"configs", rows},
      {"profiles", {{"quality", a.quality_profiles}, {"speed", a.speed_profiles}}},
      {"notes", a.notes}};
  if (a.best >= 0) {
    const plan_row& r = a.rows[static_cast<std::size_t>(a.best)];
    j["recommendation"] = {{"index", a.best}, {"flags", r.config.flags()}, {"layout", r.layout},
                           {"command", run_command(m, o, a, r)}};
  } else {
    j["recommendation"] = nullptr;
  }
  if (!a.block_sizes.empty()) {
    nlohmann::json bs = nlohmann::json::array();
    for (const block_size_row& b : a.block_sizes)
      bs.push_back({{"block_size", b.block_size}, {"fragmentation", b.fragmentation},
                    {"wasted_tokens_per_request", b.wasted_tokens_per_request},
                    {"prefix_tokens_recomputed_per_hit", b.prefix_granularity}});
    j["block_sizes"] = bs;
    j["recommended_block_size"] = a.block_size;
  }
  return j;
}

void print_table(const plan_model& m, const plan_options& o, const plan_answer& a) {
  const llama_hparams& hp = m.hp;
  std::printf("model:      %s (%d layers, %d KV heads, head_dim %d)\n", m.source.c_str(), hp.n_layer, hp.n_head_kv,
              hp.head_dim);
  std::printf("formula:    bytes/token = 2 (K and V) x KV layers x KV heads x head_dim x bytes/element, scales included\n"
              "            (Llama-3-70B at f16: 2 x 80 x 8 x 128 x 2 = 327,680 bytes per token)\n");
  const plan_memory& mem = a.memory;
  if (o.pool_mib > 0)
    std::printf("memory:     KV pool %s (given)\n", human_bytes(mem.budget_bytes).c_str());
  else
    std::printf("memory:     %s budget - %s weights - %s activations - %s reserve = %s KV pool\n",
                human_bytes(mem.budget_bytes).c_str(), human_bytes(mem.weights_bytes).c_str(),
                human_bytes(mem.activation_bytes).c_str(), human_bytes(mem.reserve_bytes).c_str(),
                human_bytes(std::max(mem.pool_bytes(), 0.0)).c_str());
  std::printf("workload:   sequences of %lld tokens%s, blocks of %d\n\n", static_cast<long long>(a.n_ctx),
              o.users > 0 ? fmt::format(", {} at once", o.users).c_str() : "", o.block_size);
  std::printf("  %-44s %7s %10s %10s %7s %10s %5s %8s %10s %8s\n", "KV configuration", "bits/el", "B/token", "per seq",
              "users", "tokens", "fits", "attn/f16", "KL", "ppl");
  for (std::size_t i = 0; i < a.rows.size(); ++i) {
    const plan_row& r = a.rows[i];
    const std::string mark = static_cast<int>(i) == a.best ? "* " : "  ";
    if (!r.error.empty()) {
      std::printf("%s%-44s %s\n", mark.c_str(), r.config.flags().c_str(), r.error.c_str());
      continue;
    }
    std::printf("%s%-44s %7.2f %10.1f %10s %7lld %10lld %5s %8s %10s %8s\n", mark.c_str(), row_name(r).c_str(),
                r.bits_per_element, r.bytes_per_token, human_bytes(r.bytes_per_seq).c_str(),
                static_cast<long long>(r.max_users), static_cast<long long>(r.max_tokens), r.fits ? "yes" : "no",
                opt_number(r.attention_cost, "{:.2f}x").c_str(), opt_number(r.mean_kl, "{:.3g}").c_str(),
                r.ppl_change_percent ? fmt::format("{:+.2f}%", *r.ppl_change_percent).c_str() : "unknown");
  }
  std::printf("\n");
  if (a.best >= 0) {
    const plan_row& r = a.rows[static_cast<std::size_t>(a.best)];
    std::printf("recommended (*): %s\n  %s\n", row_name(r).c_str(), run_command(m, o, a, r).c_str());
  } else {
    std::printf("recommended: none: no configuration %s holds %lld sequences of %lld tokens in this pool\n",
                o.max_kl >= 0 || o.max_ppl_change >= 0 ? "within the quality budget" : "of exact quality",
                static_cast<long long>(std::max<std::int64_t>(o.users, 1)), static_cast<long long>(a.n_ctx));
  }
  if (!a.block_sizes.empty()) {
    std::printf("\nblock size for the request-length mix (only full blocks are shared as prefixes):\n");
    std::printf("  %-10s %14s %18s %26s\n", "block size", "fragmentation", "wasted tokens/req", "prefix tokens recomputed/hit");
    for (const block_size_row& b : a.block_sizes)
      std::printf("%s %-10d %13.2f%% %18.1f %26.1f\n", b.block_size == a.block_size ? "*" : " ", b.block_size,
                  100 * b.fragmentation, b.wasted_tokens_per_request, b.prefix_granularity);
    std::printf("recommended block size: %d (the largest that wastes at most 5%% of the slots it allocates)%s\n",
                a.block_size,
                a.block_size != o.block_size ? fmt::format("; plan again with --block-size {} to size the pool in those "
                                                           "blocks", a.block_size).c_str()
                                             : "");
  }
  for (const std::string& p : a.quality_profiles) std::printf("quality profile: %s\n", p.c_str());
  for (const std::string& p : a.speed_profiles) std::printf("speed profile:   %s\n", p.c_str());
  for (const std::string& n : a.notes) std::printf("note: %s\n", n.c_str());
}

int plan(const plan_options& o) {
  if (o.model_path.empty() == o.preset.empty())
    return fail(error(errc::invalid_argument, "plan needs one model: -m MODEL.gguf or --preset NAME (pagoda synth --list)"));
  PAGODA_ASSIGN_OR_RETURN_CLI(plan_model m, o.preset.empty() ? file_model(o) : preset_model(o));
  PAGODA_ASSIGN_OR_RETURN_CLI(plan_answer a, make_answer(m, o));
  if (o.json) std::printf("%s\n", to_json(m, o, a).dump(1).c_str());
  else print_table(m, o, a);
  return 0;
}

}  // namespace

void register_plan(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<plan_options>();
  CLI::App* cmd = app.add_subcommand("plan", "choose a KV configuration: what fits in memory, at what cost");
  cmd->add_option("-m,--model", opts->model_path, "GGUF model file")->check(CLI::ExistingFile);
  cmd->add_option("--preset", opts->preset, "a synth preset instead of a file (llama3-8b, llama3-70b, ...: pagoda synth --list)");
  cmd->add_option("--weight-type", opts->weight_type, "with --preset: the weights' type or mix (as synth takes it)");
  cmd->add_option("--memory", opts->memory, "memory budget, e.g. 24GiB (default: this machine's available memory)");
  cmd->add_option("--kv-cache-size", opts->pool_mib, "plan a KV pool of this many MiB instead of a memory budget")
      ->check(finite_positive());
  cmd->add_option("-c,--ctx", opts->n_ctx, "tokens per sequence, prompt and output (default: the model's context, or the "
                  "mix's longest request)")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  cmd->add_option("--users", opts->users, "sequences running at once (fits: whether they do)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--lengths", opts->lengths_path,
                  "a request-length mix: JSONL of lengths, {\"prompt_tokens\", \"max_tokens\"}, or a batch input file");
  cmd->add_option("--max-tokens", opts->default_max_tokens, "output tokens of a mix line that names none")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--block-size", opts->block_size, "tokens per KV block")->check(CLI::Range(1, 1024));
  cmd->add_option("--max-num-batched-tokens", opts->max_num_batched_tokens, "tokens per engine step (activations)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-kl", opts->max_kl, "quality budget: mean KL divergence in nats per token")
      ->check(finite_range(0, 1e9));
  cmd->add_option("--max-ppl-change", opts->max_ppl_change_text, "quality budget: perplexity change in percent (1 or 1%)")
      ->each([](const std::string& text) {
        std::string t = text;
        if (!t.empty() && t.back() == '%') t.pop_back();
        if (!finite_range(0, 1e9)(t).empty()) throw usage_error("--max-ppl-change '" + text + "': expected a percentage such as 1%");
      });
  cmd->add_option("--profile", opts->profile_paths, "a measured profile (quality or speed) instead of the shipped ones")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--no-profiles", opts->no_profiles, "ignore the shipped profiles");
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts, &action] {
    if (!opts->max_ppl_change_text.empty()) {
      std::string t = opts->max_ppl_change_text;
      if (t.back() == '%') t.pop_back();
      opts->max_ppl_change = std::stod(t);
    }
    action = [opts] { return plan(*opts); };
  });
}

}  // namespace pagoda::cli
