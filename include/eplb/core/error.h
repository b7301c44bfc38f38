#pragma once
// The one small tree of exceptions eplb throws, and the checks that throw them.
//
//   eplb::Error
//     ├── InvalidArgument  bad input or configuration: the message names the value and the rule
//     ├── NotSupported     a backend lacks a capability
//     ├── IoError          a file, peer or link failed; the caller may retry or rebuild
//     └── Timeout          an operation did not finish within its deadline
//
// EPLB_CHECK(cond, parts...) throws InvalidArgument with file:line and the message parts;
// EPLB_CHECK_EQ/NE/LT/LE/GT/GE add both values. Foreign return codes are wrapped once per
// library (EPLB_UCX_CHECK, ...), next to the backend that uses them.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace eplb {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

class NotSupported : public Error {
 public:
  using Error::Error;
};

class IoError : public Error {
 public:
  using Error::Error;
};

class Timeout : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

// Where a check failed, for messages meant for developers (broken invariants), not users.
std::string where(const char* file, int line);

}  // namespace detail

// Throws E with the parts streamed into one message. For user-facing errors: say what was
// wrong, with the value, and what would be right.
template <typename E = InvalidArgument, typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw E(detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace eplb

#define EPLB_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::eplb::fail<::eplb::InvalidArgument>(__VA_ARGS__, " [", #cond, " at ",          \
                                            ::eplb::detail::where(__FILE__, __LINE__), \
                                            "]");                                      \
    }                                                                                  \
  } while (0)

#define EPLB_CHECK_OP_(a, b, op, ...)                                                        \
  do {                                                                                       \
    const auto& eplb_a_ = (a);                                                               \
    const auto& eplb_b_ = (b);                                                               \
    if (!(eplb_a_ op eplb_b_)) {                                                             \
      ::eplb::fail<::eplb::InvalidArgument>(                                                 \
          "" __VA_ARGS__, " [expected " #a " " #op " " #b ", got ", eplb_a_, " vs ", eplb_b_, \
          " at ", ::eplb::detail::where(__FILE__, __LINE__), "]");                           \
    }                                                                                        \
  } while (0)

#define EPLB_CHECK_EQ(a, b, ...) EPLB_CHECK_OP_(a, b, ==, __VA_ARGS__)
#define EPLB_CHECK_NE(a, b, ...) EPLB_CHECK_OP_(a, b, !=, __VA_ARGS__)
#define EPLB_CHECK_LT(a, b, ...) EPLB_CHECK_OP_(a, b, <, __VA_ARGS__)
#define EPLB_CHECK_LE(a, b, ...) EPLB_CHECK_OP_(a, b, <=, __VA_ARGS__)
#define EPLB_CHECK_GT(a, b, ...) EPLB_CHECK_OP_(a, b, >, __VA_ARGS__)
#define EPLB_CHECK_GE(a, b, ...) EPLB_CHECK_OP_(a, b, >=, __VA_ARGS__)
