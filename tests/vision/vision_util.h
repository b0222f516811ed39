// Files of the vision oracle (tests/data/oracle/vision) and the one place the
// vision tests run the text model's forward pass.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "model/llama.h"
#include "pagoda/types.h"
#include "vision/image_preprocess.h"

namespace pagoda::test {

std::string vision_dir();
// A whole file of little-endian float32 values.
std::vector<float> read_f32(const std::string& path);
// A binary PPM (P6, maxval 255); fails the test on anything else.
vision::rgb_image read_ppm(const std::string& path);

// The prompt's tokens in one step, then the embeddings' rows in the next (in
// place of token embeddings, at the following positions), F32 KV cache;
// returns the logits of every embedding row, [rows][n_vocab] (as the
// reference program decodes them).
std::vector<float> logits_after_embeddings(const llama_model& model, std::span<const token_id> prompt,
                                           std::span<const float> embeddings, int n_threads = 1);

}  // namespace pagoda::test
