#include "cli/model_source.h"

#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include "cli/common.h"
#include "cli/hub.h"
#include "cli/usage.h"

namespace pagoda::cli {
namespace {

struct model_source {
  CLI::App* app = nullptr;
  std::string* model_path = nullptr;
  std::string hf_spec;  // -hf REPO[:QUANT]
  std::string hf_file;  // --hf-file FILE
};

// One entry per command that takes a model; the chosen one is the command parsed.
std::vector<model_source>& sources() {
  static std::vector<model_source> all;
  return all;
}

}  // namespace

void add_model_source(CLI::App* app, std::string& model_path, const std::string& what) {
  sources().push_back({app, &model_path, "", ""});
  const std::size_t index = sources().size() - 1;
  app->add_option("-m,--model", model_path, what + " (or -hf)");
  app->add_option_function<std::string>(
      "--hf-repo",
      [index](const std::string& spec) {
        if (auto r = parse_hub_spec(spec); !r.ok()) throw usage_error("-hf: " + r.error().message());
        sources()[index].hf_spec = spec;
      },
      "REPO[:QUANT] (also -hf): a GGUF of a Hugging Face repository instead of -m, pulled into the model cache "
      "unless it is there (`pagoda pull`); QUANT picks the file (default Q4_K_M), e.g. "
      "bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0");
  app->add_option_function<std::string>(
      "--hf-file", [index](const std::string& file) { sources()[index].hf_file = file; },
      "with -hf: the repository's file to use, by name (also -hff), instead of QUANT");
}

int resolve_model_sources() {
  for (model_source& s : sources()) {
    if (!s.app->parsed()) continue;
    auto usage = [](const std::string& m) {
      std::fprintf(stderr, "pagoda: error: %s\n", m.c_str());
      return k_usage_exit_code;
    };
    const bool positional = s.app->get_option_no_throw("MODEL") != nullptr;
    if (s.hf_spec.empty()) {
      if (!s.hf_file.empty()) return usage("--hf-file needs -hf REPO");
      if (s.model_path->empty())
        return usage(fmt::format("a model is required: -m/--model MODEL{}, or -hf REPO[:QUANT] (a GGUF from Hugging Face)",
                                 positional ? ", MODEL after the command" : ""));
      return -1;
    }
    if (!s.model_path->empty())
      return usage(fmt::format("two models given: {} and -hf {}; give one", *s.model_path, s.hf_spec));
    auto settings = hub_settings_from_env();
    if (!settings.ok()) return fail(settings.error());
    auto request = parse_hub_spec(s.hf_spec, s.hf_file);
    if (!request.ok()) return usage(request.error().message());
    auto path = hub_pull(*settings, *request);
    if (!path.ok()) return fail(path.error());
    *s.model_path = *path;
    return -1;
  }
  return -1;
}

}  // namespace pagoda::cli
