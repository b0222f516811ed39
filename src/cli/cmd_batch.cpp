// pagoda batch: offline batch inference over a JSONL file (vLLM's LLM.generate).
// Every request is queued at once; the engine batches them continuously.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/clock.h"
#include "server/api_setup.h"
#include "server/openai_response.h"

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
  json id;
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
  int logprobs = -1;                               // as asked by the line
  std::optional<server::response_builder> shaped;  // the logprobs in /v1/completions' shape
};

// A line's id: a string, or an integer kept exactly as written (64-bit
// unsigned ones too); echoed verbatim in its result.
result<json> read_id(const json& j) {
  auto id = j.find("id");
  if (id == j.end()) return error(errc::invalid_argument, "missing field 'id'");
  if (!id->is_string() && !id->is_number_integer())
    return error(errc::invalid_argument, "'id' must be a string or an integer, not {}", id->type_name());
  return *id;
}

// One line: {"id": ..., "tenant": ..., and the fields of a /v1/completions
// body}, read by the server's own parser so both take the same fields, ranges
// and messages. One prompt a line.
result<server::api_call> parse_line(const json& j, const server::api_context& ctx) {
  if (!j.is_object()) return error(errc::invalid_argument, "expected a JSON object, got {}", j.type_name());
  std::string tenant;
  if (auto t = j.find("tenant"); t != j.end() && !t->is_null()) {
    if (!t->is_string()) return error(errc::invalid_argument, "'tenant' must be a string, not {}", t->type_name());
    tenant = t->get<std::string>();
  }
  server::api_result<server::api_call> call = server::parse_request(server::api_kind::completion, j, ctx, tenant);
  if (!call.ok()) return error(errc::invalid_argument, "{}", call.error.message);
  if (call.value->requests.size() != 1)
    return error(errc::invalid_argument, "a batch line holds one prompt, this one holds {}", call.value->requests.size());
  if (call.value->echo || call.value->prompt_logprobs >= 0)
    return error(errc::invalid_argument, "'echo' and 'prompt_logprobs' (prompt scoring) are served by /v1/completions; "
                 "a batch line's result carries no prompt");
  return std::move(*call.value);
}

// Per drafter: proposed and accepted draft tokens, acceptance rate, mean accepted length.
json speculative_json(const engine_stats& st) {
  json out = json::object();
  for (const auto& [name, d] : st.spec_decode)
    out[name] = {{"drafts", d.n_drafts},
                 {"draft_tokens", d.n_draft_tokens},
                 {"accepted_tokens", d.n_accepted_tokens},
                 {"acceptance_rate", d.n_draft_tokens > 0 ? static_cast<double>(d.n_accepted_tokens) / static_cast<double>(d.n_draft_tokens) : 0.0},
                 {"mean_accepted_length", d.mean_accepted_length()},
                 {"draft_seconds", d.draft_seconds},
                 {"verify_seconds", d.verify_seconds}};
  return out;
}

json summary_json(const engine_core& eng, double seconds, std::size_t n_requests, std::size_t n_errors,
                  double mean_fragmentation, double peak_usage, std::int64_t decode_tokens, std::int64_t decode_us) {
  const engine_stats& st = eng.stats();
  kv_read_counts reads;  // decode steps' attention, every policy
  for (const auto& [policy, r] : st.kv_reads) reads += r.decode;
  const auto ratio = [](std::int64_t a, std::int64_t b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0; };
  kv_metrics kv = eng.kv_stats();
  double gen_tps = st.n_generated_tokens / std::max(seconds, 1e-9);
  json out = {{"requests", n_requests},
          {"errors", n_errors},
          {"seconds", seconds},
          {"prompt_tokens", st.n_prompt_tokens},
          {"computed_prompt_tokens", st.n_computed_prompt_tokens},
          {"generated_tokens", st.n_generated_tokens},
          {"generation_tokens_per_s", gen_tps},
          {"decode_tokens", decode_tokens},
          {"decode_seconds", decode_us * 1e-6},
          {"decode_tokens_per_s", decode_us > 0 ? decode_tokens / (decode_us * 1e-6) : 0.0},
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
          // Flat, as every field of the summary (one line of JSON that scripts cut at its last '{').
          {"evictions_capacity", kv.n_evictions_by_reason[static_cast<std::size_t>(eviction_reason::capacity)]},
          {"evictions_quota", kv.n_evictions_by_reason[static_cast<std::size_t>(eviction_reason::quota)]},
          {"evictions_admin", kv.n_evictions_by_reason[static_cast<std::size_t>(eviction_reason::admin)]},
          {"cow_copies", kv.n_cow_copies},
          {"policy_compactions", st.n_policy_compactions},
          {"policy_evicted_slots", st.n_policy_evicted_slots},
          {"peak_selector_bytes", st.peak_selector_bytes},
          // Decode attention's reads per query row (token x layer x KV head), and
          // as a fraction of what the rows could see: below 1 with a sparse read.
          {"decode_read_tokens_per_row", ratio(reads.tokens_read, reads.rows)},
          {"decode_read_blocks_per_row", ratio(reads.blocks_read, reads.rows)},
          {"decode_read_fraction", ratio(reads.tokens_read, reads.tokens_visible)},
          {"decode_read_blocks_fraction", ratio(reads.blocks_read, reads.blocks_visible)},
          {"ttft_p50_s", st.ttft_seconds.quantile(0.5)},
          {"ttft_p99_s", st.ttft_seconds.quantile(0.99)},
          {"itl_p50_s", st.itl_seconds.quantile(0.5)},
          {"itl_p99_s", st.itl_seconds.quantile(0.99)}};
  // Only when something speculated: the summary of a plain run is as it was
  // (its last line stays one flat object that scripts cut at the last '{').
  if (!st.spec_decode.empty()) out["speculative"] = speculative_json(st);
  return out;
}

