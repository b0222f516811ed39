#include "server/bounded_json.h"

#include <fmt/format.h>

namespace pagoda::server {

using nlohmann::json;

namespace {

// Counts as it scans and stops at the first limit broken (or syntax error).
class limit_checker final : public json::json_sax_t {
 public:
  explicit limit_checker(const json_limits& l) : limits_(l) {}

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t& s) override { return text(s, "a string") && value(); }
  bool binary(binary_t&) override { return value(); }
  bool key(string_t& s) override { return text(s, "an object key"); }
  bool start_object(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    problem_ = fmt::format("The request body is not valid JSON: {}", ex.what());
    return false;
  }

  const std::string& problem() const { return problem_; }
  bool limit_broken() const { return limit_broken_; }

 private:
  bool value() {
    if (++n_values_ <= limits_.max_values) return true;
    limit_broken_ = true;
    problem_ = fmt::format("The request body holds more than {} JSON values", limits_.max_values);
    return false;
  }
  bool text(const string_t& s, const char* what) {
    if (s.size() <= limits_.max_string_bytes) return true;
    limit_broken_ = true;
    problem_ = fmt::format("The request body holds {} of {} bytes; the limit is {}", what, s.size(),
                           limits_.max_string_bytes);
    return false;
  }
  bool open() {
    if (++depth_ > limits_.max_depth) {
      limit_broken_ = true;
      problem_ = fmt::format("The request body's JSON is nested deeper than {} levels", limits_.max_depth);
      return false;
    }
    return value();
  }
  bool close() {
    --depth_;
    return true;
  }

  const json_limits& limits_;
  int depth_ = 0;
  std::size_t n_values_ = 0;
  std::string problem_;
  bool limit_broken_ = false;
};

}  // namespace

api_result<json> parse_bounded_json(std::string_view text, const json_limits& limits) {
  limit_checker checker(limits);
  if (!json::sax_parse(text.begin(), text.end(), &checker)) {
    std::string why = checker.problem().empty() ? "The request body is not valid JSON" : checker.problem();
    return bad_request("", std::move(why), checker.limit_broken() ? "json_too_large" : "invalid_json");
  }
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return bad_request("", "The request body is not valid JSON", "invalid_json");
  return doc;
}

}  // namespace pagoda::server
