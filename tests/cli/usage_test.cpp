// What a new user types in the first five minutes: `make run` builds only the
// binary it runs; vLLM's and llama.cpp's spellings (`serve MODEL`,
// --max-model-len, --served-model-name, --gpu-memory-utilization, --quantize);
// a mistyped command or flag names the nearest one, and usage errors exit 2.
// And the small things: run's seed, perplexity's --chunks on documents, info
// on a vocabulary-only file, a missing file named once.
#include <algorithm>
#include <fstream>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/serve_process.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

int line_count(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// A usage error: exit 2, nothing on stdout, one line on stderr holding `fragment`.
void expect_usage_error(const cli_result& r, const std::string& fragment) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(line_count(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
}

// The recipe lines `make -n TARGET` prints in the source tree.
std::vector<std::string> make_recipe(const std::string& target) {
  const std::string cmd = "make --no-print-directory -n -C " + shell_quote(PAGODA_SOURCE_DIR) + " " + target + " 2>&1";
  std::vector<std::string> lines;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return lines;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) lines.emplace_back(buf);
  pclose(p);
  return lines;
}

TEST(cli_usage, make_run_builds_only_the_binary_it_runs) {
  auto builds = [](const std::vector<std::string>& recipe) {
    std::vector<std::string> out;
    for (const std::string& l : recipe)
      if (l.find("cmake --build") != std::string::npos) out.push_back(l);
    return out;
  };
  const std::vector<std::string> run = make_recipe("run");
  const std::vector<std::string> run_builds = builds(run);
  ASSERT_EQ(run_builds.size(), 1u) << ::testing::PrintToString(run);
  EXPECT_NE(run_builds[0].find("--target pagoda\n"), std::string::npos) << run_builds[0];
  EXPECT_NE(run.back().find("pagoda serve"), std::string::npos) << run.back();
  // `make test` still builds everything before running ctest.
  const std::vector<std::string> test = make_recipe("test");
  const std::vector<std::string> test_builds = builds(test);
  ASSERT_EQ(test_builds.size(), 1u) << ::testing::PrintToString(test);
  EXPECT_EQ(test_builds[0].find("--target"), std::string::npos) << test_builds[0];
  EXPECT_NE(test.back().find("ctest"), std::string::npos) << test.back();
}

TEST(cli_usage, serve_takes_the_model_as_vllm_does) {
  // `serve MODEL`, vLLM's context and model-name flags.
  serve_process server({model_path(), "--no-kv-store", "--max-model-len", "200", "--served-model-name", "my-model",
                        "--gpu-memory-utilization", "0.9"});
  httplib::Client c("127.0.0.1", server.port());
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  const json m = json::parse(models->body);
  EXPECT_EQ(m["data"][0]["id"], "my-model");
  EXPECT_EQ(m["data"][0]["max_model_len"], 200);
  auto named = c.Post("/v1/completions", R"({"model": "my-model", "prompt": "Once", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(named);
  EXPECT_EQ(named->status, 200) << named->body;
  auto other = c.Post("/v1/completions", R"({"model": "gpt-4", "prompt": "Once", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(other);
  EXPECT_NE(other->status, 200);
  EXPECT_NE(other->body.find("model_not_found"), std::string::npos) << other->body;
  auto too_long = c.Post("/v1/completions", R"({"prompt": "Once", "max_tokens": 250})", "application/json");
  ASSERT_TRUE(too_long);
  EXPECT_EQ(too_long->status, 400) << "--max-model-len 200 is the context: " << too_long->body;

  // The same file twice is one model; two files, or none, are usage errors.
  const std::string m_path = shell_quote(model_path());
  expect_usage_error(run_cli("serve -m " + m_path + " /tmp/other.gguf --no-kv-store --port 0"), "two models given");
  expect_usage_error(run_cli("serve --no-kv-store --port 0"), "a model is required");
}

TEST(cli_usage, gpu_memory_utilization_is_a_note_and_quantize_is_refused) {
  const std::string run = "run -m " + shell_quote(model_path()) + " -p Once -n 2 --temp 0 ";
  auto noted = run_cli(run + "--gpu-memory-utilization 0.85");
  EXPECT_EQ(noted.exit_code, 0) << noted.err;
  EXPECT_NE(noted.err.find("--gpu-memory-utilization 0.85 ignored"), std::string::npos) << noted.err;
  EXPECT_NE(noted.err.find("--kv-cache-size"), std::string::npos) << noted.err;
  for (const char* bad : {"1.5", "0", "nan", "x"})
    expect_usage_error(run_cli(run + "--gpu-memory-utilization " + bad), "--gpu-memory-utilization");
  for (const char* flag : {"--quantize awq", "--quantization gptq", "--quantize=fp8"}) {
    auto r = run_cli(run + flag);
    expect_usage_error(r, "GGUF's own types");
    EXPECT_NE(r.err.find("--kv-cache-dtype"), std::string::npos) << r.err;
  }
  // llama.cpp's name for the context, as vLLM's: the same flag.
  auto ctx = run_cli("run -m " + shell_quote(model_path()) + " -p Once -n 100 --temp 0 --ignore-eos --json --ctx-size 16");
  ASSERT_EQ(ctx.exit_code, 0) << ctx.err;
  const json j = json::parse(ctx.out);
  EXPECT_EQ(j["prompt_tokens"].size() + j["tokens"].size(), 16u) << "generation stops at the context";
}

TEST(cli_usage, mistyped_commands_and_options_name_the_nearest) {
  expect_usage_error(run_cli("runn -m x.gguf -p a"), "unknown command 'runn'; did you mean 'run'?");
  expect_usage_error(run_cli("sevre -m x.gguf"), "did you mean 'serve'?");
  expect_usage_error(run_cli("kv statz"), "unknown command 'statz' for 'pagoda kv'; did you mean 'stats'?");
  auto far = run_cli("xyzzy");
  expect_usage_error(far, "unknown command 'xyzzy'; the commands are run, ");
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;

  const std::string run = "run -m " + shell_quote(model_path()) + " -p a ";
  expect_usage_error(run_cli(run + "--temprature 0.5"),
                     "unknown option '--temprature' for 'pagoda run'; did you mean '--temperature'?");
  expect_usage_error(run_cli(run + "--top_k=5"), "did you mean '--top-k'?");
  expect_usage_error(run_cli("serve -m " + shell_quote(model_path()) + " --max-model-length 512"),
                     "did you mean '--max-model-len'?");
  auto unknown = run_cli(run + "--frobnicate");
  expect_usage_error(unknown, "unknown option '--frobnicate' for 'pagoda run'");
  EXPECT_EQ(unknown.err.find("did you mean"), std::string::npos) << unknown.err;
  // CLI11's own usage errors exit 2 as well.
  expect_usage_error(run_cli("run -p a"), "--model");
  expect_usage_error(run_cli(run + "-n x"), "-n");
  EXPECT_EQ(run_cli("--help").exit_code, 0);
  EXPECT_EQ(run_cli("--version").exit_code, 0);
}

// Without --seed each run draws its own and prints it; that seed repeats it.
TEST(cli_usage, run_draws_a_seed_and_prints_it) {
  const std::string run = "run -m " + shell_quote(model_path()) + " -p 'Once upon a time' -n 40 --temp 1 --ignore-eos --json";
  auto seed_of = [](const cli_result& r) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.err, m, std::regex("pagoda: seed ([0-9]+) \\(drawn for this run; --seed repeats it\\)")))
        << r.err;
    return m.size() > 1 ? m[1].str() : "";
  };
  auto a = run_cli(run), b = run_cli(run);
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const std::string seed_a = seed_of(a), seed_b = seed_of(b);
  EXPECT_NE(seed_a, seed_b);
  const json ja = json::parse(a.out), jb = json::parse(b.out);
  EXPECT_NE(ja["tokens"], jb["tokens"]) << "two runs, two seeds, two samples";
  EXPECT_EQ(ja["seed"].get<std::uint64_t>(), std::stoull(seed_a));
  auto again = run_cli(run + " --seed " + seed_a);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(json::parse(again.out)["tokens"], ja["tokens"]) << "the printed seed repeats the run";
  EXPECT_NE(again.err.find("pagoda: seed " + seed_a + "\n"), std::string::npos) << again.err;
  // Greedy runs have nothing to seed.
  auto greedy = run_cli(run + " --temp 0");
  EXPECT_EQ(greedy.err.find("pagoda: seed"), std::string::npos) << greedy.err;
}

