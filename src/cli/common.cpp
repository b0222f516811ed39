#include "cli/common.h"

#include "server/chat_template.h"

#include <pthread.h>

#include "spec/speculative.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>


namespace pagoda::cli {

void add_model_options(CLI::App* app, engine_config& opts) {
  add_model_source(app, opts.model_path, "GGUF model file");
  app->add_option("-t,--threads", opts.n_threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app->add_option("-c,--ctx,--ctx-size,--max-model-len", opts.n_ctx,
                  "context length in tokens (default: the model's; --max-model-len is vLLM's name, --ctx-size "
                  "llama.cpp's)")
      ->check(CLI::Range(0, 1 << 24));
  app->add_flag_callback("--no-mmap", [&opts] { opts.use_mmap = false; },
                         "read the weights into memory (huge pages where the kernel gives them) instead of mapping "
                         "the file");
  add_gpu_options(app);
  add_vllm_options(app);
}

namespace {

std::vector<std::string>& gpu_flags_seen() {
  static std::vector<std::string> seen;
  return seen;
}

std::vector<std::string>& other_notes() {
  static std::vector<std::string> notes;
  return notes;
}

CLI::Validator finite_check(std::string description, double lo, bool lo_open, double hi) {
  return CLI::Validator(
      [lo, lo_open, hi](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "'" + text + "' is not a number";
        if (!std::isfinite(v) || !(lo_open ? v > lo : v >= lo) || v > hi) {
          if (hi == std::numeric_limits<double>::max())
            return fmt::format("{} is not a finite number {} {}", text, lo_open ? "above" : "of at least", lo);
          return fmt::format("{} is not a finite number in {}{}, {}]", text, lo_open ? "(" : "[", lo, hi);
        }
        return "";
      },
      std::move(description));
}

}  // namespace

CLI::Validator finite_positive(double hi) { return finite_check("POSITIVE", 0.0, true, hi); }
CLI::Validator finite_range(double lo, double hi) { return finite_check(fmt::format("[{} - {}]", lo, hi), lo, false, hi); }

void add_gpu_options(CLI::App* app) {
  const std::string group = "GPU (llama.cpp's flags; this build runs on the CPU and ignores them)";
  auto seen = [](const char* name) { return [name](const std::string&) { gpu_flags_seen().push_back(name); }; };
  auto option = [&](const char* names, const char* name, const char* what) {
    app->add_option_function<std::string>(names, seen(name), what)->group(group);
  };
  option("--n-gpu-layers,--gpu-layers", "--n-gpu-layers", "layers to offload (also -ngl)");
  option("--n-gpu-layers-draft,--gpu-layers-draft", "--n-gpu-layers-draft", "draft model layers to offload (also -ngld)");
  option("--split-mode", "--split-mode", "none, layer or row (also -sm)");
  option("--main-gpu", "--main-gpu", "the GPU to use (also -mg)");
  option("--tensor-split", "--tensor-split", "fractions of the model per GPU (also -ts)");
  option("--device", "--device", "devices to use (also -dev)");
  app->add_option_function<std::string>("--flash-attn", seen("--flash-attn"), "on, off or auto (also -fa)")
      ->expected(0, 1)
      ->group(group);
  app->add_flag_callback("--no-kv-offload", [] { gpu_flags_seen().push_back("--no-kv-offload"); },
                         "keep the KV cache off the GPU (also -nkvo)")
      ->group(group);
}

void add_vllm_options(CLI::App* app) {
  const std::string group = "vLLM's and TGI's flags (what they mean on the CPU)";
  app->add_option_function<std::string>(
         "--gpu-memory-utilization",
         [](const std::string& v) {
           other_notes().push_back(fmt::format(
               "pagoda: note: --gpu-memory-utilization {} ignored: there is no GPU memory here; the KV pool's size "
               "is --kv-cache-size MiB or --max-kv-tokens",
               v));
         },
         "vLLM's fraction of GPU memory: accepted and ignored (size the KV pool with --kv-cache-size or "
         "--max-kv-tokens)")
      ->check(finite_positive(1.0))
      ->group(group);
  app->add_option_function<std::string>(
         "--quantize,--quantization",
         [](const std::string& v) {
           throw usage_error(fmt::format(
               "--quantize {}: the weights are used in the GGUF's own types (pick a quantized GGUF, e.g. Q4_K_M; "
               "`pagoda info` shows them); the KV cache is quantized with --kv-cache-dtype (int8, int4, fp8, k8v4)",
               v));
         },
         "TGI's and vLLM's weight quantization: refused (the GGUF's own weight types are used; quantize the KV "
         "cache with --kv-cache-dtype)")
      ->group(group);
}

std::vector<std::string> flag_notes() {
  std::vector<std::string> notes;
  const auto& seen = gpu_flags_seen();
  if (!seen.empty()) {
    std::string names;
    for (const std::string& n : seen)
      if (names.find(n) == std::string::npos) names += (names.empty() ? "" : ", ") + n;
    notes.push_back(fmt::format("pagoda: note: this build runs on the CPU; {} ignored", names));
  }
  for (const std::string& n : other_notes()) notes.push_back(n);
  return notes;
}

void use_positional_model(CLI::App* app, std::string& positional) {
  app->add_option("MODEL", positional, "GGUF model file, as -m (vLLM's `serve MODEL`)");
}

void resolve_positional_model(std::string& model_path, const std::string& positional) {
  if (positional.empty()) return;  // -m, or -hf, or none (resolve_model_sources() says so)
  if (!model_path.empty() && model_path != positional)
    throw usage_error(fmt::format("two models given: -m {} and {}; give one", model_path, positional));
  model_path = positional;
}

void add_kv_options(CLI::App* app, engine_config& opts) {
  app->add_option("--kv-cache-dtype", opts.kv_cache_dtype,
                  "KV cache type for K and V: auto (the model's float type), f32, f16, bf16, fp8 (fp8_e4m3), "
                  "fp8_e5m2, int8, int4, int2, q8_0, q4_0; TYPE/MODE picks the scale granularity (token, "
                  "channel, gN, static, none); pairs: k8v4 or int8+int4/token");
  app->add_option("--cache-type-k", opts.cache_type_k, "KV cache type for keys (also -ctk)");
  app->add_option("--cache-type-v", opts.cache_type_v, "KV cache type for values (also -ctv)");
  app->add_option("--kv-layer-types", opts.kv_layer_types,
                  "per-layer KV types, one rule a layer (layers no rule names keep --kv-cache-dtype): e.g. "
                  "\"0-1:f16,2-:int4\" or \"0:k8v8,1-:k4v2\"");
  app->add_option("--kv-scales", opts.kv_scales_path,
                  "calibrated KV ranges (pagoda calibrate); quantized types without a mode use them");
  app->add_option("--kv-share", opts.kv_share,
                  "NAME[:key=value]: cross-layer KV sharing for a model that declares none: none, reuse:from=L, "
                  "minicache:from=L[,t=0.6][,retain=0.0625] (docs/kv-sharing.md)")
      ->each([](const std::string& text) {
        if (auto from = parse_kv_share_spec(text); !from.ok()) throw usage_error(from.error().message());
      });
  app->add_option("--block-size", opts.block_size, "tokens per KV block")->check(CLI::Range(1, 1024));
  app->add_option("--kv-cache-size", opts.kv_cache_size_mib, "KV pool size in MiB (default: --max-kv-tokens)")
      ->check(finite_positive());
  app->add_option("--max-kv-tokens", opts.max_kv_tokens, "KV pool size in tokens")->check(CLI::PositiveNumber);
  app->add_flag("--kv-huge-pages", opts.kv_huge_pages,
                "keep the KV pool in transparent huge pages, faulted in at start: faster decode attention at long "
                "context, a slower start, and the whole pool resident from it (default: base pages as written)");
  app->add_option("--kv-policy", opts.kv_policy,
                  "NAME[:key=value,...]: which tokens the KV cache keeps or reads (none, window, h2o, snapkv, "
                  "pyramid, merge, cluster, quest, retrieval; docs/policies.md); requests may name their own");
  app->add_option("--speculative", opts.speculative,
                  "NAME[:key=value,...]: speculative decoding of requests that name none (ngram:k=4,n=3; "
                  "docs/speculative.md); requests may name their own")
      ->each([](const std::string& text) {
        // A bad spec is a usage error (exit 2) naming the flag and the parameter.
        if (auto c = parse_spec_config(text); !c.ok())
          throw usage_error("--speculative: " + c.error().message());
      });
  app->add_option("--draft-model", opts.draft_model_path,
                  "PATH: a draft model with this model's vocabulary for speculative decoding (--speculative draft:k=4, "
                  "the default with it); its KV is a KV group of the pool")
      ->check(CLI::ExistingFile);
  app->add_flag("--kv-key-summaries", opts.kv_key_summaries,
                "keep per-block key bounds so requests may ask for quest (on when --kv-policy needs them)");
  app->add_flag("--swa-full", opts.swa_full,
                "sliding-window layers keep every position's K/V, as global layers do (default: only their window; "
                "needed for KV policies on such models)");
  app->add_option("--kv-segment-dtype", opts.kv_segment_dtypes,
                  "TYPE[:FRACTION], repeatable: a class of KV blocks of TYPE (as --kv-cache-dtype) for prompt parts "
                  "that ask for it (\"kv\": {\"type\": TYPE}), holding FRACTION (default 0.25) of the pool's bytes")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_option("--kv-image-type", opts.kv_image_type,
                  "TYPE: the KV type of image tokens' blocks (as --kv-cache-dtype; a KV class of TYPE with "
                  "--kv-segment-dtype's default fraction unless that flag lists it); default: the text's");
  app->add_option("--kv-image-policy", opts.kv_image_policy,
                  "NAME[:key=value,...]: the KV policy of image tokens (docs/policies.md, per-segment); default: the request's");
}

result<std::unique_ptr<llama_model>> load_model(const engine_config& opts) {
  return llama_model::load(opts.model_path, {opts.use_mmap});
}

std::vector<std::string> split_documents(const std::string& text, const std::string& sep) {
  std::vector<std::string> docs;
  auto trim = [](std::string s) {
    std::size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t at = sep.empty() ? std::string::npos : text.find(sep, start);
    std::string doc = trim(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (!doc.empty()) docs.push_back(std::move(doc));
    if (at == std::string::npos) break;
    start = at + sep.size();
  }
  return docs;
}

result<std::vector<std::string>> read_documents(const std::string& path, const std::string& sep) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(errc::not_found, "cannot open {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<std::string> docs = split_documents(ss.str(), sep);
  if (docs.empty()) return error(errc::invalid_argument, "{} holds no documents", path);
  return docs;
}

void normalize_args(int& argc, char**& argv) {
  static std::vector<std::string> storage;
  static std::vector<char*> ptrs;
  storage.assign(argv, argv + argc);
  for (std::string& a : storage) {
    static const std::pair<const char*, const char*> k_long[] = {
        {"-ctk", "--cache-type-k"}, {"-ctv", "--cache-type-v"},   {"-ngl", "--n-gpu-layers"},
        {"-ngld", "--n-gpu-layers-draft"}, {"-fa", "--flash-attn"}, {"-sm", "--split-mode"},
        {"-mg", "--main-gpu"},      {"-ts", "--tensor-split"},    {"-nkvo", "--no-kv-offload"},
        {"-dev", "--device"},       {"-hf", "--hf-repo"},         {"-hfr", "--hf-repo"},
        {"-hff", "--hf-file"},      {"-cnv", "--conversation"}};
    for (const auto& [short_name, long_name] : k_long) {
      if (a == short_name) a = long_name;
      else if (a.size() > std::strlen(short_name) && a.compare(0, std::strlen(short_name), short_name) == 0 &&
               a[std::strlen(short_name)] == '=')
        a = long_name + a.substr(std::strlen(short_name));
    }
  }
  ptrs.clear();
  for (std::string& a : storage) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  argv = ptrs.data();
}

progress_bar::progress_bar(std::string label, std::int64_t total)
    : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1 && total > 0) {}

void progress_bar::update(std::int64_t done) {
  if (!enabled_) return;
  int pct = static_cast<int>(100 * done / total_);
  if (pct == last_percent_) return;
  last_percent_ = pct;
  constexpr int k_width = 40;
  int filled = pct * k_width / 100;
  std::fprintf(stderr, "\r%s [%.*s%*s] %3d%% (%lld/%lld)", label_.c_str(), filled,
               "########################################", k_width - filled, "", pct,
               static_cast<long long>(done), static_cast<long long>(total_));
  std::fflush(stderr);
}

void progress_bar::finish() {
  if (!enabled_) return;
  std::fprintf(stderr, "\r%*s\r", 80 + static_cast<int>(label_.size()), "");
  std::fflush(stderr);
}

sigset_t block_stop_signals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return sigs;
}

int fail(const status& st) {
  std::fprintf(stderr, "pagoda: error: %s\n", st.message().c_str());
  return 1;
}

int fail_engine(const status& st) {
  fail(st);
  const std::string& m = st.message();
  return m.starts_with("--speculative") || m.starts_with("--draft-model") || m.starts_with("--kv-share") ? 2 : 1;
}

void check_chat_template_name(const std::string& name) {
  if (server::chat_format_from_name(name)) return;
  std::string names;
  for (server::chat_format f : server::all_chat_formats())
    names += std::string(names.empty() ? "" : ", ") + server::chat_format_name(f);
  throw usage_error(fmt::format("--chat-template '{}': unknown; expected one of {}", name, names));
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", bytes, units[u]) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string kv_pool_line(const engine_core_config& cfg, const kv_metrics& kv) {
  const double pool_bytes = static_cast<double>(cfg.kv.bytes_per_block()) * kv.n_blocks_total;
  const std::int64_t pool_tokens = static_cast<std::int64_t>(kv.n_blocks_total) * kv.block_size_tokens;
  // The KV as configured: types (and sharing), the default policy, and the split into KV classes.
  std::string line = "KV " + cfg.kv.describe();
  if (!cfg.kv.sharing.empty()) line += ", shared " + cfg.kv.sharing;
  line += ", policy " + (cfg.kv_policy.empty() ? std::string("none") : cfg.kv_policy);
  if (!cfg.kv_classes.empty()) {
    line += fmt::format(", classes {} {} blocks", cfg.kv.describe(), cfg.n_blocks);
    for (const kv_segment_class& c : cfg.kv_classes) line += fmt::format(" + {} {} blocks", c.name, c.n_blocks);
  }
  line += fmt::format(", pool {} = {} blocks of {} tokens ({} tokens: {} full-context sequences)", human_bytes(pool_bytes),
                      kv.n_blocks_total, kv.block_size_tokens, pool_tokens,
                      pool_tokens / std::max(1, cfg.max_model_len));
  return line;
}

}  // namespace pagoda::cli
