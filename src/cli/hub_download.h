// One file of `pagoda pull` onto disk: resumable, verified, then published.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::cli {

struct download_target {
  std::string url;
  std::vector<std::string> headers;  // "Authorization: Bearer ..." or none
  std::string local_path;            // where the verified file goes
  std::int64_t size = -1;            // published size; -1 unknown
  std::string sha256;                // published SHA-256 (lowercase hex); "" none
};

// Downloads into local_path + ".part" (created with its folders; locked so two
// processes never write one file), continuing a partial one with a Range
// request. Then checks the size, the SHA-256 and the GGUF magic: a mismatch
// deletes the partial file and is an error; a match renames it to local_path
// and writes local_path + ".sha256". An interrupted transfer keeps the .part
// file for the next attempt. Progress goes to stderr: a bar on a terminal, a
// line at the start and one at the end otherwise.
status download_verified(const download_target& target);

}  // namespace pagoda::cli
