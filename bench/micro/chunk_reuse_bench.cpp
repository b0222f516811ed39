// Chunk reuse (CacheBlend, docs/serving.md "Chunk reuse"): its quality and
// time to first token against a full prefill of the same tokens, in one run.
// Drives engine_core directly (the server caps logprobs at 20 alternatives;
// KL divergence needs the whole next-token distribution). It reports; it
// asserts nothing. Not a google-benchmark: two modes, each one table.
//
//   build/release/bench/chunk_reuse_bench rag  [--prompts 20] [--cont 32] [--reps 3]
//   build/release/bench/chunk_reuse_bench ttft --model F.gguf [--chunk 2048] [--chunks 4] [--rounds 1]
//                                               [--recompute 0,0.15,0.3] [--cold 1]
//
// rag: stories260K; prompts of 4-8 TinyStories stories (tests/data/
// tinystories_dev.txt, each cut to its leading sentences within 56 tokens so
// that 8 of them, a question and the continuation stay within the model's
// 512-token training context), drawn from a pool of 12 in shuffled orders,
// each story a part marked for reuse, then a question. Per prompt:
//   - reference: an f32 engine without prefix caching, plain prefill: its
//     greedy continuation C (up to --cont tokens) and the logits of every
//     position of prompt + C (prompt_logits);
//   - int4 and f16 KV, plain prefill (the same prompt_logits);
//   - chunk reuse at each recompute fraction (f32 KV): the chunks warmed by
//     one request, then one request per prefix of C (prompt + C[:k], one
//     token, logprobs of all 512 tokens): the next-token distribution at the
//     end of the prompt and at every position of C.
// KL(reference || other) and top-1 agreement at the end of the prompt and
// over the positions of C, and the perplexity of C. TTFT: process CPU time
// and wall time from add_request to the first token, the best of --reps,
// chunks cached (the RAG steady state), against the reference's full prefill
// (CPU time is what a machine loaded by other work does not inflate).
//
// ttft: a synth model (pagoda synth); n chunks of random tokens and a
// 16-token question. Each round: a full prefill (engine without prefix
// caching), then on the chunk-reuse engine: the chunks new (cold: they are
// computed alone first; with --cold 0 an untimed request computes them),
// then the same chunks shuffled with another question at each recompute
// fraction (warm). f16 KV, 2 threads, the default step of 2048 tokens.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/llama.h"
#include "sched/engine_core.h"
#include "sched/engine_setup.h"

