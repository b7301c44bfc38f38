#pragma once
// shm: ranks are processes of one machine. Each region is a memfd the owner maps read-write;
// a peer opens it through /proc/<owner>/fd/<n> (same user), maps it read-only, and a read is a
// memcpy from that mapping: no syscall per transfer, no help from the owner.
//
// Registered memory (register_memory: an engine's own weights) inside an allocation of
// allocate_shareable() (shareable.h) is exported as that memfd and an offset, and read like an
// allocated region. Other registered memory (a malloc'd buffer, a PyTorch CPU tensor) is in no
// memfd: a peer reads it with process_vm_readv (cross-memory attach), one syscall per read,
// still without the owner's threads, at about half memcpy's speed. That needs ptrace permission between
// the processes; import_descriptor() tries one byte and says, when it is refused, which setting
// refuses it (Yama's ptrace_scope, a container's capabilities) and the alternative (allocate()).
// Under Yama's ptrace_scope 1 the owner allows its sibling ranks itself (it declares its
// parent, the launcher, as its tracer, with PR_SET_PTRACER). A
// registered buffer must stay mapped while registered: one freed under a reader fails its
// batch with IoError, never a crash.
//
// Liveness. The owner's pages stay mapped in its readers after it dies or closes, so a copy
// always "succeeds"; to be honest about failure a batch checks, after its copies, that every
// owner it read from is still open (a flag in a shared control page) and alive (its pidfd, one
// poll() per batch) and fails with IoError otherwise. A stopped owner (SIGSTOP) is alive and its
// memory readable: reads from it succeed, which is what one-sided means.
//
// Copies run inside post(); poll() and wait() only report the result.

#include <memory>

#include "eplb/transport/transport.h"

namespace eplb::transport::shm {

std::unique_ptr<Transport> create(const Options& options);

}  // namespace eplb::transport::shm
