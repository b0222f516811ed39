// pagoda tokenize: the ids of a text, space-separated on one line.
#include <cstdio>

#include "cli/commands.h"
#include "cli/common.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace pagoda::cli {
namespace {

struct tokenize_options {
  std::string model;
  std::string text;
  bool no_bos = false;
  bool parse_special = false;
};

int tokenize(const tokenize_options& o) {
  // The vocabulary alone is enough: vocab-only GGUF files work too.
  auto file = gguf::file::open(o.model);
  if (!file.ok()) return fail(file.error());  // its errors name the path
  auto tok = tokenizer::from_gguf(**file);
  if (!tok.ok()) return fail(tok.error().with_context(o.model));
  std::vector<token_id> ids = (*tok)->encode(o.text, !o.no_bos && (*tok)->add_bos_default(), o.parse_special);
  std::string line;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

void register_tokenize(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<tokenize_options>();
  CLI::App* cmd = app.add_subcommand("tokenize", "print the token ids of a text");
  add_model_source(cmd, opts->model, "GGUF model or vocabulary file");
  cmd->add_option("-p,--prompt", opts->text, "text to tokenize")->required();
  cmd->add_flag("--no-bos", opts->no_bos, "do not prepend BOS");
  cmd->add_flag("--parse-special", opts->parse_special, "match special tokens written in the text");
  cmd->callback([opts, &action] { action = [opts] { return tokenize(*opts); }; });
}

}  // namespace pagoda::cli
