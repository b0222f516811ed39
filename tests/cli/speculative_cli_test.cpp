// Speculative decoding through the commands: `run --speculative` gives the
// tokens plain decoding gives and reports acceptance on stderr; bad specs exit 2
// naming the parameter; `batch` reports it in its summary.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

cli_result run_with(const std::string& extra) {
  return run_cli("run -m " + model_path() + " -p " + shell_quote("Once upon a time, there was a little girl") +
                 " -n 96 --temp 0 --ignore-eos --json -t 1 " + extra);
}

TEST(cli_speculative, run_matches_plain_decoding_and_reports_acceptance) {
  // f32 KV, and int4 (keys sealed per block: rolled back through held staging).
  for (const std::string kv : {"", " --kv-cache-dtype int4"}) {
    const cli_result plain = run_with(kv);
    const cli_result spec = run_with("--speculative ngram:k=5,n=3" + kv);
    ASSERT_EQ(plain.exit_code, 0) << plain.err;
    ASSERT_EQ(spec.exit_code, 0) << spec.err;
    EXPECT_EQ(json::parse(plain.out)["tokens"], json::parse(spec.out)["tokens"]) << kv;
    EXPECT_NE(spec.err.find("draft tokens accepted"), std::string::npos) << spec.err;
  }
}

TEST(cli_speculative, bad_specs_exit_2_naming_the_parameter) {
  for (const char* bad : {"ngram:k=0", "ngram:k=99", "ngram:width=2", "medusa"}) {
    const cli_result r = run_with(std::string("--speculative ") + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.err;
    EXPECT_NE(r.err.find("--speculative"), std::string::npos) << r.err;
  }
  // A valid spec the engine cannot honour: a usage error too, naming the flag.
  const cli_result no_draft = run_with("--speculative draft:k=3");
  EXPECT_EQ(no_draft.exit_code, 2) << no_draft.err;
  EXPECT_NE(no_draft.err.find("--draft-model"), std::string::npos) << no_draft.err;
}

// --draft-model: stories260K drafting for itself accepts every draft and
// gives plain decoding's tokens; a draft of another vocabulary exits 2.
TEST(cli_speculative, draft_model) {
  const cli_result plain = run_with("");
  const cli_result spec = run_with("--draft-model " + model_path());
  ASSERT_EQ(spec.exit_code, 0) << spec.err;
  EXPECT_EQ(json::parse(plain.out)["tokens"], json::parse(spec.out)["tokens"]);
  EXPECT_NE(spec.err.find("100.0%"), std::string::npos) << spec.err;
  const std::string synth = ::testing::TempDir() + "/pagoda_cli_other_vocab.gguf";
  ASSERT_EQ(run_cli("synth --preset tiny --weight-type f32 -o " + synth).exit_code, 0);
  const cli_result other = run_with("--draft-model " + synth);
  std::remove(synth.c_str());
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("--draft-model"), std::string::npos) << other.err;
  EXPECT_NE(other.err.find("vocabulary"), std::string::npos) << other.err;
}

}  // namespace
}  // namespace pagoda::test
