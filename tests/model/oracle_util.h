// llama.cpp's reference outputs in tests/data/oracle (see its README.md) and
// the one function that runs a token sequence through a model to compare with
// them.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "model/llama.h"
#include "pagoda/types.h"

namespace pagoda::test {

// Runs `tokens` through `model` as the oracle's reference program did: the
// first n_prompt tokens in one forward step with logits for every position,
// then each later token alone at its position, reusing the KV cache (teacher
// forcing: the given ids, not the model's own argmax). F32 KV cache. Returns
// [tokens.size()][n_vocab] logits, row r being the prediction after tokens[r].
// This is the only test code that knows the forward-pass API.
std::vector<float> run_teacher_forced(const llama_model& model, std::span<const token_id> tokens, int n_prompt,
                                      int n_threads = 1);

// One model of the oracle set.
struct oracle_case {
  std::string name;                // e.g. "synth-llama-Q4_K_M"
  std::string family;              // "synth-llama", "stories260K" or "arch"
  std::string arch;                // general.architecture of the file
  std::string gguf_path;
  std::vector<token_id> tokens;    // the 96 prompt ids, then the 32 greedy ids
  int n_prompt = 0;
  int n_vocab = 0;
  std::vector<token_id> greedy;    // greedy[k] = argmax of row n_prompt - 1 + k
  std::vector<float> margins;      // top-1 minus top-2 logit of those rows
  std::vector<std::pair<std::string, int>> type_counts;  // llama.cpp's tensor type counts ("Q4_K", 13)
  std::vector<float> logits;       // [rows][n_vocab] (stored as fp16, or f32 for "arch")
  std::vector<float> deq_logits;   // llama.cpp on the exactly dequantized weights (f32); empty if absent
};

std::string oracle_dir();
std::vector<std::string> oracle_case_names();  // every ref/*.json, sorted
oracle_case load_oracle_case(const std::string& name);

struct logit_diff {
  double max_abs = 0;             // over every logit
  double rms = 0;
  std::vector<double> row_max;    // per row
};
logit_diff compare_logits(const std::vector<float>& got, const std::vector<float>& want, int n_vocab);

}  // namespace pagoda::test
