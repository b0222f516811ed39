// Stop strings over streamed text. Text is released as soon as it cannot be
// the beginning of a stop string; when a stop string appears, everything from
// its first byte on is dropped (OpenAI semantics: the stop string is not
// returned) and the stream reports that it stopped.
#pragma once

#include <string>
#include <vector>

namespace pagoda {

class stop_matcher {
 public:
  explicit stop_matcher(std::vector<std::string> stops = {});

  // Appends generated text; returns the part that can be shown now.
  std::string push(const std::string& text);
  // The held-back remainder (call once the sequence ends without a stop).
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::size_t max_len_ = 0;
  std::string held_;  // text not yet released: could start a stop string
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace pagoda
