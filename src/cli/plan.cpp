#include "cli/plan.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "kv/kv_arena.h"
#include "policy/kv_policy.h"
#include "quant/kv_codec.h"
#include "sched/engine_setup.h"
#include "sched/seq_policy.h"

namespace pagoda::cli {

std::string plan_config::flags() const {
  std::string out = "--kv-cache-dtype " + kv_cache_dtype;
  if (!kv_layer_types.empty()) out += " --kv-layer-types " + kv_layer_types;
  if (!kv_policy.empty()) out += " --kv-policy " + kv_policy;
  if (!kv_share.empty()) out += " --kv-share " + kv_share;
  return out;
}

std::vector<plan_config> plan_configs(const llama_hparams& hp, std::int64_t n_ctx, int block_size) {
  std::vector<plan_config> out;
  auto add = [&](std::string dtype) {
    plan_config c;
    c.kv_cache_dtype = std::move(dtype);
    out.push_back(std::move(c));
  };
  // One type for K and V, as info's table lists them.
  for (int i = 0; i < k_n_kv_types; ++i) add(kv_type_name(static_cast<kv_type>(i)));
  // K/V mixes: per-channel keys with per-token values (KIVI), per-token keys, wider keys than values.
  for (const char* mix : {"int8/channel+int8/token", "int4/channel+int4/token", "int4/token+int4", "int2/token+int2",
                          "int8+int4", "int4+int2", "int8+int2"})
    add(mix);
  // A per-layer mix: the first two layers exact, the rest int4.
  if (hp.n_layer > 2) {
    plan_config c;
    c.kv_layer_types = "0-1:f16,2-:int4";
    out.push_back(c);
  }
  // Eviction budgets: a quarter of the context, in whole blocks.
  const std::int64_t kept = (n_ctx / 4 + block_size - 1) / block_size * block_size;
  if (kept > 0 && kept + block_size < n_ctx)
    for (const char* policy : {"window", "h2o"}) {
      plan_config c;
      c.kv_cache_dtype = "f16";
      c.kv_policy = fmt::format("{}:budget={}", policy, kept);
      c.kept_tokens = kept;
      out.push_back(c);
    }
  // Cross-layer sharing (a model that declares its own is planned with it, in every row).
  if (hp.kv_source.empty() && hp.n_layer >= 2)
    for (const char* share : {"reuse:from=0", "minicache:from=0"}) {
      plan_config c;
      c.kv_cache_dtype = "f16";
      c.kv_share = share;
      out.push_back(c);
    }
  return out;
}

double activation_bytes(const llama_hparams& hp, std::int64_t n_tokens, std::int64_t n_logit_rows) {
  const double ff = hp.moe.n_expert > 0 ? static_cast<double>(hp.moe.n_ff_exp) * hp.moe.n_expert_used : hp.n_ff;
  const double row = 2.0 * hp.n_embd + std::max(hp.n_embd, hp.q_dim()) + 2.0 * hp.q_dim() + 2.0 * hp.kv_dim() + 2.0 * ff;
  const double f32 = 4.0 * static_cast<double>(n_tokens) * row;
  // The matrix products' quantized inputs: about a byte per element of their widest input.
  const double quantized = static_cast<double>(n_tokens) * std::max<double>(ff, std::max(hp.n_embd, hp.q_dim())) * 1.125;
  const double logits = 4.0 * static_cast<double>(n_logit_rows) * hp.n_vocab;
  return f32 + quantized + logits;
}

std::int64_t blocks_per_sequence(const kv_layout& layout, const plan_config& c, std::int64_t n_tokens,
                                 std::int64_t prompt_chunk) {
  const std::int64_t bs = layout.block_size;
  std::int64_t held = n_tokens;
  if (c.kept_tokens > 0) held = std::min<std::int64_t>(n_tokens, c.kept_tokens + bs + prompt_chunk);
  std::int64_t blocks = (held + bs - 1) / bs;
  if (!c.kv_policy.empty()) {
    auto spec = parse_kv_policy_spec(c.kv_policy);
    if (spec.ok() && !spec->is_none())
      if (auto policy = make_kv_policy(*spec); policy.ok()) {
        const seq_policy_shape shape{layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.block_size};
        const side_charge side = seq_policy::side_memory_of(policy->get(), shape, -1);
        const auto block_bytes = static_cast<std::int64_t>(layout.bytes_per_block());
        blocks += (side.bytes_for(held) + block_bytes - 1) / block_bytes;  // charged on slots stored (kv_manager.h)
      }
  }
  return blocks;
}

std::int64_t max_sequences(const kv_layout& layout, double pool_bytes, std::int64_t blocks_per_seq) {
  const double per_seq = static_cast<double>(blocks_per_seq) * static_cast<double>(layout.bytes_per_block()) +
                         static_cast<double>(layout.staging_bytes_per_slot()) * k_staging_slots_per_sequence;
  const double room = pool_bytes - static_cast<double>(layout.static_bytes());
  if (room <= 0 || per_seq <= 0) return 0;
  return static_cast<std::int64_t>(room / per_seq);
}

std::vector<block_size_row> block_size_rows(const std::vector<std::int64_t>& lengths) {
  std::vector<block_size_row> out;
  for (int bs : {8, 16, 32, 64, 128}) {
    double allocated = 0, wasted = 0;
    for (std::int64_t n : lengths) {
      const std::int64_t slots = (n + bs - 1) / bs * bs;
      allocated += static_cast<double>(slots);
      wasted += static_cast<double>(slots - n);
    }
    block_size_row r;
    r.block_size = bs;
    r.fragmentation = allocated > 0 ? wasted / allocated : 0;
    r.wasted_tokens_per_request = lengths.empty() ? 0 : wasted / static_cast<double>(lengths.size());
    r.prefix_granularity = (bs - 1) / 2.0;
    out.push_back(r);
  }
  return out;
}

int recommend_block_size(const std::vector<block_size_row>& rows, double max_fragmentation) {
  int best = 0;
  for (const block_size_row& r : rows)
    if (r.fragmentation <= max_fragmentation) best = std::max(best, r.block_size);
  if (best > 0 || rows.empty()) return best;
  return rows.front().block_size;
}

namespace {

result<std::int64_t> whole_field(const nlohmann::json& j, const char* key, int line) {
  if (!j.contains(key)) return std::int64_t{-1};
  const nlohmann::json& v = j.at(key);
  if (!v.is_number_integer() || v.get<std::int64_t>() < 0)
    return error(errc::invalid_argument, "line {}: \"{}\" must be a whole number >= 0", line, key);
  return v.get<std::int64_t>();
}

}  // namespace

result<std::vector<std::int64_t>> read_length_mix(const std::string& path, const token_counter& tokenize,
                                                  int default_max_tokens) {
  std::ifstream in(path);
  if (!in) return error(errc::not_found, "{}: cannot read the request-length mix", path);
  std::vector<std::int64_t> out;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded()) return error(errc::invalid_argument, "{}: line {}: not JSON", path, line);
    if (j.is_number_integer() && j.get<std::int64_t>() > 0) {
      out.push_back(j.get<std::int64_t>());
      continue;
    }
    if (!j.is_object())
      return error(errc::invalid_argument, "{}: line {}: expected a length, {{\"length\": N}}, "
                   "{{\"prompt_tokens\": P, \"max_tokens\": G}} or a batch line with \"prompt\"", path, line);
    PAGODA_ASSIGN_OR_RETURN(const std::int64_t length, whole_field(j, "length", line));
    if (length > 0) {
      out.push_back(length);
      continue;
    }
    PAGODA_ASSIGN_OR_RETURN(std::int64_t gen, whole_field(j, "max_tokens", line));
    if (gen < 0) gen = default_max_tokens;
    PAGODA_ASSIGN_OR_RETURN(std::int64_t prompt, whole_field(j, "prompt_tokens", line));
    if (prompt < 0 && j.contains("prompt")) {
      const nlohmann::json& p = j.at("prompt");
      if (p.is_array()) {
        if (!p.empty() && !p.front().is_number_integer())
          return error(errc::invalid_argument, "{}: line {}: several prompts in one line; give one per line", path, line);
        prompt = static_cast<std::int64_t>(p.size());
      } else if (p.is_string()) {
        if (!tokenize)
          return error(errc::invalid_argument, "{}: line {}: a text prompt needs the model's tokenizer: plan a GGUF "
                       "(-m), or give lengths", path, line);
        prompt = tokenize(p.get<std::string>());
      }
    }
    if (prompt < 0)
      return error(errc::invalid_argument, "{}: line {}: no length (\"length\", \"prompt_tokens\" or \"prompt\")",
                   path, line);
    if (prompt + gen <= 0) return error(errc::invalid_argument, "{}: line {}: a request of 0 tokens", path, line);
    out.push_back(prompt + gen);
  }
  if (out.empty()) return error(errc::invalid_argument, "{}: no request lengths", path);
  return out;
}

