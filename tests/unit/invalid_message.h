#pragma once
// The unit tests' check of a user-facing error: the message of the InvalidArgument a call
// throws, for the test to match the bad value and the advice it names.

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "eplb/core/error.h"

namespace eplb::test_util {

// The message of the InvalidArgument that `fn` throws; "" and a test failure if it throws
// something else or nothing.
template <typename Fn>
std::string invalid_message(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than InvalidArgument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace eplb::test_util
