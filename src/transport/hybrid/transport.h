#pragma once
// hybrid: shm to peers on this rank's node, UCX to the others, over one arena both serve.
//
// A region is allocated by the shm backend (a memfd) and the same pages are registered with the
// UCX backend, so a peer on the node maps them and copies (one-sided, no help from here) while
// a peer on another node reads them through UCX (RDMA where the fabric has it, emulated gets
// over TCP otherwise). The descriptor carries the node name, both backends' descriptors and the
// regions' sizes; an importer compares node names and imports only the half it will use.
//
// register_memory() registers caller memory with both halves: peers on the node read it with
// cross-memory attach (shm's registered regions), the others through UCX's mapping of it.
//
// Nodes are named by Options::node; an empty name means this machine (its boot id and pid
// namespace), so ranks on one machine share memory unless told they are on different nodes
// (emulated nodes: `eplb run --nodes`). Ranks named on one node must really share a machine:
// the shm import checks it and fails with InvalidArgument otherwise.
//
// Threads, ownership and failure are those of the Transport contract; a batch that reads from
// both kinds of peers is done when both halves are, and fails as soon as either fails.

#include <memory>

#include "eplb/transport/transport.h"

namespace eplb::transport::hybrid {

std::unique_ptr<Transport> create(const Options& options);

}  // namespace eplb::transport::hybrid
