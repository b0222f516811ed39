// Temporary files of a test process, removed when the process exits (ctest
// runs every test in a process of its own, so files a test shares between
// its cases are made once and cleaned up once).
#pragma once

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

namespace pagoda {

// /tmp/pagoda_<group>_<pid>_<name>, removed at exit.
inline std::string temp_file(const std::string& group, const std::string& name) {
  struct registry {
    std::mutex mu;
    std::vector<std::string> paths;
    ~registry() {
      for (const std::string& p : paths) std::remove(p.c_str());
    }
  };
  static registry r;
  std::string path = "/tmp/pagoda_" + group + "_" + std::to_string(getpid()) + "_" + name;
  std::lock_guard<std::mutex> lock(r.mu);
  r.paths.push_back(path);
  return path;
}

}  // namespace pagoda