std::string profile::model_name() const {
  return doc.contains("model") && doc["model"].contains("name") && doc["model"]["name"].is_string()
             ? doc["model"]["name"].get<std::string>()
             : std::string();
}

std::string profile::fingerprint() const {
  return doc.contains("model") && doc["model"].contains("fingerprint") && doc["model"]["fingerprint"].is_string()
             ? doc["model"]["fingerprint"].get<std::string>()
             : std::string();
}

result<profile> read_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return error(errc::not_found, "{}: cannot read the profile", path);
  std::stringstream ss;
  ss << in.rdbuf();
  profile p;
  p.path = path;
  p.doc = nlohmann::json::parse(ss.str(), nullptr, false);
  if (p.doc.is_discarded() || !p.doc.is_object() || !p.doc.contains("pagoda_profile"))
    return error(errc::invalid_argument, "{}: not a pagoda profile (a JSON object with \"pagoda_profile\")", path);
  for (const char* list : {"quality", "speed"})
    if (p.doc.contains(list) && !p.doc[list].is_array())
      return error(errc::invalid_argument, "{}: \"{}\" must be an array", path, list);
  return p;
}

namespace {

std::vector<profile> profiles_in(const std::string& dir) {
  std::vector<profile> out;
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) return out;
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  for (const std::string& f : files)
    if (auto p = read_profile(f); p.ok()) out.push_back(std::move(*p));
  return out;
}