namespace {

using namespace pagoda;
using clk = std::chrono::steady_clock;

struct outcome {
  std::vector<token_id> tokens;
  std::vector<token_logprob> logprobs;
  std::vector<float> prompt_logits;  // [n][n_vocab] from first_pos
  int first_pos = 0;
  request_usage usage;
  std::string error;
  double ttft_s = 0;      // wall time
  double ttft_cpu_s = 0;  // CPU time of the whole process (every engine thread): what a loaded machine does not inflate
};

double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// One request alone through the engine, timed from add_request to its first token.
outcome run_one(engine_core& e, request r) {
  outcome o;
  const auto t0 = clk::now();
  const double c0 = process_cpu_s();
  const status st = e.add_request(std::move(r));
  if (!st.ok()) {
    o.error = st.message();
    return o;
  }
  std::vector<engine_event> ev;
  bool first = true;
  while (e.has_work()) {
    ev.clear();
    e.step(ev);
    for (engine_event& x : ev) {
      if (first && !x.tokens.empty()) {
        o.ttft_s = std::chrono::duration<double>(clk::now() - t0).count();
        o.ttft_cpu_s = process_cpu_s() - c0;
        first = false;
      }
      o.tokens.insert(o.tokens.end(), x.tokens.begin(), x.tokens.end());
      for (token_logprob& l : x.logprobs) o.logprobs.push_back(std::move(l));
      if (!x.prompt_logits.empty()) {
        if (o.prompt_logits.empty()) o.first_pos = x.first_prompt_position;
        o.prompt_logits.insert(o.prompt_logits.end(), x.prompt_logits.begin(), x.prompt_logits.end());
      }
      if (!x.error.empty()) o.error = x.error;
      if (x.request_finished) o.usage = x.usage;
    }
  }
  std::vector<engine_event> rest;
  e.flush(rest);
  return o;
}

std::unique_ptr<engine_core> open_engine(const llama_model& m, engine_config c, int max_model_len) {
  auto cc = make_engine_core_config(m, c);
  if (!cc.ok()) {
    fmt::print(stderr, "engine config: {}\n", cc.error().message());
    std::exit(1);
  }
  cc->max_model_len = max_model_len;
  auto e = engine_core::create(m, *cc);
  if (!e.ok()) {
    fmt::print(stderr, "engine: {}\n", e.error().message());
    std::exit(1);
  }
  return std::move(*e);
}

std::unique_ptr<llama_model> load(const std::string& path) {
  auto m = llama_model::load(path);
  if (!m.ok()) {
    fmt::print(stderr, "{}: {}\n", path, m.error().message());
    std::exit(1);
  }
  return std::move(*m);
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 2; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return def;
}

// Log-softmax of one logits row.
std::vector<double> log_softmax(const float* row, int n) {
  double mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double z = 0;
  for (int i = 0; i < n; ++i) z += std::exp(row[i] - mx);
  const double lz = mx + std::log(z);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = row[i] - lz;
  return out;
}

// The whole distribution from a logprobs entry that lists every token.
std::vector<double> from_top(const token_logprob& l, int n) {
  std::vector<double> out(static_cast<std::size_t>(n), -INFINITY);
  for (const auto& [t, lp] : l.top) out[static_cast<std::size_t>(t)] = lp;
  return out;
}

double kl(const std::vector<double>& ref, const std::vector<double>& got) {
  double s = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) s += std::exp(ref[i]) * (ref[i] - got[i]);
  return s;
}

