#pragma once
// ucx: reads with UCX's ucp_get_nbx, across processes and machines, over whatever transports
// UCX selects; UCX reads UCX_TLS, UCX_NET_DEVICES and the rest of its environment itself.
//
// Regions are allocated by UCX (ucp_mem_map with UCP_MEM_MAP_ALLOCATE), the only memory UCX can
// serve truly one-sided over shared memory. A descriptor carries the owner's worker address and
// one packed rkey per region. When UCX can map a peer's region into this process
// (ucp_rkey_ptr: a shared-memory key), a read is a plain memcpy from that mapping; otherwise it
// is a ucp_get_nbx, which RDMA serves one-sided and TCP emulates with messages. Serving those
// messages is the one thing the owner does: each Transport runs a progress thread that sleeps
// on its workers' event fds (ucp_worker_arm) and wakes only when a request arrives.
//
// Connections. A Transport has two UCX workers: a serving one, whose address the descriptor
// carries and which only answers, and a reading one, which holds the endpoints to peers'
// serving workers and is progressed by the reading thread in poll() and wait() as well (both
// multi-threaded mode). Two ranks importing each other at once thus make two independent
// connections, never one "simultaneous connect". import_descriptor() returns only once its
// connection handshake has finished on both sides (a token sent and echoed back), so a rank may
// exit or close at any moment after that without a handshake message in flight to or from it.
//
// Failure. Endpoints use UCP_ERR_HANDLING_MODE_PEER: a peer that dies fails its reads with
// IoError. Owners on this machine are also watched by pid, and a closed owner clears a flag in a
// small control region, so a mapped read of an owner that is gone fails too. A batch still
// pending when destroyed force-closes the endpoints it waits on (UCX then cancels the reads);
// those peers must be imported again. A stopped owner (SIGSTOP) still serves mapped reads; an
// emulated read from it times out.

#include <memory>

#include "eplb/transport/transport.h"

namespace eplb::transport::ucx {

std::unique_ptr<Transport> create(const Options& options);

}  // namespace eplb::transport::ucx
