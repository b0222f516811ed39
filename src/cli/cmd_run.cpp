// pagoda run: one prompt, one continuation, streamed to stdout.
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/simple_kv.h"
#include "core/clock.h"
#include "model/sampler.h"
#include "model/tokenizer_stream.h"

namespace pagoda::cli {
namespace {

struct run_options {
  model_options model;
  kv_options kv;
  std::string prompt;
  int n_predict = 128;
  sampling_params sampling;
  bool json = false;
  int ubatch = 512;
};

int run(const run_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.model));
  const llama_hparams& hp = model->hparams();
  const tokenizer& vocab = model->vocab();
  if (auto st = o.sampling.validate(); !st.ok()) return fail(st);

  std::vector<token_id> prompt = vocab.encode(o.prompt, /*add_bos=*/true);
  if (prompt.empty()) return fail(error(errc::invalid_argument, "the prompt is empty and the model has no BOS token"));
  const int n_ctx = context_length(o.model, hp);
  if (static_cast<int>(prompt.size()) >= n_ctx)
    return fail(error(errc::out_of_range, "the prompt has {} tokens but the context holds {} (--ctx)", prompt.size(),
                      n_ctx));
  const int n_total = std::min<int>(n_ctx, static_cast<int>(prompt.size()) + std::max(0, o.n_predict));

  PAGODA_ASSIGN_OR_RETURN_CLI(kv_layout layout, make_kv_layout(*model, o.kv));
  PAGODA_ASSIGN_OR_RETURN_CLI(std::int64_t n_blocks, pool_blocks(layout, o.kv, n_total));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto storage, kv_storage::create(layout, n_blocks));
  simple_kv kv(*storage);
  if (!kv.reserve(0, static_cast<int>(prompt.size())))
    return fail(error(errc::resource_exhausted,
                      "the prompt needs {} KV blocks of {} tokens but the pool holds {} (raise --kv-cache-size or "
                      "--max-kv-tokens)",
                      (prompt.size() + layout.block_size - 1) / layout.block_size, layout.block_size, n_blocks));

  llama_context ctx(*model, *storage, o.model.threads);
  sampler smp(o.sampling);
  std::vector<float> logits;

  if (!o.json) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    std::fflush(stdout);
  }
  // Prompt in chunks: matrix-matrix products, causal attention inside each chunk.
  std::int64_t t0 = now_us();
  for (std::size_t i = 0; i < prompt.size(); i += o.ubatch) {
    std::size_t n = std::min<std::size_t>(o.ubatch, prompt.size() - i);
    forward_seq s{std::span(prompt).subspan(i, n), static_cast<int>(i), kv.table(0), false};
    if (auto st = ctx.forward({&s, 1}, logits); !st.ok()) return fail(st);
  }
  std::int64_t t1 = now_us();

  std::vector<token_id> all = prompt;
  std::vector<token_id> generated;
  stream_decoder stream(vocab, /*at_text_start=*/prompt.size() <= 1);
  std::string text, stop_reason = "length";
  while (static_cast<int>(all.size()) < n_total) {
    token_id next = smp.sample(logits);
    if (vocab.is_eog(next)) {
      stop_reason = "eos";
      break;
    }
    generated.push_back(next);
    all.push_back(next);
    std::string piece = stream.push(next);
    text += piece;
    if (!o.json && !piece.empty()) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    if (static_cast<int>(all.size()) >= n_total) break;
    if (!kv.reserve(0, static_cast<int>(all.size()))) {
      stop_reason = "kv_pool_full";
      std::fprintf(stderr, "\npagoda: KV pool full after %zu tokens; stopping (raise --kv-cache-size)\n", all.size());
      break;
    }
    forward_seq s{std::span(all).subspan(all.size() - 1, 1), static_cast<int>(all.size()) - 1, kv.table(0), false};
    if (auto st = ctx.forward({&s, 1}, logits); !st.ok()) return fail(st);
  }
  std::string tail = stream.flush();
  text += tail;
  std::int64_t t2 = now_us();

  const double prompt_s = (t1 - t0) * 1e-6, gen_s = (t2 - t1) * 1e-6;
  const std::size_t kv_used = kv.blocks_used() * layout.bytes_per_block();
  if (o.json) {
    nlohmann::json j;
    j["prompt"] = o.prompt;
    j["prompt_tokens"] = prompt;
    j["tokens"] = generated;
    j["text"] = text;
    j["stop_reason"] = stop_reason;
    j["timings"] = {{"prompt_ms", prompt_s * 1e3},
                    {"prompt_tokens_per_s", prompt.size() / std::max(prompt_s, 1e-9)},
                    {"generation_ms", gen_s * 1e3},
                    {"generation_tokens_per_s", generated.size() / std::max(gen_s, 1e-9)}};
    j["kv"] = {{"type_k", kv_type_name(layout.k_formats[0].type)},
               {"type_v", kv_type_name(layout.v_formats[0].type)},
               {"block_size", layout.block_size},
               {"blocks_used", kv.blocks_used()},
               {"blocks_total", n_blocks},
               {"bytes_used", kv_used},
               {"bytes_total", storage->total_bytes()},
               {"bytes_per_token", layout.bytes_per_token()}};
    std::string out = j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("%s\n", out.c_str());
  } else {
    if (!tail.empty()) std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::printf("\n");
  }
  std::fprintf(stderr,
               "pagoda: prompt %zu tokens in %.1f ms (%.1f tok/s), generated %zu tokens in %.1f ms (%.1f tok/s)\n"
               "pagoda: KV %s used (%zu blocks of %d tokens, %s/token, %s/%s K/V) of a %s pool\n",
               prompt.size(), prompt_s * 1e3, prompt.size() / std::max(prompt_s, 1e-9), generated.size(), gen_s * 1e3,
               generated.size() / std::max(gen_s, 1e-9), human_bytes(static_cast<double>(kv_used)).c_str(),
               kv.blocks_used(), layout.block_size, human_bytes(layout.bytes_per_token()).c_str(),
               kv_type_name(layout.k_formats[0].type), kv_type_name(layout.v_formats[0].type),
               human_bytes(static_cast<double>(storage->total_bytes())).c_str());
  return 0;
}

}  // namespace

void register_run(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<run_options>();
  CLI::App* cmd = app.add_subcommand("run", "generate a continuation of a prompt");
  add_model_options(cmd, opts->model);
  add_kv_options(cmd, opts->kv);
  cmd->add_option("-p,--prompt", opts->prompt, "prompt text")->required();
  cmd->add_option("-n,--n-predict", opts->n_predict, "tokens to generate")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--temp,--temperature", opts->sampling.temperature, "temperature (0 = greedy)");
  cmd->add_option("--top-k", opts->sampling.top_k, "top-k (0 = off)");
  cmd->add_option("--top-p", opts->sampling.top_p, "top-p (1 = off)");
  cmd->add_option("--min-p", opts->sampling.min_p, "min-p (0 = off)");
  cmd->add_option("-s,--seed", opts->sampling.seed, "random seed");
  cmd->add_option("-b,--ubatch", opts->ubatch, "prompt tokens per forward step")->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--json", opts->json, "print one JSON object instead of text");
  cmd->callback([opts, &action] { action = [opts] { return run(*opts); }; });
}

}  // namespace pagoda::cli
