// An image as a part of a prompt, laid out as llama.cpp's mtmd lays it out
// (tools/mtmd/mtmd.cpp, mtmd_tokenizer): the image decoded
// (image_decode.h), preprocessed into chunks (image_preprocess.h), each chunk
// encoded (vision_encoder.h) and placed between the family's marker tokens.
// The result is what an engine request carries (request::images): tokens
// (markers, and placeholders where the rows stand in) and one image span
// per chunk.
//
// idefics3 (SmolVLM), mtmd's MTMD_SLICE_TMPL_IDEFICS3 with the overview last:
//   for each row y, column x of the slices (1-based in the text):
//     "<fake_token_around_image><row_{y}_col_{x}>" (tokenized, special tokens parsed), the slice's rows
//   "\n" after every row but the last;
//   then "\n\n" "<fake_token_around_image>" "<global-img>" (one token each),
//   the overview's rows, "<fake_token_around_image>".
// mtmd looks those single tokens up by their text; a vocabulary without them
// (a synthetic model's) gets their text tokenized instead, where mtmd would
// put an invalid id.
//
// gemma3 (Gemma 3), mtmd's img_beg / img_end: "<start_of_image>" tokenized
// (special tokens parsed), the image's rows, "<end_of_image>" tokenized; no
// newline of mtmd's own (Gemma's chat template puts "\n\n" around the marker
// itself). One span, bidirectional (image_span::bidirectional: mtmd decodes
// Gemma 3's image tokens non-causally). A vocabulary without those special
// tokens gets the text's pieces, as mtmd's tokenization would.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "model/tokenizer.h"
#include "pagoda/request.h"
#include "pagoda/status.h"
#include "vision/image_decode.h"
#include "vision/mmproj.h"

namespace pagoda::vision {

// image_span::content_hash of chunk `chunk` of the image with these bytes
// under the mmproj with this fingerprint (mmproj::fingerprint).
std::uint64_t image_content_hash(std::span<const std::uint8_t> bytes, std::uint64_t mmproj_fingerprint, int chunk);

struct image_part {
  std::vector<token_id> tokens;   // markers and placeholders, in mtmd's order
  std::vector<image_span> spans;  // one per chunk; begin relative to tokens[0]
  int n_rows = 0;                 // the slices' grid (idefics3; 0 for gemma3)
  int n_cols = 0;
  int n_image_tokens() const;     // the spans' tokens (the markers not counted)
};

// The layout alone (rows of the spans left empty): n_rows x n_cols slices and
// the overview, tokens_per_chunk each.
image_part idefics3_layout(const tokenizer& vocab, int n_rows, int n_cols, int tokens_per_chunk);

// How an image of nx x ny pixels is sliced: {rows, columns} of the refined copy.
// gemma3: "<start_of_image>", one bidirectional span of n_tokens, "<end_of_image>".
image_part gemma3_layout(const tokenizer& vocab, int n_tokens);

std::array<int, 2> slice_grid(const vision_hparams& hp, int nx, int ny);

// The whole way from a file's bytes to an image part for a text model whose
// embeddings are text_n_embd wide: errors name what failed (the image does
// not decode, the mmproj does not match the model).
result<image_part> make_image_part(std::span<const std::uint8_t> bytes, const mmproj& m, const tokenizer& vocab,
                                   int text_n_embd, thread_pool& pool, const image_limits& limits = {});

}  // namespace pagoda::vision