std::size_t argmax(const std::vector<double>& v) {
  return static_cast<std::size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  return v.empty() ? NAN : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// --- rag -----------------------------------------------------------------

struct rag_prompt {
  std::vector<token_id> tokens;
  std::vector<prompt_segment> parts;  // the stories, marked for reuse (recompute set per run)
};

// The story's leading sentences within `budget` tokens (" " before it, as
// it follows other text); a first sentence too long is cut at `budget` tokens.
std::vector<token_id> lead(const tokenizer& v, const std::string& story, int budget) {
  std::vector<token_id> best;
  std::size_t at = 0;
  while (true) {
    std::size_t end = story.find_first_of(".!?", at);
    if (end == std::string::npos) break;
    ++end;
    while (end < story.size() && story[end] == '"') ++end;
    std::vector<token_id> t = v.encode(" " + story.substr(0, end), false);
    if (static_cast<int>(t.size()) > budget) break;
    best = std::move(t);
    at = end;
  }
  if (best.empty()) {
    best = v.encode(" " + story, false);
    best.resize(std::min<std::size_t>(best.size(), static_cast<std::size_t>(budget)));
  }
  return best;
}

std::vector<std::string> read_stories(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  std::vector<std::string> out;
  std::size_t at = 0;
  const std::string sep = "<|endoftext|>";
  while (at < all.size()) {
    std::size_t end = all.find(sep, at);
    if (end == std::string::npos) end = all.size();
    std::string s = all.substr(at, end - at);
    std::replace(s.begin(), s.end(), '\n', ' ');
    const std::size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
    if (b != std::string::npos) s = s.substr(b, e - b + 1);
    // Whole stories only (the file opens in the middle of one).
    if (b != std::string::npos && s.size() > 200 && s.rfind("Once", 0) == 0) out.push_back(s);
    at = end + sep.size();
  }
  return out;
}

struct rag_stats {
  std::vector<double> kl_end, top1_end, kl_cont, top1_cont, nll, ttft, ttft_wall, reused_frac;
};

void add_dist(rag_stats& s, const std::vector<double>& ref, const std::vector<double>& got, bool end, token_id next) {
  const double k = kl(ref, got);
  const double agree = argmax(ref) == argmax(got) ? 1.0 : 0.0;
  if (end) {
    s.kl_end.push_back(k);
    s.top1_end.push_back(agree);
  }
  s.kl_cont.push_back(k);
  s.top1_cont.push_back(agree);
  if (next >= 0) s.nll.push_back(-got[static_cast<std::size_t>(next)]);
}

int rag(int argc, char** argv) {
  const std::string src = PAGODA_SOURCE_DIR;
  const int n_prompts = std::stoi(arg(argc, argv, "--prompts", "20"));
  const int n_cont = std::stoi(arg(argc, argv, "--cont", "32"));
  const int reps = std::stoi(arg(argc, argv, "--reps", "3"));
  const int threads = std::stoi(arg(argc, argv, "--threads", "1"));
  const auto model = load(arg(argc, argv, "--model", src + "/models/stories260K.gguf"));
  const tokenizer& v = model->vocab();
  const int n_vocab = model->hparams().n_vocab;
  const std::vector<std::string> stories = read_stories(arg(argc, argv, "--text", src + "/tests/data/tinystories_dev.txt"));
  const int pool = 12, budget = 56;
  if (static_cast<int>(stories.size()) < pool) {
    fmt::print(stderr, "{} whole stories in the text, {} needed\n", stories.size(), pool);
    return 1;
  }
  std::vector<std::vector<token_id>> chunks;
  for (int i = 0; i < pool; ++i) chunks.push_back(lead(v, stories[static_cast<std::size_t>(i)], budget));
  const std::vector<std::string> questions = {
      " What did they do next? The end. Then", " Who was the happiest of them all? It was",
      " Where did the friends play? They played", " Why was the little one sad? Because"};
  std::mt19937 rng(32);
  std::vector<rag_prompt> prompts;
  for (int p = 0; p < n_prompts; ++p) {
    const int n = 4 + p % 5;
    std::vector<int> ids(static_cast<std::size_t>(pool));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    rag_prompt rp;
    rp.tokens = {v.bos()};
    const std::vector<token_id> intro = v.encode(" Read these stories.", false);
    rp.tokens.insert(rp.tokens.end(), intro.begin(), intro.end());
    for (int i = 0; i < n; ++i) {
      const std::vector<token_id>& c = chunks[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])];
      prompt_segment s;
      s.begin = static_cast<std::int32_t>(rp.tokens.size());
      rp.tokens.insert(rp.tokens.end(), c.begin(), c.end());
      s.end = static_cast<std::int32_t>(rp.tokens.size());
      s.reuse_chunk = true;
      rp.parts.push_back(s);
    }
    const std::vector<token_id> q = v.encode(questions[static_cast<std::size_t>(p) % questions.size()], false);
    rp.tokens.insert(rp.tokens.end(), q.begin(), q.end());
    prompts.push_back(std::move(rp));
  }
  const int max_len = 512;
  engine_config base;
  base.n_threads = threads;
  base.n_ctx = max_len;
  base.max_num_seqs = 16;
  base.max_kv_tokens = 16384;
  engine_config ref_c = base;
  ref_c.kv_cache_dtype = "f32";
  ref_c.enable_prefix_caching = false;
  auto ref = open_engine(*model, ref_c, max_len);
  std::map<std::string, std::unique_ptr<engine_core>> plain;  // plain prefill in another KV type
  for (const char* t : {"f16", "int4"}) {
    engine_config c = base;
    c.kv_cache_dtype = t;
    plain[t] = open_engine(*model, c, max_len);
  }
  const std::vector<float> fractions = {0.0f, 0.05f, 0.15f, 0.3f, 1.0f};
  std::map<float, std::unique_ptr<engine_core>> blended;
  for (float r : fractions) {
    engine_config c = base;
    c.kv_cache_dtype = "f32";
    blended[r] = open_engine(*model, c, max_len);
  }
  std::map<std::string, rag_stats> st;
  std::vector<double> ref_nll, ref_ttft, ref_wall;
  int id = 0, n_prompt_tokens = 0, n_cont_tokens = 0, n_chunk_tokens = 0;
  for (const rag_prompt& rp : prompts) {
    n_prompt_tokens += static_cast<int>(rp.tokens.size());
    for (const prompt_segment& s : rp.parts) n_chunk_tokens += s.end - s.begin;
    request r;
    r.prompt = rp.tokens;
    r.sampling = sampling_params::greedy();
    // The reference continuation, then every position's logits.
    r.id = std::to_string(id++);
    r.max_tokens = n_cont;
    const std::vector<token_id> cont = run_one(*ref, r).tokens;
    n_cont_tokens += static_cast<int>(cont.size());
    request scored = r;
    scored.prompt.insert(scored.prompt.end(), cont.begin(), cont.end());
    scored.max_tokens = 1;
    scored.prompt_logits = true;
    const auto rows = [&](const outcome& o) {
      std::vector<std::vector<double>> out;
      for (std::size_t k = 0; k <= cont.size(); ++k) {
        const int pos = static_cast<int>(rp.tokens.size() + k) - 1 - o.first_pos;
        out.push_back(log_softmax(o.prompt_logits.data() + static_cast<std::size_t>(pos) * n_vocab, n_vocab));
      }
      return out;
    };
    scored.id = std::to_string(id++);
    const auto want = rows(run_one(*ref, scored));
    for (std::size_t k = 0; k < cont.size(); ++k) ref_nll.push_back(-want[k][static_cast<std::size_t>(cont[k])]);
    // Full prefill time to first token.
    double best = INFINITY, best_wall = INFINITY;
    for (int i = 0; i < reps; ++i) {
      request t = r;
      t.id = std::to_string(id++);
      t.max_tokens = 1;
      const outcome o = run_one(*ref, t);
      best = std::min(best, o.ttft_cpu_s);
      best_wall = std::min(best_wall, o.ttft_s);
    }
    ref_ttft.push_back(best);
    ref_wall.push_back(best_wall);
    for (auto& [name, e] : plain) {
      scored.id = std::to_string(id++);
      const auto got = rows(run_one(*e, scored));
      for (std::size_t k = 0; k <= cont.size(); ++k)
        add_dist(st[name], want[k], got[k], k == 0, k < cont.size() ? cont[k] : -1);
    }
    for (float frac : fractions) {
      engine_core& e = *blended[frac];
      rag_stats& s = st[fmt::format("chunk reuse, recompute {}", frac)];
      request b = r;
      b.segments = rp.parts;
      for (prompt_segment& p : b.segments) p.recompute = frac;
      b.max_tokens = 1;
      b.logprobs = n_vocab;
      b.id = std::to_string(id++);
      const outcome warm = run_one(e, b);  // computes the chunks not cached yet
      if (!warm.error.empty()) {
        fmt::print(stderr, "chunk reuse refused: {}\n", warm.error);
        return 1;
      }
      best = INFINITY;
      best_wall = INFINITY;
      for (int i = 0; i < reps; ++i) {
        b.id = std::to_string(id++);
        const outcome o = run_one(e, b);
        best = std::min(best, o.ttft_cpu_s);
        best_wall = std::min(best_wall, o.ttft_s);
        if (i == 0) {
          s.reused_frac.push_back(static_cast<double>(o.usage.reused_chunk_tokens) / static_cast<double>(rp.tokens.size()));
          add_dist(s, want[0], from_top(o.logprobs.at(0), n_vocab), true, cont.empty() ? -1 : cont[0]);
        }
      }
      s.ttft.push_back(best);
      s.ttft_wall.push_back(best_wall);
      for (std::size_t k = 1; k <= cont.size(); ++k) {
        request c = b;
        c.id = std::to_string(id++);
        c.prompt.insert(c.prompt.end(), cont.begin(), cont.begin() + static_cast<std::ptrdiff_t>(k));
        const outcome o = run_one(e, c);
        add_dist(s, want[k], from_top(o.logprobs.at(0), n_vocab), false, k < cont.size() ? cont[k] : -1);
      }
    }
  }
  fmt::print("{} prompts of 4-8 stories ({:.0f} prompt tokens on average, {:.0f} of them in stories), "
             "{} continuation tokens scored; TTFT best of {}, threads {}\n\n",
             prompts.size(), static_cast<double>(n_prompt_tokens) / prompts.size(),
             static_cast<double>(n_chunk_tokens) / prompts.size(), n_cont_tokens, reps, threads);
  const double ref_ppl = std::exp(mean(ref_nll));
  fmt::print("| KV | KL at the end of the prompt (nats) | top-1 there % | KL over the continuation | top-1 over it % "
             "| perplexity of the continuation (reference {:.3f}) | prompt tokens reused % | TTFT, CPU ms, median "
             "(of full prefill) | TTFT, wall ms, median (of full) |\n|---|---|---|---|---|---|---|---|---|\n", ref_ppl);
  const double ref_t = median(ref_ttft), ref_w = median(ref_wall);
  fmt::print("| f32, full prefill (reference) | 0 | 100 | 0 | 100 | {:.3f} | 0 | {:.3f} (1.00) | {:.3f} (1.00) |\n", ref_ppl,
             1e3 * ref_t, 1e3 * ref_w);
  for (const auto& [name, s] : st) {
    const double t = median(s.ttft), w = median(s.ttft_wall);
    fmt::print("| {} | {:.3e} | {:.1f} | {:.3e} | {:.1f} | {:.3f} | {} | {} | {} |\n", name, mean(s.kl_end),
               100 * mean(s.top1_end), mean(s.kl_cont), 100 * mean(s.top1_cont), std::exp(mean(s.nll)),
               s.reused_frac.empty() ? "0" : fmt::format("{:.1f}", 100 * mean(s.reused_frac)),
               s.ttft.empty() ? "-" : fmt::format("{:.3f} ({:.2f})", 1e3 * t, t / ref_t),
               s.ttft.empty() ? "-" : fmt::format("{:.3f} ({:.2f})", 1e3 * w, w / ref_w));
  }
  return 0;
}

