// pagoda run: one prompt, one continuation, streamed to stdout. A batch of one
// through the public engine (pagoda/engine.h), as a library user would run it.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/chat.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/sampling_options.h"
#include "core/clock.h"
#include "core/thread_pool.h"
#include "model/llama.h"
#include "pagoda/engine.h"
#include "policy/streaming.h"
#include "vision/image_prompt.h"

namespace pagoda::cli {
namespace {

struct run_options {
  engine_config config;
  std::string prompt;
  std::string prompt_file;
  int n_predict = 128;
  sampling_flags sampling;
  bool json = false;
  bool conversation = false;  // -cnv: a chat session instead (the prompt is its system message)
  std::string mmproj;         // --mmproj: llama.cpp's vision projector for --image
  std::string image;          // --image: a PNG or JPEG file
};

// CPU time of the whole process (every thread), in microseconds. Next to the
// wall time it says how much of a run the machine gave us: on a shared
// machine a phase's wall time grows with other processes, its CPU time at one
// thread much less.
std::int64_t process_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

// The prompt with --image in it, as mtmd lays it out: the text up to the
// media marker "<__media__>", the image part (vision/image_prompt.h), the
// rest; without the marker the image comes first, after BOS (as llama.cpp's
// mtmd-cli puts it). Errors: an mmproj that does not load or does not match
// the model, an image that does not decode.
result<request> image_prompt(const run_options& o, const engine& eng) {
  auto proj = vision::mmproj::open(o.mmproj);
  if (!proj.ok()) return proj.error().with_context("--mmproj " + o.mmproj);
  std::ifstream in(o.image, std::ios::binary);
  if (!in) return error(errc::not_found, "--image {}: cannot open", o.image);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The text model's tokenizer and width (its weights stay unread in the mapping).
  auto text = llama_model::load(o.config.model_path, {true});
  if (!text.ok()) return text.error().with_context("-m " + o.config.model_path);
  thread_pool pool(o.config.n_threads);
  auto part = vision::make_image_part(bytes, **proj, (*text)->vocab(), (*text)->hparams().n_embd, pool);
  if (!part.ok()) return part.error().with_context(fmt::format("--image {} with --mmproj {}", o.image, o.mmproj));
  constexpr std::string_view k_marker = "<__media__>";
  const std::size_t at = o.prompt.find(k_marker);
  const std::string before = at == std::string::npos ? "" : o.prompt.substr(0, at);
  const std::string after = at == std::string::npos ? o.prompt : o.prompt.substr(at + k_marker.size());
  request req;
  req.prompt = eng.tokenize(before, true);
  const auto offset = static_cast<std::int32_t>(req.prompt.size());
  req.prompt.insert(req.prompt.end(), part->tokens.begin(), part->tokens.end());
  const std::vector<token_id> tail = eng.tokenize(after, false);
  req.prompt.insert(req.prompt.end(), tail.begin(), tail.end());
  for (image_span& s : part->spans) {
    s.begin += offset;
    req.images.push_back(std::move(s));
  }
  return req;
}

// -f FILE: the file's text, less one trailing newline (as llama.cpp reads it).
result<std::string> read_prompt_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return error(errc::invalid_argument, "-f {}: a directory, not a prompt file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(errc::not_found, "-f {}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  return text;
}

int run(run_options o) {
  PAGODA_RETURN_IF_ERROR_CLI(finish_sampling_options(o.sampling));
  if (!o.prompt_file.empty()) {
    PAGODA_ASSIGN_OR_RETURN_CLI(o.prompt, read_prompt_file(o.prompt_file));
  }
  // One sequence; unless the flags size the pool, it holds one full context.
  o.config.max_num_seqs = 1;
  auto made = engine::create(o.config);
  if (!made.ok()) return fail_engine(made.error());
  auto eng = std::move(*made);
  const engine_info& info = eng->info();

  request req;
  if (!o.image.empty()) {
    PAGODA_ASSIGN_OR_RETURN_CLI(req, image_prompt(o, *eng));
  } else {
    req.prompt = eng->tokenize(o.prompt);
  }
  const std::vector<token_id> prompt = req.prompt;
  int n_image_tokens = 0;
  for (const image_span& s : req.images) n_image_tokens += s.n_tokens;
  if (prompt.empty()) return fail(error(errc::invalid_argument, "the prompt is empty and the model has no BOS token"));
  if (static_cast<int>(prompt.size()) >= info.n_ctx)
    return fail(error(errc::out_of_range, "the prompt has {} tokens{} but the context holds {} (--ctx)", prompt.size(),
                      n_image_tokens > 0 ? fmt::format(" ({} of them the image's)", n_image_tokens) : "", info.n_ctx));
  req.id = "run";
  // Generation stops at the context, as llama.cpp's does, unless a streaming
  // window (--kv-policy window:budget=N,positions=cache) keeps it going.
  req.max_tokens = streams_past_context(o.config.kv_policy, info.n_ctx)
                       ? o.n_predict
                       : std::min(o.n_predict, info.n_ctx - static_cast<int>(prompt.size()));
  req.sampling = o.sampling.sampling;
  req.ignore_eos = o.sampling.ignore_eos;

  // Refused (a pool too small for prompt + -n, ...) before anything is printed.
  const std::int64_t t0 = now_us(), cpu0 = process_cpu_us();
  if (auto st = eng->add_request(std::move(req)); !st.ok()) {
    if (st.code() == errc::resource_exhausted)
      return fail(st.with_context("the KV pool is too small (raise --kv-cache-size or --max-kv-tokens)"));
    return fail(st);
  }
  if (!o.json) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    std::fflush(stdout);
  }
  std::vector<token_id> generated;
  std::string text, stop_reason = "length";
  std::int64_t t1 = -1, cpu1 = -1;
  // The prompt's last pass yields the first token; every later pass one more.
  // Generation speed is the later passes' tokens over their time.
  std::int64_t n_sampled = 0, n_decode_passes = 0;
  std::vector<engine_event> events;
  while (eng->has_work()) {
    events.clear();
    const bool decoding = t1 >= 0;
    eng->step(events);
    bool produced = false;
    for (const engine_event& e : events) {
      n_sampled += static_cast<std::int64_t>(e.tokens.size());
      produced |= !e.tokens.empty();
      if (!e.tokens.empty() && t1 < 0) t1 = now_us(), cpu1 = process_cpu_us();
      generated.insert(generated.end(), e.tokens.begin(), e.tokens.end());
      text += e.text;
      if (!o.json && !e.text.empty()) {
        std::fwrite(e.text.data(), 1, e.text.size(), stdout);
        std::fflush(stdout);
      }
      if (e.finish_reason == "error") return fail(error(errc::internal, "{}", e.error));
      if (!e.finish_reason.empty()) stop_reason = e.finish_reason;
    }
    n_decode_passes += decoding && produced;
  }
  const std::int64_t t2 = now_us(), cpu2 = process_cpu_us();
  if (t1 < 0) t1 = t2, cpu1 = cpu2;
  // The end-of-generation token ends the text; it is not part of it.
  if (stop_reason == "stop" && !generated.empty() && eng->is_end_of_generation(generated.back())) {
    generated.pop_back();
    stop_reason = "eos";
  }

