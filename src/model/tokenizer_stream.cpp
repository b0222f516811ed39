#include "model/tokenizer_stream.h"

#include "model/tokenizer.h"
#include "model/unicode.h"

namespace pagoda {

stream_decoder::stream_decoder(const tokenizer& tok, bool at_text_start, bool render_special)
    : tok_(&tok), render_special_(render_special), at_text_start_(at_text_start) {}

std::string stream_decoder::push(token_id id) {
  tok_->append_decoded(id, render_special_, at_text_start_, pending_);
  const std::size_t keep = unicode::incomplete_utf8_tail(pending_);
  std::string out;
  unicode::append_sanitized(out, std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string stream_decoder::flush() {
  std::string out;
  unicode::append_sanitized(out, pending_);
  pending_.clear();
  return out;
}

}  // namespace pagoda