std::string normalized(const std::string& spec) { return spec == "none" ? std::string() : spec; }

std::string json_string(const nlohmann::json& e, const char* key) {
  return e.contains(key) && e[key].is_string() ? e[key].get<std::string>() : std::string();
}

std::optional<double> json_number(const nlohmann::json& e, const char* key) {
  if (e.contains(key) && e[key].is_number()) return e[key].get<double>();
  return std::nullopt;
}

}  // namespace

std::vector<profile> find_profiles(const std::string& dir, const std::string& fingerprint) {
  std::vector<profile> out;
  for (profile& p : profiles_in(dir))
    if (!fingerprint.empty() && p.fingerprint() == fingerprint && p.doc.contains("quality")) out.push_back(std::move(p));
  return out;
}

std::vector<profile> find_speed_profiles(const std::string& dir) {
  std::vector<profile> out;
  for (profile& p : profiles_in(dir))
    if (p.doc.contains("speed")) out.push_back(std::move(p));
  return out;
}

std::string shipped_profile_dir() {
  std::error_code ec;
  if (const char* env = std::getenv("PAGODA_PROFILES"); env && *env) return env;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  for (const char* rel : {"../../profiles", "../share/pagoda/profiles"}) {
    const std::filesystem::path dir = (exe.parent_path() / rel).lexically_normal();
    if (std::filesystem::is_directory(dir, ec)) return dir.string();
  }
  return "";
}

std::string fingerprint_text(std::uint64_t fp) { return fmt::format("{:016x}", fp); }

