#pragma once
// inproc: ranks are threads of one process; a read is a memcpy. The reference implementation of
// the Transport contract and the test double for layers above. A rank that "dies" is one that
// closed its Transport: its memory stays allocated while peers hold it, and their reads fail.

#include <memory>

#include "eplb/transport/transport.h"

namespace eplb::transport::inproc {

std::unique_ptr<Transport> create(const Options& options);

}  // namespace eplb::transport::inproc
