#include "spec/draft_model.h"

#include <algorithm>

namespace pagoda {

status check_same_vocabulary(const llama_model& target, const llama_model& draft) {
  const tokenizer& t = target.vocab();
  const tokenizer& d = draft.vocab();
  if (t.n_vocab() != d.n_vocab() || target.hparams().n_vocab != draft.hparams().n_vocab)
    return error(errc::invalid_argument, "the draft model has {} tokens ({} logits), the model {} ({}): another vocabulary",
                 d.n_vocab(), draft.hparams().n_vocab, t.n_vocab(), target.hparams().n_vocab);
  for (token_id i = 0; i < t.n_vocab(); ++i)
    if (t.token_text(i) != d.token_text(i))
      return error(errc::invalid_argument, "token {} is '{}' in the draft model and '{}' in the model: another vocabulary",
                   i, d.token_text(i), t.token_text(i));
  if (t.bos() != d.bos() || t.eos() != d.eos() || t.eot() != d.eot() ||
      !std::equal(t.eog_tokens().begin(), t.eog_tokens().end(), d.eog_tokens().begin(), d.eog_tokens().end()))
    return error(errc::invalid_argument, "the draft model's special tokens (BOS {}, EOS {}, EOT {}) are not the model's (BOS {}, EOS {}, EOT {})",
                 d.bos(), d.eos(), d.eot(), t.bos(), t.eos(), t.eot());
  return {};
}

}  // namespace pagoda