// The input: a file, or standard input for "-". A directory is an error
// (an ifstream opens one and reads nothing).
result<std::unique_ptr<std::istream>> open_input(const std::string& path) {
  if (path == "-") return std::unique_ptr<std::istream>(new std::istream(std::cin.rdbuf()));
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return error(errc::invalid_argument, "{} is a directory, not a JSONL file", path);
  auto in = std::make_unique<std::ifstream>(path);
  if (!*in) return error(errc::not_found, "cannot open {}", path);
  return std::unique_ptr<std::istream>(std::move(in));
}

int batch(const batch_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(std::unique_ptr<std::istream> in, open_input(o.input));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.engine.config));
  auto opened = open_engine(*model, o.engine);
  if (!opened.ok()) return fail_engine(opened.error());
  engine_stack stack = std::move(*opened);
  engine_core* eng = stack.core.get();
  std::fprintf(stderr, "pagoda batch: context %d, %s\n", eng->config().max_model_len,
               kv_pool_line(eng->config(), eng->kv_stats()).c_str());
  server::api_options aopts;
  aopts.model_path = o.engine.config.model_path;
  aopts.max_n = 128;  // the engine's own limit (a server's is --max-n)
  PAGODA_ASSIGN_OR_RETURN_CLI(server::api_context ctx,
                              server::make_api_context(*model, eng->config().max_model_len, aopts, nullptr));
  const std::string input_name = o.input == "-" ? "stdin" : o.input;

  std::vector<line_result> results;
  std::unordered_map<std::string, std::size_t> by_id;  // internal request id -> result
  std::unordered_set<std::string> user_ids;            // the lines' ids, as JSON text
  std::string line;
  std::size_t n_errors = 0;
  int line_no = 0;
  auto reject = [&](line_result& r, const std::string& msg) {
    r.error = msg;
    r.done = true;
    ++n_errors;
    std::fprintf(stderr, "pagoda: %s: line %d: %s\n", input_name.c_str(), line_no, msg.c_str());
  };
  std::int64_t t0 = now_us();
  while (std::getline(*in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    line_result& r = results.emplace_back();
    r.id = fmt::format("line-{}", line_no);
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      reject(r, "not valid JSON");
      continue;
    }
    auto id = j.is_object() ? read_id(j) : result<json>(error(errc::invalid_argument, "expected a JSON object, got {}", j.type_name()));
    if (!id.ok()) {
      reject(r, id.error().message());
      continue;
    }
    r.id = *id;
    auto call = parse_line(j, ctx);
    if (!call.ok()) {
      reject(r, call.error().message());
      continue;
    }
    if (!user_ids.insert(r.id.dump()).second) {
      reject(r, fmt::format("duplicate id {}", r.id.dump()));
      continue;
    }
    request& req = call->requests[0];
    req.id = fmt::format("line-{}", line_no);  // internal: never shown
    r.completions.resize(req.n);
    r.logprobs = call->logprobs;
    if (r.logprobs >= 0) r.shaped.emplace(*call, req.id, ctx.model_names.front(), 0, model->vocab());
    const std::string internal = req.id;
    if (auto st = eng->add_request(std::move(req)); !st.ok()) {
      reject(r, st.message());
      continue;
    }
    by_id[internal] = results.size() - 1;
  }

  progress_bar bar("batch", static_cast<std::int64_t>(by_id.size()));
  std::vector<engine_event> events;
  std::size_t n_done = 0;
  double frag_sum = 0, peak_usage = 0;
  std::int64_t frag_steps = 0;
  // Decode speed: the tokens of steps that computed no prompt token, over
  // those steps' time (a step that ends a prompt yields tokens too, but its
  // time is mostly the prompt's).
  std::int64_t decode_tokens = 0, decode_us = 0;
  while (eng->has_work()) {
    events.clear();
    const std::int64_t prompt_before = eng->stats().n_computed_prompt_tokens;
    const std::int64_t step_t0 = now_us();
    eng->step(events);
    if (eng->stats().n_computed_prompt_tokens == prompt_before) {
      decode_us += now_us() - step_t0;
      for (const engine_event& e : events) decode_tokens += static_cast<std::int64_t>(e.tokens.size());
    }
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
      if (r.shaped) r.shaped->add(0, e);
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
    const json shaped = r.shaped ? r.shaped->body() : json();
    if (!r.error.empty()) {
      j["error"] = {{"message", r.error}, {"type", r.error_type}};
    } else {
      json comps = json::array();
      for (std::size_t i = 0; i < r.completions.size(); ++i)
        comps.push_back({{"index", i},
                         {"text", r.completions[i].text},
                         {"token_ids", r.completions[i].tokens},
                         {"finish_reason", r.completions[i].finish_reason}});
      if (r.shaped)
        for (std::size_t i = 0; i < comps.size(); ++i) comps[i]["logprobs"] = shaped["choices"][i]["logprobs"];
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

  json summary = summary_json(*eng, secs, results.size(), n_errors, frag_steps ? frag_sum / frag_steps : 0.0, peak_usage,
                              decode_tokens, decode_us);
  if (o.json_summary) {
    std::fprintf(stderr, "%s\n", summary.dump().c_str());
  } else {
    std::fprintf(stderr,
                 "pagoda batch: %zu requests (%zu errors) in %.2f s; %lld prompt + %lld generated tokens; "
                 "%.1f generated tok/s overall, %.1f total tok/s, decode %.1f tok/s (%lld tokens of steps without "
                 "prompt work)\n"
                 "pagoda batch: peak %d/%d blocks (%.1f%%), fragmentation %.1f%% mean, prefix hits %lld/%lld tokens "
                 "(%.1f%%), %lld preemptions, %lld evictions, %lld COW copies\n",
                 results.size(), n_errors, secs, static_cast<long long>(summary["prompt_tokens"].get<std::int64_t>()),
                 static_cast<long long>(summary["generated_tokens"].get<std::int64_t>()),
                 summary["generation_tokens_per_s"].get<double>(), summary["total_tokens_per_s"].get<double>(),
                 summary["decode_tokens_per_s"].get<double>(), static_cast<long long>(decode_tokens),
                 summary["peak_blocks_used"].get<int>(), summary["blocks_total"].get<int>(), 100 * peak_usage,
                 100 * summary["fragmentation_mean"].get<double>(),
                 static_cast<long long>(summary["prefix_hit_tokens"].get<std::int64_t>()),
                 static_cast<long long>(summary["prefix_query_tokens"].get<std::int64_t>()),
                 100 * summary["prefix_hit_rate"].get<double>(),
                 static_cast<long long>(summary["preemptions"].get<std::int64_t>()),
                 static_cast<long long>(summary["evictions"].get<std::int64_t>()),
                 static_cast<long long>(summary["cow_copies"].get<std::int64_t>()));
    if (summary.contains("speculative"))
      for (const auto& [name, d] : summary["speculative"].items())
        std::fprintf(stderr, "pagoda batch: speculative %s: %lld of %lld draft tokens accepted (%.1f%%), %.2f tokens per "
                     "verification step; %.1f ms drafting, %.1f ms verifying\n", name.c_str(),
                     static_cast<long long>(d["accepted_tokens"].get<std::int64_t>()),
                     static_cast<long long>(d["draft_tokens"].get<std::int64_t>()), 100 * d["acceptance_rate"].get<double>(),
                     d["mean_accepted_length"].get<double>(), 1e3 * d["draft_seconds"].get<double>(),
                     1e3 * d["verify_seconds"].get<double>());
  }
  // Any failed line fails the run (scripts check the exit code); the output
  // still holds every line's result, the failed ones as error objects.
  return n_errors > 0 ? 1 : 0;
}

}  // namespace

void register_batch(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<batch_options>();
  CLI::App* cmd = app.add_subcommand("batch", "offline batch inference over a JSONL file of requests");
  add_engine_options(cmd, opts->engine);
  cmd->add_option("-i,--input", opts->input,
                  "requests, one JSON object per line: an id, a tenant, and the fields of a /v1/completions body "
                  "(docs/serving.md); - reads standard input")
      ->required();
  cmd->add_option("-o,--output", opts->output, "results file (default: stdout)");
  cmd->add_flag("--json-summary", opts->json_summary, "print the summary as JSON (stderr)");
  cmd->callback([opts, &action] { action = [opts] { return batch(*opts); }; });
}

}  // namespace pagoda::cli
