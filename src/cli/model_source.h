// Where a command's model comes from: -m FILE, or -hf REPO[:QUANT] (also
// --hf-repo, llama.cpp's spelling; --hf-file FILE names the exact file), a
// GGUF from a Hugging Face repository pulled into the model cache unless it is
// there already (hub.h). Every command that loads a model takes both.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace pagoda::cli {

// -m/--model into model_path (described by `what`), -hf/--hf-repo and --hf-file;
// neither is required by CLI11: resolve_model_sources() checks that one is given.
void add_model_source(CLI::App* app, std::string& model_path, const std::string& what);

// After parsing, for the command that was chosen: a usage error (exit 2) when
// it has no model or both -m and -hf; else pulls what -hf names and sets the
// model path to the local file. Returns -1 to go on, or the exit code (1 when
// the pull failed, with its one-line error printed).
int resolve_model_sources();

}  // namespace pagoda::cli
