// pagoda perplexity beyond one context: long documents in windows, and a text
// without separators in llama-perplexity's chunks, each checked against the
// method computed here from its definition through the public engine API.
#include <cmath>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "pagoda/engine.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trim(const std::string& s) {
  const std::size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The dev text's first n stories, each trimmed.
std::vector<std::string> stories(std::size_t n) {
  const std::string text = read_text(data_path("tinystories_dev.txt"));
  std::vector<std::string> out;
  std::size_t at = 0;
  while (out.size() < n && at < text.size()) {
    std::size_t next = text.find("<|endoftext|>", at);
    std::string doc = trim(text.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (!doc.empty()) out.push_back(doc);
    if (next == std::string::npos) break;
    at = next + 13;
  }
  return out;
}

std::string write_temp(const std::string& name, const std::string& content) {
  std::string path = "/tmp/pagoda_ppl_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::unique_ptr<engine> open_engine(int n_ctx) {
  engine_config c;
  c.model_path = model_path();
  c.n_ctx = n_ctx;
  c.kv_cache_dtype = "f32";
  c.n_threads = 1;
  auto e = engine::create(c);
  EXPECT_TRUE(e.ok()) << e.error().message();
  return std::move(*e);
}

// Sum of -log p(tokens[j + 1]) over rows j >= first_row of one prompt.
double piece_nll(engine& eng, const std::vector<token_id>& tokens, int first_row, std::int64_t& n_scored) {
  request r;
  r.id = "p";
  r.prompt = tokens;
  r.max_tokens = 0;
  r.prompt_logits = true;
  EXPECT_TRUE(eng.add_request(std::move(r)).ok());
  const std::size_t V = static_cast<std::size_t>(eng.info().n_vocab);
  double sum = 0;
  std::vector<engine_event> events;
  while (eng.has_work()) {
    events.clear();
    eng.step(events);
    for (const engine_event& e : events) {
      for (std::size_t j = 0; j < e.prompt_logits.size() / V; ++j) {
        const int pos = e.first_prompt_position + static_cast<int>(j);
        if (pos < first_row || pos + 1 >= static_cast<int>(tokens.size())) continue;
        const float* row = &e.prompt_logits[j * V];
        double mx = row[0], z = 0;
        for (std::size_t v = 1; v < V; ++v) mx = std::max<double>(mx, row[v]);
        for (std::size_t v = 0; v < V; ++v) z += std::exp(row[v] - mx);
        sum += std::log(z) + mx - row[tokens[pos + 1]];
        ++n_scored;
      }
    }
  }
  return sum;
}

json perplexity(const std::string& file, const std::string& args) {
  auto r = run_cli("perplexity -m " + model_path() + " -f " + file + " --kv-cache-dtype f32 -t 1 --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return json::parse(r.out);
}

// A text without separators: llama-perplexity's chunks, BOS in place of each
// chunk's first token, the second half scored.
TEST(cli_perplexity, unseparated_text_is_scored_in_llama_perplexity_chunks) {
  std::string text;
  for (const std::string& s : stories(40)) text += s + "\n";
  text = trim(text);
  const std::string path = write_temp("plain.txt", text + "\n");
  const int n_ctx = 128, n_chunks = 4;
  json j = perplexity(path, "--ctx 128 --chunks 4 --separator '<|endoftext|>'");
  auto eng = open_engine(n_ctx);
  const std::vector<token_id> ids = eng->tokenize(text, true);
  ASSERT_GT(ids.size(), static_cast<std::size_t>(n_ctx * n_chunks));
  double sum = 0;
  std::int64_t n = 0;
  for (int c = 0; c < n_chunks; ++c) {
    std::vector<token_id> chunk(ids.begin() + c * n_ctx, ids.begin() + (c + 1) * n_ctx);
    chunk[0] = 1;  // stories260K's BOS
    sum += piece_nll(*eng, chunk, n_ctx / 2, n);
  }
  EXPECT_EQ(j["method"], "chunks");
  EXPECT_EQ(j["chunks"], n_chunks);
  EXPECT_EQ(n, n_chunks * (n_ctx - 1 - n_ctx / 2));
  EXPECT_EQ(j["predicted_tokens"], n);
  EXPECT_NEAR(j["mean_nll"].get<double>(), sum / n, 1e-4);
  EXPECT_NE(j["scoring"].get<std::string>().find("tokens 65..127"), std::string::npos) << j["scoring"];
  // Without --chunks: every whole chunk of the file; the tail is dropped.
  json all = perplexity(path, "--ctx 128");
  EXPECT_EQ(all["chunks"], static_cast<int>(ids.size() / n_ctx));
  EXPECT_EQ(all["predicted_tokens"], all["chunks"].get<int>() * 63);
  EXPECT_EQ(all["text_tokens"], ids.size());
  // The plain output says which half is scored.
  auto plain = run_cli("perplexity -m " + model_path() + " -f " + path + " --ctx 128 --chunks 2");
  EXPECT_NE(plain.out.find("the second half of each scored"), std::string::npos) << plain.out;
  std::remove(path.c_str());
}

// Documents longer than the context are scored in windows: every token after
// BOS once, each window's scored tokens with at least half a context before them.
TEST(cli_perplexity, long_documents_are_scored_in_windows) {
  const std::vector<std::string> docs = stories(12);
  std::string text;
  for (const std::string& s : docs) text += s + "\n<|endoftext|>\n";
  const std::string path = write_temp("docs.txt", text);
  const int n_ctx = 96;
  json j = perplexity(path, "--ctx 96");
  json cut = perplexity(path, "--ctx 96 --truncate");
  auto eng = open_engine(n_ctx);
  double sum = 0, sum_cut = 0;
  std::int64_t n = 0, n_cut = 0, n_long = 0;
  for (const std::string& d : docs) {
    const std::vector<token_id> ids = eng->tokenize(d, true);
    const int len = static_cast<int>(ids.size());
    if (len <= n_ctx) {
      sum += piece_nll(*eng, ids, 0, n);
      sum_cut += piece_nll(*eng, ids, 0, n_cut);
      continue;
    }
    ++n_long;
    std::vector<token_id> first(ids.begin(), ids.begin() + n_ctx);
    sum += piece_nll(*eng, first, 0, n);
    sum_cut += piece_nll(*eng, first, 0, n_cut);
    // Windows of n_ctx ending at or before the end, each scoring past the last scored token.
    for (int last = n_ctx - 1; last < len - 1;) {
      const int start = std::min(last - n_ctx / 2, len - n_ctx);
      std::vector<token_id> w(ids.begin() + start, ids.begin() + start + n_ctx);
      w[0] = 1;
      sum += piece_nll(*eng, w, last - start, n);
      last = start + n_ctx - 1;
    }
  }
  ASSERT_GT(n_long, 2);
  std::int64_t all_tokens = 0;
  for (const std::string& d : docs) all_tokens += static_cast<std::int64_t>(eng->tokenize(d, true).size()) - 1;
  EXPECT_EQ(n, all_tokens);  // every token after BOS, once
  EXPECT_EQ(j["predicted_tokens"], all_tokens);
  EXPECT_EQ(j["documents_windowed"], n_long);
  EXPECT_EQ(j["documents_truncated"], 0);
  EXPECT_NEAR(j["mean_nll"].get<double>(), sum / n, 1e-4);
  EXPECT_EQ(cut["predicted_tokens"], n_cut);
  EXPECT_EQ(cut["documents_truncated"], n_long);
  EXPECT_NEAR(cut["mean_nll"].get<double>(), sum_cut / n_cut, 1e-4);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pagoda::test
