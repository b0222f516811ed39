#include "cli/sampling_options.h"

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <random>

namespace pagoda::cli {
namespace {

// llama.cpp's --logit-bias: "15043+1.5" or "15043-inf" (-inf: never).
status parse_logit_bias(const std::vector<std::string>& specs, sampling_params& p) {
  for (const std::string& spec : specs) {
    const std::size_t at = spec.find_first_of("+-", 1);
    token_id token = -1;
    float bias = 0;
    const char* end = spec.data() + spec.size();
    const char* split = at == std::string::npos ? end : spec.data() + at;
    const auto [tp, tec] = std::from_chars(spec.data(), split, token);
    bool ok = at != std::string::npos && tec == std::errc() && tp == split && token >= 0;
    if (ok) {
      const std::string value = spec.substr(at);
      if (value == "-inf") {
        bias = -100.0f;
      } else {
        char* vend = nullptr;
        bias = std::strtof(value.c_str(), &vend);
        ok = vend == value.c_str() + value.size();
      }
    }
    if (!ok) return error(errc::invalid_argument, "--logit-bias '{}': expected TOKEN+BIAS or TOKEN-BIAS, e.g. 15043+1", spec);
    p.logit_bias.emplace_back(token, bias);
  }
  return {};
}

}  // namespace

void add_sampling_options(CLI::App* cmd, sampling_flags& f) {
  cmd->add_option("--temp,--temperature", f.sampling.temperature, "temperature (0 = greedy)");
  cmd->add_option("--top-k", f.sampling.top_k, "top-k (0 = off)");
  cmd->add_option("--top-p", f.sampling.top_p, "top-p (1 = off)");
  cmd->add_option("--min-p", f.sampling.min_p, "min-p (0 = off)");
  cmd->add_option("--repeat-penalty,--repetition-penalty", f.sampling.repetition_penalty,
                  "divide the logits of tokens already in the prompt or output (1 = off; docs/serving.md)");
  cmd->add_option("--presence-penalty", f.sampling.presence_penalty, "subtract from tokens already generated (0 = off)");
  cmd->add_option("--frequency-penalty", f.sampling.frequency_penalty,
                  "subtract per occurrence in the output (0 = off)");
  cmd->add_flag("--ignore-eos", f.ignore_eos, "keep generating past the end-of-generation token");
  cmd->add_option("-l,--logit-bias", f.logit_bias,
                  "TOKEN+BIAS or TOKEN-BIAS added to a token's logit, bias in [-100, 100] (-inf: never); repeatable");
  f.seed_option = cmd->add_option("-s,--seed", f.sampling.seed,
                                  "random seed (default: a fresh one each run, printed on stderr)")
                      ->default_str("fresh");
}

status finish_sampling_options(sampling_flags& f) {
  f.seed_given = f.seed_option && f.seed_option->count() > 0;
  if (!f.seed_given) f.sampling.seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  PAGODA_RETURN_IF_ERROR(parse_logit_bias(f.logit_bias, f.sampling));
  return f.sampling.validate();
}

}  // namespace pagoda::cli
