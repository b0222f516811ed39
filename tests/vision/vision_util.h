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

// How far a is from b (same sizes; a NaN counts as infinitely far).
struct diff {
  double max_abs = 0;
  double rms = 0;
};
diff compare(std::span<const float> a, std::span<const float> b);
// compare(), expected within both bounds, printed as "[ vision ] <what> max abs diff .. rms .. (n values)".
diff expect_close(std::span<const float> a, std::span<const float> b, double max_abs, double rms, const std::string& what);

// The prompt's tokens in one step, then the embeddings' rows in the next (in
// place of token embeddings, at the following positions), F32 KV cache;
// returns the logits of every embedding row, [rows][n_vocab] (as the
// reference program decodes them).
// bidirectional: the rows see each other both ways (Gemma 3's images, as
// mtmd decodes them); after: tokens decoded in a third step, their logits
// appended, [rows + after][n_vocab].
std::vector<float> logits_after_embeddings(const llama_model& model, std::span<const token_id> prompt,
                                           std::span<const float> embeddings, int n_threads = 1,
                                           bool bidirectional = false, std::span<const token_id> after = {});

}  // namespace pagoda::test
