// Synth models for tests (model/synth.h), written to a temporary file and
// loaded; the file is removed at once (the mapping stays valid). Header-only,
// as stories.h.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "model/llama.h"
#include "model/synth.h"

namespace pagoda::test {

// A preset's f32 file with n_layer layers, written by one thread.
inline synth_options f32_synth_options(const std::string& preset, int n_layer) {
  synth_options o;
  o.preset = preset;
  o.n_layer = n_layer;
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  return o;
}

// `name` keeps files of one process apart.
inline std::unique_ptr<llama_model> load_synth(const synth_options& o, const std::string& name) {
  const std::string path = ::testing::TempDir() + "/pagoda_synth_" + name + "_" + std::to_string(getpid()) + ".gguf";
  const status st = write_synth_model(o, path);
  EXPECT_TRUE(st.ok()) << st.message();
  auto m = llama_model::load(path);
  std::remove(path.c_str());
  EXPECT_TRUE(m.ok()) << m.error().message();
  return m.ok() ? std::move(*m) : nullptr;
}

// A preset with every matrix in one type, written by one thread.
inline std::unique_ptr<llama_model> load_synth(const std::string& preset, gguf::tensor_type type) {
  synth_options o;
  o.preset = preset;
  o.weight_type = type;
  o.n_threads = 1;
  return load_synth(o, preset + "_" + gguf::tensor_type_name(type));
}

}  // namespace pagoda::test
