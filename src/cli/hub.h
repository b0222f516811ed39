// Models from a Hugging Face hub (`pagoda pull REPO[:QUANT]`, `-hf REPO[:QUANT]`),
// with the URL layout its own tools use:
//   {endpoint}/api/models/{repo}/tree/main?recursive=true   the files, their
//        sizes and, for files kept in LFS (every GGUF), lfs.oid = SHA-256
//   {endpoint}/{repo}/resolve/main/{file}                   a file's bytes
// and their environment: HF_ENDPOINT (default https://huggingface.co),
// HF_TOKEN (else the file `huggingface-cli login` writes: $HF_TOKEN_PATH,
// $HF_HOME/token, ~/.cache/huggingface/token) sent as "Authorization: Bearer",
// HF_HUB_OFFLINE=1 (use the cache only).
//
// Files go to a cache folder: $PAGODA_MODELS, else $XDG_CACHE_HOME/pagoda/models,
// else ~/.cache/pagoda/models; a repo's files under <owner>__<name>/. A download
// goes to <file>.part (resumed with a Range request after an interruption),
// is checked against the published SHA-256 and only then renamed to <file>;
// <file>.sha256 (sha256sum's format) records what was verified, so a second
// pull of the same file downloads nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::cli {

struct hub_settings {
  std::string endpoint;   // no trailing '/'
  std::string token;      // "" : none
  std::string cache_dir;  // where pulled models go
  bool offline = false;   // HF_HUB_OFFLINE: never touch the network
};

// From the environment (above); an error when no cache folder can be named.
result<hub_settings> hub_settings_from_env();

// A file of a repository as the hub lists it.
struct hub_file {
  std::string path;        // in the repository, '/'-separated
  std::int64_t size = -1;  // bytes; -1 unknown
  std::string sha256;      // lowercase hex; "" when none is published (not in LFS)
};

// What to pull: "owner/name[:QUANT]", and optionally an exact file name (--hf-file).
struct hub_request {
  std::string repo;   // owner/name
  std::string quant;  // "" : the default choice
  std::string file;   // "" : chosen by quant
};
result<hub_request> parse_hub_spec(const std::string& spec, const std::string& file = "");

// Pulls the GGUF the request names (or finds it in the cache) and returns its
// local path. Says on stderr which file was chosen and why, shows progress
// (a bar on a terminal, a line otherwise).
result<std::string> hub_pull(const hub_settings& settings, const hub_request& request);

}  // namespace pagoda::cli
