// Expected failures are values: status and result<T>. No exceptions cross a
// module boundary; broken invariants abort through PAGODA_ASSERT instead.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace pagoda {

enum class errc {
  ok = 0,
  invalid_argument,    // bad flag, bad request field, bad value
  not_found,           // missing file, key, model, tensor
  out_of_range,        // prompt longer than context, index past end
  corrupt,             // malformed file or stored block
  unsupported,         // valid but not implemented (a tensor type, a version)
  resource_exhausted,  // pool or queue full
  io_error,            // the operating system said no
  cancelled,           // the client went away
  unauthenticated,     // a MAC did not verify (a forged or foreign stored record)
  internal,
};

const char* errc_name(errc code);

class [[nodiscard]] status {
 public:
  status() = default;
  status(errc code, std::string message) : code_(code), message_(std::move(message)) {}

  static status ok_status() { return {}; }

  bool ok() const { return code_ == errc::ok; }
  errc code() const { return code_; }
  const std::string& message() const { return message_; }
  // Prefixes context onto the message: "loading x.gguf: " + message.
  status with_context(std::string_view context) const {
    if (ok()) return *this;
    return status(code_, fmt::format("{}: {}", context, message_));
  }

 private:
  errc code_ = errc::ok;
  std::string message_;
};

inline status ok_status() { return {}; }

template <typename... Args>
status error(errc code, fmt::format_string<Args...> f, Args&&... args) {
  return status(code, fmt::format(f, std::forward<Args>(args)...));
}

template <typename T>
class [[nodiscard]] result {
 public:
  result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  result(status s) : status_(std::move(s)) {}    // NOLINT: implicit by design

  bool ok() const { return value_.has_value(); }
  const status& error() const { return status_; }
  status take_status() const { return ok() ? status() : status_; }

  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  status status_;
};

}  // namespace pagoda

// Evaluates a status expression and returns it from the enclosing function if it failed.
#define PAGODA_RETURN_IF_ERROR(expr)            \
  do {                                          \
    ::pagoda::status pagoda_st_ = (expr);       \
    if (!pagoda_st_.ok()) return pagoda_st_;    \
  } while (0)

#define PAGODA_CONCAT_INNER(a, b) a##b
#define PAGODA_CONCAT(a, b) PAGODA_CONCAT_INNER(a, b)

// PAGODA_ASSIGN_OR_RETURN(auto x, make_x()); returns the error if make_x failed.
#define PAGODA_ASSIGN_OR_RETURN(lhs, expr) \
  PAGODA_ASSIGN_OR_RETURN_IMPL(PAGODA_CONCAT(pagoda_res_, __LINE__), lhs, expr)
#define PAGODA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.error();                 \
  lhs = std::move(tmp).value()
