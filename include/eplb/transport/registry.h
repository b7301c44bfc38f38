#pragma once
// The transport backends this build has, by name: "inproc", "shm", and "ucx" and "hybrid" (shm
// within a node, UCX across nodes) when built with UCX, and "cuda" (device memory, CUDA IPC)
// when built with -DEPLB_WITH_CUDA=ON. The list is filled explicitly in registry.cc; backends never register themselves.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/transport/transport.h"

namespace eplb::transport {

// Names of the backends built in, in a fixed order.
std::vector<std::string> backend_names();

bool has_backend(std::string_view name);

// A new Transport of backend `name`; InvalidArgument naming the built backends for an unknown
// one, IoError when the backend cannot start (UCX finds no usable transport, for instance).
std::unique_ptr<Transport> create(std::string_view name, const Options& options);

}  // namespace eplb::transport
