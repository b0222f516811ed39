// stories260K for tests: its path and the model, loaded once per process, and
// a greedy request builder for engine tests. Header-only, so every test binary
// can use it without a shared test library.
#pragma once

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/llama.h"

namespace pagoda::test {

inline std::string stories_path() { return std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf"; }

inline const llama_model& stories() {
  static std::unique_ptr<llama_model> m = [] {
    auto r = llama_model::load(stories_path());
    if (!r.ok()) {
      ADD_FAILURE() << r.error().message();
      std::abort();
    }
    return std::move(*r);
  }();
  return *m;
}

// The first n tokens of the dev text (tests/data/tinystories_dev.txt), BOS first.
inline std::vector<token_id> story_tokens(std::size_t n) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  std::vector<token_id> t = stories().vocab().encode(text.substr(0, 4000), true);
  EXPECT_GE(t.size(), n);
  t.resize(n);
  return t;
}

}  // namespace pagoda::test
