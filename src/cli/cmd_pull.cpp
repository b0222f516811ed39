// pagoda pull REPO[:QUANT]: a GGUF from a Hugging Face repository into the
// model cache (hub.h); prints its local path, so `pagoda run -m "$(pagoda pull
// REPO)"` works as `pagoda run -hf REPO` does.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/hub.h"

namespace pagoda::cli {
namespace {

struct pull_options {
  std::string spec;  // REPO[:QUANT]
  std::string file;  // --hf-file
};

int pull(const pull_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(hub_settings settings, hub_settings_from_env());
  PAGODA_ASSIGN_OR_RETURN_CLI(hub_request request, parse_hub_spec(o.spec, o.file));
  PAGODA_ASSIGN_OR_RETURN_CLI(std::string path, hub_pull(settings, request));
  std::printf("%s\n", path.c_str());
  return 0;
}

}  // namespace

void register_pull(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<pull_options>();
  CLI::App* cmd = app.add_subcommand(
      "pull", "download a GGUF from Hugging Face into the model cache ($PAGODA_MODELS, else ~/.cache/pagoda/models)");
  cmd->add_option("REPO", opts->spec,
                  "OWNER/NAME[:QUANT], e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M; QUANT picks the file whose "
                  "name has it (case-insensitive; default Q4_K_M, else the first GGUF)")
      ->required()
      ->check(CLI::Validator(
          [](std::string& spec) -> std::string {
            auto r = parse_hub_spec(spec);
            return r.ok() ? "" : r.error().message();
          },
          "REPO[:QUANT]"));
  cmd->add_option("--hf-file", opts->file, "the repository's file to pull, by name (also -hff), instead of QUANT");
  cmd->footer(
      "Environment (as Hugging Face's own tools): HF_ENDPOINT (default https://huggingface.co), HF_TOKEN (else the "
      "token `huggingface-cli login` saved) sent as a Bearer token, HF_HUB_OFFLINE=1 to use the cache only. A pull "
      "resumes an interrupted download and checks the published SHA-256; a file already pulled is not downloaded "
      "again.");
  cmd->callback([opts, &action] { action = [opts] { return pull(*opts); }; });
}

}  // namespace pagoda::cli
