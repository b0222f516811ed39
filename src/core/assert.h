// Broken invariants abort with a message; they are bugs, not inputs.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace pagoda::detail {
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);
}

#define PAGODA_ASSERT(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::pagoda::detail::assert_fail(#cond, __FILE__, __LINE__, fmt::format("" __VA_ARGS__)); \
  } while (0)

#ifdef NDEBUG
#define PAGODA_DASSERT(cond, ...) \
  do {                            \
  } while (0)
#else
#define PAGODA_DASSERT(cond, ...) PAGODA_ASSERT(cond, __VA_ARGS__)
#endif
