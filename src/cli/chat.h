// pagoda chat: an interactive conversation with a chat model (and llama.cpp's
// `run -cnv`, which starts the same session).
#pragma once

#include <string>

#include "cli/engine_options.h"
#include "cli/sampling_options.h"

namespace pagoda::cli {

struct chat_options {
  chat_options() { engine.config.max_num_seqs = 1; }  // one conversation
  engine_options engine;
  sampling_flags sampling;
  int n_predict = -1;         // tokens per reply; -1: until the end of generation or of the context
  std::string system;         // the system message ("" = none)
  std::string chat_template;  // a family name; "" = recognised from the model
};

// Reads turns from stdin until /exit or EOF; 0 then, 1 when the model or the
// engine cannot be opened.
int run_chat(chat_options o);

}  // namespace pagoda::cli
