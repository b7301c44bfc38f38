#pragma once
// A failure handed from one runtime thread to another, as plain values: its kind and message.
//
// Threads of the runtime never share an exception object. The thread that catches an exception
// turns it into a Failure inside its catch block (`Failure::current()`), so the exception is
// created, read and destroyed on that thread alone; the Failure (a copied string) crosses to
// the thread that reports it, which throws a fresh exception of the same kind (`raise()`) when
// the error is to reach the engine. A shared std::exception_ptr would work too, but its object
// is freed by whichever thread drops the last reference while another may still read it, and
// the reference count lives where ThreadSanitizer cannot see it: a suite that reports that at
// random is not a check. Every catch on a runtime thread takes everything (a foreign exception
// type from a hook or a backend is still an error to report, never a reason to end the process
// from a thread the engine does not own) and keeps it as a Failure.

#include <string>

namespace eplb::runtime {

enum class FailureKind { kError, kInvalidArgument, kNotSupported, kIoError, kTimeout };

struct Failure {
  FailureKind kind = FailureKind::kIoError;
  std::string message;

  // The exception being handled, as a Failure. Only inside a catch block. An exception that is
  // not an eplb::Error keeps its message and becomes kError.
  static Failure current();

  // Throws a new exception of `kind` with `message` (eplb::Timeout for kTimeout, ...).
  [[noreturn]] void raise() const;
};

}  // namespace eplb::runtime
