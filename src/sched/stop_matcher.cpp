#include "sched/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace pagoda {

stop_matcher::stop_matcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
  for (const std::string& s : stops_) max_len_ = std::max(max_len_, s.size());
}

std::string stop_matcher::push(const std::string& text) {
  if (stopped_) return {};
  held_ += text;
  if (stops_.empty()) return std::exchange(held_, {});
  // The earliest complete stop string wins.
  std::size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    std::size_t at = held_.find(s);
    if (at < best) {
      best = at;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Keep the longest suffix that is a proper prefix of some stop string.
  std::size_t keep = 0;
  for (const std::string& s : stops_)
    for (std::size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len)
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string stop_matcher::flush() {
  if (stopped_) return {};
  return std::exchange(held_, {});
}

}  // namespace pagoda
