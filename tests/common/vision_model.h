// The vision oracle's files (tests/data/oracle/README.md, "Vision"): the
// text model text-tiny-F32 and its idefics3 mmproj, shared by the engine's
// and the server's image tests.
#pragma once

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "model/llama.h"

namespace pagoda::test {

inline std::string vision_dir() { return std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision"; }

// text-tiny-F32, loaded once.
inline const llama_model& vision_text_model() {
  static const std::unique_ptr<llama_model> m = [] {
    auto r = llama_model::load(vision_dir() + "/text-tiny-F32.gguf");
    EXPECT_TRUE(r.ok()) << r.error().message();
    return std::move(*r);
  }();
  return *m;
}

}  // namespace pagoda::test