  const double prompt_s = (t1 - t0) * 1e-6, gen_s = (t2 - t1) * 1e-6;
  // Tokens of the passes after the prompt's (an end-of-generation token
  // counts: a pass produced it), over those passes' time.
  const std::int64_t n_decode_tokens = std::max<std::int64_t>(n_sampled - 1, 0);
  const double gen_tps = n_decode_tokens > 0 ? n_decode_tokens / std::max(gen_s, 1e-9) : 0.0;
  const kv_usage kv = eng->usage();
  // The sliding-window group's blocks (windowed layers beside global ones) are of another size.
  const std::size_t kv_used = static_cast<std::size_t>(kv.n_blocks_used_peak) * info.kv_bytes_per_block +
                              static_cast<std::size_t>(kv.n_window_blocks_used_peak) * info.kv_window_block_bytes;
  const std::string type_k = info.kv_layout.substr(0, info.kv_layout.find_first_of("+/:,"));
  const std::size_t plus = info.kv_layout.find('+');
  const std::string type_v =
      plus == std::string::npos ? type_k : info.kv_layout.substr(plus + 1, info.kv_layout.find_first_of("/,", plus + 1) - plus - 1);
  if (o.json) {
    nlohmann::json j;
    j["prompt"] = o.prompt;
    j["prompt_tokens"] = prompt;
    j["image_tokens"] = n_image_tokens;
    j["tokens"] = generated;
    j["text"] = text;
    j["stop_reason"] = stop_reason;
    j["seed"] = o.sampling.sampling.seed;
    j["timings"] = {{"prompt_ms", prompt_s * 1e3},
                    {"prompt_tokens_per_s", prompt.size() / std::max(prompt_s, 1e-9)},
                    {"generation_ms", gen_s * 1e3},
                    {"generation_tokens", n_decode_tokens},
                    {"generation_passes", n_decode_passes},
                    {"generation_tokens_per_s", gen_tps},
                    {"prompt_cpu_ms", (cpu1 - cpu0) * 1e-3},
                    {"generation_cpu_ms", (cpu2 - cpu1) * 1e-3}};
    j["kv"] = {{"layout", info.kv_layout},
               {"type_k", type_k},
               {"type_v", type_v},
               {"block_size", info.kv_block_size},
               {"blocks_used", kv.n_blocks_used_peak},
               {"blocks_total", info.kv_blocks},
               {"bytes_used", kv_used},
               {"bytes_total", info.kv_bytes_total},
               {"bytes_per_token", info.kv_bytes_per_token},
               {"window_blocks", info.kv_window_blocks},
               {"window_blocks_used", kv.n_window_blocks_used_peak},
               {"window_block_bytes", info.kv_window_block_bytes}};
    std::string out = j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("%s\n", out.c_str());
  } else {
    std::printf("\n");
  }
  std::fprintf(stderr,
               "pagoda: prompt %zu tokens in %.1f ms (%.1f tok/s, the first token with it), then %lld tokens in "
               "%.1f ms over %lld passes (%.1f tok/s)\n"
               "pagoda: KV %s used (%d blocks of %d tokens, %s/token, %s) of a %s pool\n",
               prompt.size(), prompt_s * 1e3, prompt.size() / std::max(prompt_s, 1e-9),
               static_cast<long long>(n_decode_tokens), gen_s * 1e3, static_cast<long long>(n_decode_passes), gen_tps,
               human_bytes(static_cast<double>(kv_used)).c_str(), kv.n_blocks_used_peak, info.kv_block_size,
               human_bytes(info.kv_bytes_per_token).c_str(), info.kv_layout.c_str(),
               human_bytes(static_cast<double>(info.kv_bytes_total)).c_str());
  if (!o.sampling.sampling.is_greedy())
    std::fprintf(stderr, "pagoda: seed %llu%s\n", static_cast<unsigned long long>(o.sampling.sampling.seed),
                 o.sampling.seed_given ? "" : " (drawn for this run; --seed repeats it)");
  if (const speculation_usage sp = eng->speculation(); sp.n_drafts > 0)
    std::fprintf(stderr, "pagoda: speculative: %lld of %lld draft tokens accepted (%.1f%%), %.2f tokens per verification step; "
                 "%.1f ms drafting, %.1f ms verifying\n",
                 static_cast<long long>(sp.n_accepted_tokens), static_cast<long long>(sp.n_draft_tokens),
                 100.0 * static_cast<double>(sp.n_accepted_tokens) / static_cast<double>(sp.n_draft_tokens),
                 1.0 + static_cast<double>(sp.n_accepted_tokens) / static_cast<double>(sp.n_drafts),
                 1e3 * sp.draft_seconds, 1e3 * sp.verify_seconds);
  return 0;
}

}  // namespace