// --- ttft ----------------------------------------------------------------

int ttft(int argc, char** argv) {
  const std::string path = arg(argc, argv, "--model", "");
  if (path.empty()) {
    fmt::print(stderr, "ttft needs --model F.gguf (pagoda synth)\n");
    return 1;
  }
  const int n_chunk = std::stoi(arg(argc, argv, "--chunk", "2048"));
  const int n_chunks = std::stoi(arg(argc, argv, "--chunks", "4"));
  const int rounds = std::stoi(arg(argc, argv, "--rounds", "1"));
  const int threads = std::stoi(arg(argc, argv, "--threads", "2"));
  const bool cold = arg(argc, argv, "--cold", "1") != "0";
  std::vector<float> fractions;
  {
    std::stringstream ss(arg(argc, argv, "--recompute", "0,0.15,0.3"));
    std::string f;
    while (std::getline(ss, f, ',')) fractions.push_back(std::stof(f));
  }
  const auto model = load(path);
  const int n_vocab = model->hparams().n_vocab;
  const int n_question = 16;
  const int max_len = n_chunks * n_chunk + n_question + 64;
  engine_config c;
  c.n_threads = threads;
  c.n_ctx = max_len;
  c.kv_cache_dtype = "f16";
  c.max_num_seqs = 16;
  c.max_kv_tokens = 3 * static_cast<std::int64_t>(max_len) + 1024;
  engine_config full_c = c;
  full_c.enable_prefix_caching = false;
  auto full = open_engine(*model, full_c, max_len);
  auto blend = open_engine(*model, c, max_len);
  std::mt19937 rng(7);
  std::uniform_int_distribution<token_id> tok(3, n_vocab - 1);
  const auto random_tokens = [&](int n) {
    std::vector<token_id> t(static_cast<std::size_t>(n));
    for (token_id& x : t) x = tok(rng);
    return t;
  };
  const auto make = [&](const std::vector<std::vector<token_id>>& chunks, float frac, bool mark) {
    request r;
    r.prompt = {1};
    for (const auto& ch : chunks) {
      prompt_segment s;
      s.begin = static_cast<std::int32_t>(r.prompt.size());
      r.prompt.insert(r.prompt.end(), ch.begin(), ch.end());
      s.end = static_cast<std::int32_t>(r.prompt.size());
      s.reuse_chunk = true;
      s.recompute = frac;
      if (mark) r.segments.push_back(s);
    }
    const std::vector<token_id> q = random_tokens(n_question);
    r.prompt.insert(r.prompt.end(), q.begin(), q.end());
    r.max_tokens = 1;
    r.sampling = sampling_params::greedy();
    r.ignore_eos = true;
    return r;
  };
  std::map<std::string, std::vector<double>> t, cpu;
  int id = 0;
  const auto timed = [&](engine_core& e, request r, const std::string& name) {
    r.id = std::to_string(id++);
    const std::int64_t before = e.stats().n_computed_prompt_tokens;
    const outcome o = run_one(e, r);
    if (!o.error.empty()) {
      fmt::print(stderr, "{}: {}\n", name, o.error);
      std::exit(1);
    }
    t[name].push_back(o.ttft_s);
    cpu[name].push_back(o.ttft_cpu_s);
    fmt::print(stderr, "{}: {:.2f} s wall, {:.2f} s CPU, {} prompt tokens computed, {} reused\n", name, o.ttft_s, o.ttft_cpu_s,
               e.stats().n_computed_prompt_tokens - before, o.usage.reused_chunk_tokens);
  };
  const float cold_frac = 0.15f;
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::vector<token_id>> chunks;
    for (int i = 0; i < n_chunks; ++i) chunks.push_back(random_tokens(n_chunk));
    timed(*full, make(chunks, 0, false), "full prefill");
    if (cold) timed(*blend, make(chunks, cold_frac, true), fmt::format("recompute {}, cold (chunks computed first)", cold_frac));
    for (float frac : fractions) {
      // Warm: the chunks are in the cache (the cold request's, or an untimed one's).
      if (!cold && frac == fractions.front()) run_one(*blend, [&] { request r = make(chunks, 0, true); r.id = "w" + std::to_string(id++); return r; }());
      std::shuffle(chunks.begin(), chunks.end(), rng);
      timed(*blend, make(chunks, frac, true), fmt::format("recompute {}, chunks cached", frac));
    }
  }
  const auto& hp = model->hparams();
  fmt::print("{}: {} layers, {} chunks x {} tokens + a {}-token question, {} round(s), {} threads\n\n", path, hp.n_layer,
             n_chunks, n_chunk, n_question, rounds, threads);
  fmt::print("| prefill | TTFT wall s (each round) | of full prefill | TTFT CPU s (each round) | of full prefill |\n"
             "|---|---|---|---|---|\n");
  const double ref = median(t["full prefill"]), ref_cpu = median(cpu["full prefill"]);
  const auto each = [](const std::vector<double>& v) {
    std::string out;
    for (double x : v) out += fmt::format("{}{:.2f}", out.empty() ? "" : ", ", x);
    return out;
  };
  for (const auto& [name, v] : t)
    fmt::print("| {} | {} | {:.3f} | {} | {:.3f} |\n", name, each(v), median(v) / ref, each(cpu[name]),
               median(cpu[name]) / ref_cpu);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "rag") return rag(argc, argv);
  if (mode == "ttft") return ttft(argc, argv);
  fmt::print(stderr, "usage: chunk_reuse_bench rag|ttft [options] (see the file's head)\n");
  return 2;
}
