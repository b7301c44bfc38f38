#pragma once
// gloo: Debian's gloo over TCP (gloo::transport::tcp), ranks meeting through gloo's FileStore
// (a shared folder) or RedisStore (redis://host:port), as torch.distributed does. Gloo's own
// timeouts (context and per collective) bound every wait; gloo exceptions become IoError or
// Timeout.

#include <memory>

#include "eplb/control/communicator.h"

namespace eplb::control::gloo {

std::unique_ptr<Communicator> connect(const Options& options);

}  // namespace eplb::control::gloo