TEST(cli_usage, perplexity_chunks_applies_to_documents) {
  const std::string path = "/tmp/pagoda_usage_docs_" + std::to_string(getpid()) + ".txt";
  {
    std::ofstream out(path);
    for (int i = 0; i < 5; ++i)
      out << "Once upon a time there was a cat number " << i << ". It liked milk.\n<|endoftext|>\n";
  }
  const std::string ppl = "perplexity -m " + shell_quote(model_path()) + " -f " + path + " --json";
  auto all = run_cli(ppl);
  auto two = run_cli(ppl + " --chunks 2");
  std::remove(path.c_str());
  ASSERT_EQ(all.exit_code, 0) << all.err;
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const json ja = json::parse(all.out), jt = json::parse(two.out);
  EXPECT_EQ(ja["documents"], 5);
  EXPECT_EQ(jt["documents"], 2);
  EXPECT_EQ(jt["method"], "documents");
  EXPECT_LT(jt["predicted_tokens"].get<int>(), ja["predicted_tokens"].get<int>());
}

TEST(cli_usage, info_on_a_vocabulary_only_file) {
  auto r = run_cli("info -m " + shell_quote(data_path("tokenizer/ggml-vocab-phi-3.gguf")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("0 tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("a vocabulary only"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("vocabulary: +32064 \\(llama tokenizer\\), BOS 1"))) << r.out;
  // A full model is described as before.
  auto full = run_cli("info -m " + shell_quote(model_path()));
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_NE(full.out.find("KV cache per token"), std::string::npos);
}

TEST(cli_usage, a_missing_file_is_named_once) {
  for (const char* cmd : {"run -p hi -m", "info -m", "serve --no-kv-store -m", "tokenize -p hi -m"}) {
    auto r = run_cli(std::string(cmd) + " /nonexistent/model.gguf");
    EXPECT_EQ(r.exit_code, 1) << cmd;
    EXPECT_EQ(line_count(r.err), 1) << r.err;
    const std::string& e = r.err;
    const std::size_t first = e.find("/nonexistent/model.gguf");
    ASSERT_NE(first, std::string::npos) << e;
    EXPECT_EQ(e.find("/nonexistent/model.gguf", first + 1), std::string::npos) << cmd << ": " << e;
  }
}

// --help shows each option's default, never a false one: no "{false}"
// beside "default on", no seed 0 where each run draws its own.
// An unknown chat template family is a usage error before the model loads.
TEST(cli_usage, an_unknown_chat_template_is_a_usage_error) {
  for (const char* cmd : {"chat", "serve"})
    expect_usage_error(run_cli(std::string(cmd) + " -m " + shell_quote(model_path()) + " --chat-template nope"),
                       "--chat-template 'nope': unknown; expected one of plain, chatml");
}

TEST(cli_usage, help_shows_true_defaults) {
  for (const char* cmd : {"serve --help", "batch --help", "run --help", "chat --help", "perplexity --help"}) {
    auto r = run_cli(cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd;
    EXPECT_EQ(r.out.find("{false}"), std::string::npos) << cmd << ":\n" << r.out;
    EXPECT_EQ(r.out.find("{true}"), std::string::npos) << cmd << ":\n" << r.out;
  }
  auto serve = run_cli("serve --help");
  EXPECT_TRUE(std::regex_search(serve.out, std::regex("--enable-prefix-caching\\s+reuse cached KV blocks[^\n]*\\(default on\\)")))
      << serve.out;
  EXPECT_NE(serve.out.find("--no-enable-prefix-caching"), std::string::npos);
  auto run = run_cli("run --help");
  EXPECT_TRUE(std::regex_search(run.out, std::regex("--seed UINT=fresh"))) << run.out;
}

}  // namespace
}  // namespace pagoda::test