void register_run(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<run_options>();
  CLI::App* cmd = app.add_subcommand("run", "generate a continuation of a prompt");
  add_model_options(cmd, opts->config);
  add_kv_options(cmd, opts->config);
  CLI::Option* prompt = cmd->add_option("-p,--prompt", opts->prompt, "prompt text");
  CLI::Option* file = cmd->add_option("-f,--file", opts->prompt_file, "read the prompt from a file (llama.cpp's -f)");
  prompt->excludes(file);
  cmd->add_option("-n,--n-predict", opts->n_predict, "tokens to generate")->check(CLI::Range(0, 1 << 24));
  add_sampling_options(cmd, opts->sampling);
  cmd->add_option("-b,--ubatch,--max-num-batched-tokens", opts->config.max_num_batched_tokens,
                  "prompt tokens per forward step")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--json", opts->json, "print one JSON object instead of text");
  CLI::Option* mmproj = cmd->add_option("--mmproj", opts->mmproj,
                                        "FILE: llama.cpp's vision projector GGUF (idefics3/SmolVLM) for --image")
                            ->check(CLI::ExistingFile);
  cmd->add_option("--image", opts->image,
                  "FILE: a PNG or JPEG image in the prompt (at \"<__media__>\" in -p, else before the text); needs --mmproj")
      ->check(CLI::ExistingFile)
      ->needs(mmproj);
  cmd->add_flag("--conversation", opts->conversation,
                "an interactive chat instead (llama.cpp's -cnv; the same as `pagoda chat`): -p or -f is its system "
                "message, -n the tokens of each reply");
  cmd->callback([opts, &action, prompt, file] {
    if (opts->conversation) {
      action = [opts] {
        chat_options c;
        c.engine.config = opts->config;
        c.sampling = opts->sampling;
        c.n_predict = opts->n_predict;
        c.system = opts->prompt;
        if (!opts->prompt_file.empty()) {
          PAGODA_ASSIGN_OR_RETURN_CLI(c.system, read_prompt_file(opts->prompt_file));
        }
        return run_chat(std::move(c));
      };
      return;
    }
    if (prompt->count() + file->count() == 0) throw CLI::RequiredError("a prompt: -p TEXT or -f FILE");
    action = [opts] { return run(*opts); };
  });
}

}  // namespace pagoda::cli