status write_quality_entry(const std::string& path, const std::string& model_name, const std::string& fingerprint,
                           const nlohmann::json& entry) {
  nlohmann::json doc = {{"pagoda_profile", 1},
                        {"model", {{"name", model_name}, {"fingerprint", fingerprint}}},
                        {"quality", nlohmann::json::array()}};
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    PAGODA_ASSIGN_OR_RETURN(profile old, read_profile(path));
    if (old.fingerprint() != fingerprint)
      return error(errc::invalid_argument,
                   "{}: a profile of another model ({} {}, this one is {} {}); give another --profile-out", path,
                   old.model_name(), old.fingerprint(), model_name, fingerprint);
    doc = std::move(old.doc);
    if (!doc.contains("quality")) doc["quality"] = nlohmann::json::array();
  }
  nlohmann::json& list = doc["quality"];
  const auto same = [&](const nlohmann::json& e) {
    for (const char* key : {"kv", "kv_policy", "kv_share"})
      if (normalized(json_string(e, key)) != normalized(json_string(entry, key))) return false;
    return true;
  };
  list.erase(std::remove_if(list.begin(), list.end(), same), list.end());
  list.push_back(entry);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return error(errc::io_error, "{}: cannot write the profile", tmp);
    out << doc.dump(1) << "\n";
    if (!out) return error(errc::io_error, "{}: write failed", tmp);
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return error(errc::io_error, "{}: {}", path, ec.message());
  return {};
}

void apply_profiles(std::vector<plan_row>& rows, const std::vector<profile>& quality, const std::vector<profile>& speed) {
  for (plan_row& r : rows) {
    if (!r.error.empty()) continue;
    for (const profile& p : quality)
      for (const nlohmann::json& e : p.doc["quality"]) {
        if (json_string(e, "kv") != r.layout || normalized(json_string(e, "kv_policy")) != r.config.kv_policy ||
            normalized(json_string(e, "kv_share")) != r.config.kv_share)
          continue;
        r.mean_kl = json_number(e, "mean_kl");
        r.ppl_change_percent = json_number(e, "perplexity_change_percent");
      }
    // Speed belongs to the codecs: a row with a policy or sharing reads what its formats read.
    for (const profile& p : speed)
      for (const nlohmann::json& e : p.doc["speed"])
        if (json_string(e, "kv") == r.layout) r.attention_cost = json_number(e, "decode_attention_vs_f16");
  }
}

int recommend(const std::vector<plan_row>& rows, const quality_budget& budget) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(rows.size()); ++i) {
    const plan_row& r = rows[static_cast<std::size_t>(i)];
    if (!r.error.empty() || !r.fits) continue;
    bool ok = r.config.lossless;
    if (budget.given()) {
      const bool kl_ok = !budget.max_kl || (r.mean_kl && *r.mean_kl <= *budget.max_kl);
      const bool ppl_ok = !budget.max_ppl_change || (r.ppl_change_percent && std::abs(*r.ppl_change_percent) <= *budget.max_ppl_change);
      ok = ok || (kl_ok && ppl_ok);
    }
    if (!ok) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    const plan_row& b = rows[static_cast<std::size_t>(best)];
    if (r.max_users > b.max_users || (r.max_users == b.max_users && r.bytes_per_token < b.bytes_per_token)) best = i;
  }
  return best;
}

result<double> parse_memory_size(const std::string& text) {
  double v = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(begin, end, v);
  if (ec != std::errc() || !std::isfinite(v) || v <= 0)
    return error(errc::invalid_argument, "--memory '{}': expected a size such as 24GiB, 512MiB or 1.5T", text);
  std::string unit(p, end);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib" || unit == "kb") scale = 1024.0;
  else if (unit == "m" || unit == "mib" || unit == "mb") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib" || unit == "gb") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib" || unit == "tb") scale = 1024.0 * 1024 * 1024 * 1024;
  if (scale == 0)
    return error(errc::invalid_argument, "--memory '{}': unknown unit '{}'; use B, KiB, MiB, GiB or TiB", text, unit);
  return v * scale;
}

double available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {  // "MemAvailable:   12345678 kB"
    std::istringstream fields(line);
    std::string key;
    double kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024.0;
  }
  return static_cast<double>(machine_memory_bytes());
}

}  // namespace pagoda::cli
