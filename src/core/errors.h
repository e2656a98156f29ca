// Errors that point at the line. Every failure in Marrow becomes a marrow::Error carrying one
// sentence for the user; library calls are wrapped in macros that add file:line, the call text and
// the library's own message. The application layer catches Error, prints it and exits non-zero.
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace marrow {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& message) { throw Error(message); }

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

[[noreturn]] inline void fail_call(const char* file, int line, const char* call, const std::string& why) {
  throw Error(fmt::format("{}:{}: {} failed: {}", file, line, call, why));
}

}  // namespace marrow

// Checks a condition that user input or a caller controls; the message names what was wrong.
#define MARROW_CHECK(cond, ...)                 \
  do {                                          \
    if (!(cond)) ::marrow::fail(__VA_ARGS__);   \
  } while (0)

// The body of each library's checked-call macro (MARROW_CUDA_CHECK, ...): `failed(result)` says
// whether the call failed, `why(result)` is the library's message; text is the call as written.
#define MARROW_CHECK_RESULT(result, text, failed, why)                                                \
  do {                                                                                                \
    const auto marrow_result_ = (result);                                                             \
    if (failed(marrow_result_)) ::marrow::fail_call(__FILE__, __LINE__, text, why(marrow_result_)); \
  } while (0)
