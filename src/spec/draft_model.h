// A draft model for speculative decoding (`draft`, --draft-model): a second,
// smaller GGUF that proposes tokens for the target to verify. It must speak
// the target's vocabulary: the same token ids for the same pieces, or its
// drafts would be other tokens than they look.
#pragma once

#include "model/llama.h"
#include "pagoda/status.h"

namespace pagoda {

// ok when draft's vocabulary is target's: the same number of tokens (and of
// logits rows), every token's text, and the special tokens (BOS, EOS, EOT,
// end of generation). The error names the first difference.
status check_same_vocabulary(const llama_model& target, const llama_model& draft);

}  // namespace pagoda
