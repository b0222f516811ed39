// pagoda batch: offline batch inference over a JSONL file (vLLM's LLM.generate).
// Every request is queued at once; the engine batches them continuously.
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/clock.h"

namespace pagoda::cli {
namespace {

using nlohmann::json;

struct batch_options {
  engine_options engine;
  std::string input;
  std::string output;  // "" or "-": stdout
  bool json_summary = false;
};

struct line_result {
  std::string id;
  std::string error;  // non-empty: the line failed
  std::string error_type = "invalid_request_error";
  struct completion {
    std::string text;
    std::vector<token_id> tokens;
    std::string finish_reason;
  };
  std::vector<completion> completions;
  request_usage usage;
  bool done = false;
};

// Reads one field with a type check; errors name the field.
template <typename T>
status read_field(const json& j, const char* name, T& out, bool (json::*is_type)() const) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return {};
  if (!((*it).*is_type)()) return error(errc::invalid_argument, "field '{}' has the wrong type ({})", name, it->type_name());
  out = it->get<T>();
  return {};
}

result<request> parse_line(const json& j, const tokenizer& vocab, std::mt19937_64& seeds) {
  if (!j.is_object()) return error(errc::invalid_argument, "expected a JSON object, got {}", j.type_name());
  request r;
  auto id = j.find("id");
  if (id == j.end()) return error(errc::invalid_argument, "missing field 'id'");
  if (id->is_string()) r.id = id->get<std::string>();
  else if (id->is_number_integer()) r.id = std::to_string(id->get<long long>());
  else return error(errc::invalid_argument, "field 'id' must be a string or an integer");
  auto prompt = j.find("prompt");
  if (prompt == j.end() || !prompt->is_string()) return error(errc::invalid_argument, "field 'prompt' must be a string");
  r.prompt = vocab.encode(prompt->get<std::string>(), /*add_bos=*/true);
  // vLLM's SamplingParams defaults: temperature 1, top_p 1, top_k off, 16 tokens.
  r.sampling = {1.0f, 0, 1.0f, 0.0f, 0};
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  std::int64_t top_k = 0, max_tokens = 16, n = 1, priority = 0;
  bool has_seed = j.contains("seed") && !j["seed"].is_null();
  std::uint64_t seed = 0;
  PAGODA_RETURN_IF_ERROR(read_field(j, "temperature", temperature, &json::is_number));
  PAGODA_RETURN_IF_ERROR(read_field(j, "top_p", top_p, &json::is_number));
  PAGODA_RETURN_IF_ERROR(read_field(j, "min_p", min_p, &json::is_number));
  PAGODA_RETURN_IF_ERROR(read_field(j, "top_k", top_k, &json::is_number_integer));
  PAGODA_RETURN_IF_ERROR(read_field(j, "max_tokens", max_tokens, &json::is_number_integer));
  PAGODA_RETURN_IF_ERROR(read_field(j, "n", n, &json::is_number_integer));
  PAGODA_RETURN_IF_ERROR(read_field(j, "priority", priority, &json::is_number_integer));
  PAGODA_RETURN_IF_ERROR(read_field(j, "seed", seed, &json::is_number_unsigned));
  PAGODA_RETURN_IF_ERROR(read_field(j, "cache_salt", r.cache_salt, &json::is_string));
  PAGODA_RETURN_IF_ERROR(read_field(j, "tenant", r.tenant, &json::is_string));
  if (auto s = j.find("stop"); s != j.end() && !s->is_null()) {
    if (s->is_string()) r.stop.push_back(s->get<std::string>());
    else if (s->is_array() && std::all_of(s->begin(), s->end(), [](const json& x) { return x.is_string(); }))
      r.stop = s->get<std::vector<std::string>>();
    else return error(errc::invalid_argument, "field 'stop' must be a string or an array of strings");
  }
  if (max_tokens < 1 || max_tokens > (1 << 24)) return error(errc::invalid_argument, "field 'max_tokens' out of range: {}", max_tokens);
  if (n < 1 || n > 128) return error(errc::invalid_argument, "field 'n' out of range [1, 128]: {}", n);
  if (top_k < -1 || top_k > (1 << 30)) return error(errc::invalid_argument, "field 'top_k' out of range: {}", top_k);
  r.max_tokens = static_cast<int>(max_tokens);
  r.n = static_cast<int>(n);
  r.priority = static_cast<int>(std::clamp<std::int64_t>(priority, -(1 << 30), 1 << 30));
  r.sampling.temperature = static_cast<float>(temperature);
  r.sampling.top_p = static_cast<float>(top_p);
  r.sampling.min_p = static_cast<float>(min_p);
  r.sampling.top_k = static_cast<int>(top_k);
  r.sampling.seed = has_seed ? seed : seeds();
  PAGODA_RETURN_IF_ERROR(r.sampling.validate());
  return r;
}

json summary_json(const engine_core& eng, double seconds, std::size_t n_requests, std::size_t n_errors,
                  double mean_fragmentation, double peak_usage) {
  const engine_stats& st = eng.stats();
  kv_metrics kv = eng.kv_stats();
  double gen_tps = st.n_generated_tokens / std::max(seconds, 1e-9);
  return {{"requests", n_requests},
          {"errors", n_errors},
          {"seconds", seconds},
          {"prompt_tokens", st.n_prompt_tokens},
          {"computed_prompt_tokens", st.n_computed_prompt_tokens},
          {"generated_tokens", st.n_generated_tokens},
          {"generation_tokens_per_s", gen_tps},
          {"total_tokens_per_s", (st.n_prompt_tokens + st.n_generated_tokens) / std::max(seconds, 1e-9)},
          {"steps", st.n_steps},
          {"peak_running", st.peak_running},
          {"blocks_total", kv.n_blocks_total},
          {"block_size", kv.block_size_tokens},
          {"peak_blocks_used", kv.n_blocks_used_peak},
          {"peak_kv_usage", peak_usage},
          {"kv_usage_end", kv.usage()},
          {"fragmentation_mean", mean_fragmentation},
          {"fragmentation_end", kv.fragmentation()},
          {"prefix_query_tokens", kv.n_prefix_query_tokens},
          {"prefix_hit_tokens", kv.n_prefix_hit_tokens},
          {"prefix_hit_rate", kv.prefix_hit_ratio()},
          {"preemptions", kv.n_preemptions},
          {"evictions", kv.n_evictions},
          {"cow_copies", kv.n_cow_copies},
          {"ttft_p50_s", st.ttft_seconds.quantile(0.5)},
          {"ttft_p99_s", st.ttft_seconds.quantile(0.99)},
          {"itl_p50_s", st.itl_seconds.quantile(0.5)},
          {"itl_p99_s", st.itl_seconds.quantile(0.99)}};
}

int batch(const batch_options& o) {
  std::ifstream in(o.input);
  if (!in) return fail(error(errc::not_found, "cannot open {}", o.input));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.engine.config));
  PAGODA_ASSIGN_OR_RETURN_CLI(engine_stack stack, open_engine(*model, o.engine));
  engine_core* eng = stack.core.get();

  std::vector<line_result> results;
  std::unordered_map<std::string, std::size_t> by_id;
  std::mt19937_64 seeds(std::random_device{}());
  std::string line;
  std::size_t n_errors = 0;
  int line_no = 0;
  auto reject = [&](line_result& r, const std::string& msg) {
    r.error = msg;
    r.done = true;
    ++n_errors;
    std::fprintf(stderr, "pagoda: %s: line %d: %s\n", o.input.c_str(), line_no, msg.c_str());
  };
  std::int64_t t0 = now_us();
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    line_result& r = results.emplace_back();
    r.id = fmt::format("line-{}", line_no);
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      reject(r, "not valid JSON");
      continue;
    }
    auto req = parse_line(j, model->vocab(), seeds);
    if (j.is_object() && j.contains("id") && (j["id"].is_string() || j["id"].is_number_integer()))
      r.id = j["id"].is_string() ? j["id"].get<std::string>() : std::to_string(j["id"].get<long long>());
    if (!req.ok()) {
      reject(r, req.error().message());
      continue;
    }
    if (by_id.contains(req->id)) {
      reject(r, fmt::format("duplicate id '{}'", req->id));
      continue;
    }
    r.completions.resize(req->n);
    std::string id = req->id;
    if (auto st = eng->add_request(std::move(*req)); !st.ok()) {
      reject(r, st.message());
      continue;
    }
    by_id[id] = results.size() - 1;
  }

  progress_bar bar("batch", static_cast<std::int64_t>(by_id.size()));
  std::vector<engine_event> events;
  std::size_t n_done = 0;
  double frag_sum = 0, peak_usage = 0;
  std::int64_t frag_steps = 0;
  while (eng->has_work()) {
    events.clear();
    eng->step(events);
    kv_metrics kv = eng->kv_stats();
    if (kv.n_blocks_used > 0) {
      frag_sum += kv.fragmentation();
      ++frag_steps;
    }
    peak_usage = std::max(peak_usage, kv.usage());
    for (engine_event& e : events) {
      line_result& r = results[by_id.at(e.request_id)];
      auto& c = r.completions[e.index];
      c.text += e.text;
      c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
      if (!e.finish_reason.empty()) c.finish_reason = e.finish_reason;
      if (!e.error.empty() && r.error.empty()) {
        r.error = e.error;
        r.error_type = "internal_error";
        ++n_errors;
      }
      if (e.request_finished) {
        r.usage = e.usage;
        r.done = true;
        bar.update(static_cast<std::int64_t>(++n_done));
      }
    }
  }
  bar.finish();
  const double secs = (now_us() - t0) * 1e-6;

  std::FILE* out = stdout;
  if (!o.output.empty() && o.output != "-") {
    out = std::fopen(o.output.c_str(), "w");
    if (!out) return fail(error(errc::io_error, "cannot write {}", o.output));
  }
  const std::vector<std::string> tier_names = stack.warehouse ? stack.warehouse->tier_names() : std::vector<std::string>{};
  for (const line_result& r : results) {
    json j = {{"id", r.id}};
    if (!r.error.empty()) {
      j["error"] = {{"message", r.error}, {"type", r.error_type}};
    } else {
      json comps = json::array();
      for (std::size_t i = 0; i < r.completions.size(); ++i)
        comps.push_back({{"index", i},
                         {"text", r.completions[i].text},
                         {"token_ids", r.completions[i].tokens},
                         {"finish_reason", r.completions[i].finish_reason}});
      j["completions"] = comps;
      j["usage"] = {{"prompt_tokens", r.usage.prompt_tokens},
                    {"completion_tokens", r.usage.completion_tokens},
                    {"total_tokens", r.usage.prompt_tokens + r.usage.completion_tokens},
                    {"cached_tokens", r.usage.cached_tokens}};
      if (stack.warehouse) {
        json tiers = json::object();
        for (const auto& [tier, n] : cached_tokens_by_tier(r.usage, tier_names)) tiers[tier] = n;
        j["usage"]["cached_tokens_by_tier"] = tiers;
      }
    }
    std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
    std::fprintf(out, "%s\n", s.c_str());
  }
  if (out != stdout) std::fclose(out);

  json summary = summary_json(*eng, secs, results.size(), n_errors, frag_steps ? frag_sum / frag_steps : 0.0, peak_usage);
  if (o.json_summary) {
    std::fprintf(stderr, "%s\n", summary.dump().c_str());
  } else {
    std::fprintf(stderr,
                 "pagoda batch: %zu requests (%zu errors) in %.2f s; %lld prompt + %lld generated tokens; "
                 "%.1f generated tok/s, %.1f total tok/s\n"
                 "pagoda batch: peak %d/%d blocks (%.1f%%), fragmentation %.1f%% mean, prefix hits %lld/%lld tokens "
                 "(%.1f%%), %lld preemptions, %lld evictions, %lld COW copies\n",
                 results.size(), n_errors, secs, static_cast<long long>(summary["prompt_tokens"].get<std::int64_t>()),
                 static_cast<long long>(summary["generated_tokens"].get<std::int64_t>()),
                 summary["generation_tokens_per_s"].get<double>(), summary["total_tokens_per_s"].get<double>(),
                 summary["peak_blocks_used"].get<int>(), summary["blocks_total"].get<int>(), 100 * peak_usage,
                 100 * summary["fragmentation_mean"].get<double>(),
                 static_cast<long long>(summary["prefix_hit_tokens"].get<std::int64_t>()),
                 static_cast<long long>(summary["prefix_query_tokens"].get<std::int64_t>()),
                 100 * summary["prefix_hit_rate"].get<double>(),
                 static_cast<long long>(summary["preemptions"].get<std::int64_t>()),
                 static_cast<long long>(summary["evictions"].get<std::int64_t>()),
                 static_cast<long long>(summary["cow_copies"].get<std::int64_t>()));
  }
  return n_errors > 0 && n_errors == results.size() ? 1 : 0;
}

}  // namespace

void register_batch(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<batch_options>();
  CLI::App* cmd = app.add_subcommand("batch", "offline batch inference over a JSONL file of requests");
  add_engine_options(cmd, opts->engine);
  cmd->add_option("-i,--input", opts->input, "requests, one JSON object per line")->required();
  cmd->add_option("-o,--output", opts->output, "results file (default: stdout)");
  cmd->add_flag("--json-summary", opts->json_summary, "print the summary as JSON (stderr)");
  cmd->callback([opts, &action] { action = [opts] { return batch(*opts); }; });
}

}  // namespace pagoda::cli
