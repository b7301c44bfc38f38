#pragma once
// inproc: the ranks are threads of one process; they meet by name (Options::rendezvous and
// group) in a table of this process. The reference implementation and the test double: a rank
// "dies" by destroying its communicator, which its peers see as IoError.

#include <memory>

#include "eplb/control/communicator.h"

namespace eplb::control::inproc {

std::unique_ptr<Communicator> connect(const Options& options);

}  // namespace eplb::control::inproc
