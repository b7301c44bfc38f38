#include "runtime/failure.h"

#include <exception>

#include "eplb/core/error.h"

namespace eplb::runtime {

Failure Failure::current() {
  try {
    throw;
  } catch (const Timeout& e) {
    return {FailureKind::kTimeout, e.what()};
  } catch (const IoError& e) {
    return {FailureKind::kIoError, e.what()};
  } catch (const NotSupported& e) {
    return {FailureKind::kNotSupported, e.what()};
  } catch (const InvalidArgument& e) {
    return {FailureKind::kInvalidArgument, e.what()};
  } catch (const std::exception& e) {
    return {FailureKind::kError, e.what()};
  } catch (...) {
    return {FailureKind::kError, "an exception that is not a std::exception"};
  }
}

void Failure::raise() const {
  switch (kind) {
    case FailureKind::kTimeout: throw Timeout(message);
    case FailureKind::kIoError: throw IoError(message);
    case FailureKind::kNotSupported: throw NotSupported(message);
    case FailureKind::kInvalidArgument: throw InvalidArgument(message);
    case FailureKind::kError: break;
  }
  throw Error(message);
}

}  // namespace eplb::runtime
