// Incremental detokenization for streaming: feed generated ids one at a time,
// get text as soon as it is complete. A multi-byte character spread over several
// byte tokens is held back until its last byte arrives, so every chunk is valid
// UTF-8 on its own (server-sent events carry JSON, which must be).
#pragma once

#include <string>

#include "pagoda/types.h"

namespace pagoda {

class tokenizer;

class stream_decoder {
 public:
  // `at_text_start`: no text precedes these tokens (a sequence start, or right
  // after a special token), so SentencePiece's prefixed space is dropped from the
  // first piece, as decode() does. Pass false when the tokens continue text the
  // reader already has, such as a generation after its prompt.
  // REQUIRES: `tok` outlives the decoder.
  explicit stream_decoder(const tokenizer& tok, bool at_text_start = false, bool render_special = false);

  // The text that `id` completes; empty while a character is unfinished. Bytes
  // that can never become valid UTF-8 come out as U+FFFD.
  std::string push(token_id id);
  // Everything still held (an unfinished character becomes U+FFFD); the decoder
  // is then empty and may be reused for following tokens.
  std::string flush();

 private:
  const tokenizer* tok_;
  bool render_special_;
  bool at_text_start_;
  std::string pending_;  // decoded bytes not yet returned: at most an unfinished character
};

}  // namespace pagoda
