#include "vision/image_prompt.h"

#include <fmt/format.h>

#include "core/hash.h"
#include "vision/image_preprocess.h"
#include "vision/vision_encoder.h"

namespace pagoda::vision {
namespace {

// mtmd's lookup_token: the token whose text (special tokens rendered) is
// `text`; without one, `text` tokenized (special tokens parsed).
void add_marker(const tokenizer& vocab, std::string_view text, std::vector<token_id>& out) {
  for (token_id id = 0; id < vocab.n_vocab(); ++id)
    if (vocab.token_to_piece(id, true) == text) {
      out.push_back(id);
      return;
    }
  const std::vector<token_id> ids = vocab.encode(text, false, true);
  out.insert(out.end(), ids.begin(), ids.end());
}

void add_text(const tokenizer& vocab, std::string_view text, std::vector<token_id>& out) {
  const std::vector<token_id> ids = vocab.encode(text, false, true);
  out.insert(out.end(), ids.begin(), ids.end());
}

void add_chunk(int tokens_per_chunk, image_part& part) {
  image_span s;
  s.begin = static_cast<std::int32_t>(part.tokens.size());
  s.n_tokens = tokens_per_chunk;
  part.spans.push_back(std::move(s));
  part.tokens.insert(part.tokens.end(), static_cast<std::size_t>(tokens_per_chunk), token_id{0});
}

}  // namespace

std::uint64_t image_content_hash(std::span<const std::uint8_t> bytes, std::uint64_t mmproj_fingerprint, int chunk) {
  hasher h(0x696d67ULL);  // "img"
  h.update_pod(mmproj_fingerprint).update_pod(chunk).update_pod(bytes.size());
  h.update(bytes.data(), bytes.size());
  return h.digest();
}

int image_part::n_image_tokens() const {
  int n = 0;
  for (const image_span& s : spans) n += s.n_tokens;
  return n;
}

image_part idefics3_layout(const tokenizer& vocab, int n_rows, int n_cols, int tokens_per_chunk) {
  image_part part;
  part.n_rows = n_rows;
  part.n_cols = n_cols;
  for (int y = 0; y < n_rows; ++y) {
    for (int x = 0; x < n_cols; ++x) {
      add_text(vocab, fmt::format("<fake_token_around_image><row_{}_col_{}>", y + 1, x + 1), part.tokens);
      add_chunk(tokens_per_chunk, part);
    }
    if (y != n_rows - 1) add_marker(vocab, "\n", part.tokens);
  }
  add_marker(vocab, "\n\n", part.tokens);
  add_marker(vocab, "<fake_token_around_image>", part.tokens);
  add_marker(vocab, "<global-img>", part.tokens);
  add_chunk(tokens_per_chunk, part);
  add_marker(vocab, "<fake_token_around_image>", part.tokens);
  return part;
}

image_part gemma3_layout(const tokenizer& vocab, int n_tokens) {
  image_part part;
  part.n_rows = 0;
  part.n_cols = 0;
  add_text(vocab, "<start_of_image>", part.tokens);
  add_chunk(n_tokens, part);
  part.spans.back().bidirectional = true;
  add_text(vocab, "<end_of_image>", part.tokens);
  return part;
}

std::array<int, 2> slice_grid(const vision_hparams& hp, int nx, int ny) {
  const auto [rx, ry] = idefics3_refined_size(nx, ny, hp.image_size, hp.longest_edge);
  return {ry / hp.image_size, rx / hp.image_size};
}

result<image_part> make_image_part(std::span<const std::uint8_t> bytes, const mmproj& m, const tokenizer& vocab,
                                   int text_n_embd, thread_pool& pool, const image_limits& limits) {
  PAGODA_RETURN_IF_ERROR(m.check_text_model(text_n_embd));
  PAGODA_ASSIGN_OR_RETURN(const rgb_image image, decode_image(bytes, limits));
  const vision_hparams& hp = m.hparams();
  PAGODA_ASSIGN_OR_RETURN(const std::vector<planar_image> chunks, preprocess(image, hp));
  image_part part;
  if (hp.projector == projector_kind::gemma3) {
    part = gemma3_layout(vocab, hp.n_output_tokens());
  } else {
    const auto [n_rows, n_cols] = slice_grid(hp, image.nx, image.ny);
    part = idefics3_layout(vocab, n_rows, n_cols, hp.n_output_tokens());
  }
  if (part.spans.size() != chunks.size())
    return error(errc::internal, "{} preprocessed chunks for {} image spans", chunks.size(), part.spans.size());
  vision_encoder enc(m, pool);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const planar_image& c = chunks[i];
    image_span& s = part.spans[i];
    if (enc.n_output_tokens(c.nx, c.ny) != s.n_tokens)
      return error(errc::internal, "chunk {} ({}x{}) encodes to {} tokens, not {}", i, c.nx, c.ny,
                   enc.n_output_tokens(c.nx, c.ny), s.n_tokens);
    s.embeddings.resize(static_cast<std::size_t>(s.n_tokens) * static_cast<std::size_t>(hp.projection_dim));
    PAGODA_RETURN_IF_ERROR(enc.encode(c.data, c.nx, c.ny, s.embeddings));
    s.content_hash = image_content_hash(bytes, m.fingerprint(), static_cast<int>(i));
  }
  return part;
}

}  // namespace pagoda::vision
