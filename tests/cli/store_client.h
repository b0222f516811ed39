// Helpers for end-to-end tests of the KV store through `pagoda serve`: a temp
// directory, HTTP calls that return the JSON answer with its status, and
// counts of what a store tier holds.
#pragma once

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "store/block_store.h"
#include "store/store_key.h"

namespace pagoda::test {

struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / ("pagoda_test_" + std::to_string(getpid()) + "_" + name)) {
    std::filesystem::remove_all(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
  std::string str() const { return path.string(); }
};

constexpr int k_store_test_block = 16;  // --block-size of these tests

// A prompt of several full blocks; variants share their first blocks.
inline std::string story_prompt(int variant) {
  std::string p = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. "
                  "One day, she saw a big red ball in the park. She ran to the ball and kicked it very high. ";
  for (int i = 0; i < variant; ++i) p += "Then the dog ran after it and barked. ";
  return p + "The ball flew over the trees and";
}

// The arguments every store test's server starts with (after `serve --port 0`).
inline std::vector<std::string> store_test_args() {
  return {"-m", std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf", "--block-size",
          std::to_string(k_store_test_block), "-t", "1"};
}

// A call to the server: the parsed answer, with "http_status" added (or
// "transport_error" when there was no answer).
inline nlohmann::json call(int port, const std::string& method, const std::string& path, const nlohmann::json& body = {},
                           const std::string& key = "") {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  httplib::Result res = method == "GET"      ? c.Get(path.c_str(), h)
                        : method == "DELETE" ? c.Delete(path.c_str(), h)
                                             : c.Post(path.c_str(), h, body.dump(), "application/json");
  if (!res) return nlohmann::json{{"transport_error", httplib::to_string(res.error())}};
  nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (!j.is_object()) j = nlohmann::json{{"body", res->body}};
  j["http_status"] = res->status;
  return j;
}

// A greedy completion.
inline nlohmann::json complete(int port, const std::string& prompt, int max_tokens = 10, const std::string& key = "") {
  return call(port, "POST", "/v1/completions", {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}}, key);
}

inline int cached(const nlohmann::json& r) { return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(); }
inline int cached_from(const nlohmann::json& r, const std::string& tier) {
  return r["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"][tier].get<int>();
}
inline std::string text(const nlohmann::json& r) { return r["choices"][0]["text"].get<std::string>(); }

// Entries of a tier; with a tenant name, only that tenant's.
inline std::int64_t count_entries(block_store& s, const std::string* tenant = nullptr) {
  std::int64_t n = 0;
  const std::uint64_t th = tenant ? tenant_hash(*tenant) : 0;
  EXPECT_TRUE(s.for_each([&](const store_key& k, std::span<const std::byte>) {
                 if (!tenant || k.tenant == th) ++n;
                 return true;
               }).ok());
  return n;
}

// Waits until the tier holds at least n entries (write-back is asynchronous).
inline bool wait_entries(block_store& s, std::int64_t n, int timeout_ms = 10000) {
  for (int waited = 0; waited < timeout_ms; waited += 50) {
    if (count_entries(s) >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace pagoda::test
