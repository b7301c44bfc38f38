// Transport descriptors, as import_descriptor() reads them from a peer: the shared envelope
// (DescriptorReader) and the inproc and shm backends' payloads. Bytes from a peer may be
// anything; an import must either succeed or throw InvalidArgument (malformed, foreign) or
// IoError (the process or memory it names cannot be opened): never crash, hang or allocate by
// an unchecked count.

#include <cstddef>
#include <cstdint>
#include <span>

#include "eplb/core/error.h"
#include "eplb/transport/registry.h"
#include "fuzz_check.h"

namespace {

eplb::transport::Transport& transport(const char* backend) {
  // One per backend for the whole run, with one region, as a rank has after connect(). Never
  // destroyed: the inproc backend's registry is a function-local static that may go first.
  static eplb::transport::Transport* inproc = nullptr;
  static eplb::transport::Transport* shm = nullptr;
  auto*& t = backend[0] == 'i' ? inproc : shm;
  if (t == nullptr) {
    t = eplb::transport::create(backend, {.rank = 0}).release();
    t->allocate(4096);
  }
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  for (const char* backend : {"inproc", "shm"}) {
    eplb::transport::Transport& t = transport(backend);
    try {
      t.import_descriptor(1, bytes);
    } catch (const eplb::InvalidArgument&) {
    } catch (const eplb::IoError&) {
    }
  }
  return 0;
}
