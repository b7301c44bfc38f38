#pragma once
// cuda: ranks are processes of one machine, each driving a GPU. Regions are device memory
// (cudaMalloc, one allocation each) exported as CUDA IPC handles; a peer opens them once, in
// import_descriptor(), and a read is an asynchronous copy from that mapping on the reader's own
// stream: DMA on the copy engines, no kernel, no SM, nothing asked of the owner's CPU or GPU.
//
// Device. A Transport uses the device current on the calling thread when it is created
// (cudaSetDevice first, as an engine does for each rank); every call switches to that device and
// back. A descriptor names the owner's GPU by UUID: an importer accepts it when that GPU is its
// own, or another GPU of this machine it can reach with peer access (NVLink, PCIe P2P), and
// rejects it with InvalidArgument otherwise (another machine, a GPU hidden from this process by
// CUDA_VISIBLE_DEVICES, no peer access).
//
// Streams and events. All reads of a Transport go on one stream created with the lowest
// priority and cudaStreamNonBlocking (it never waits on, or delays, the engine's legacy default
// stream). A batch's copies are issued as one cudaMemcpyBatchAsync with the hint
// cudaMemcpyFlagPreferOverlapWithCompute (keep them on the copy engines, beside the SMs' work),
// or one cudaMemcpyAsync per read where the driver refuses that call; EPLB_CUDA_COPY=batch or
// =memcpy forces one path (for tests and measurements). Each batch then records one event
// (cudaEventDisableTiming). poll() is one cudaEventQuery; wait() polls with short sleeps until
// its deadline; nothing ever synchronizes the device. Destroying a pending batch synchronizes its
// event (a copy cannot be cancelled), so its destinations are never written after. Destinations
// may be device memory of any GPU this one can reach, pinned host memory, or pageable host
// memory (cudaMemcpyDefault with unified addressing; a read into pageable memory makes post()
// wait for that copy).
//
// Liveness. A dead owner's memory stays mapped in its readers, so a copy alone cannot notice the
// death: as with shm, the owner keeps a control page in a memfd whose `open` flag it clears at
// close(), and readers watch its process (pidfd). post() checks the owners it reads from before
// issuing any copy (a closed owner has freed its memory: no copy may touch it), and a batch
// becomes kDone only after its event has completed and every owner it read from was, after that,
// still open and alive; IoError otherwise. A stopped owner (SIGSTOP) is alive and its memory
// readable: reads succeed.
//
// Memory. allocate() rounds each allocation up to 2 MiB, so that an exported handle maps no
// bytes of any other allocation of the owner. register_memory() is not supported: CUDA IPC can
// export only whole cudaMalloc allocations, and the runtime API cannot tell whether a caller's
// pointer is the base of one; allocate() gives device memory the engine can use directly.
// close() and the destructor free device memory with cudaFree, which may wait for the device;
// they belong to shutdown, not to the serving loop.

#include <memory>

#include "eplb/transport/transport.h"

namespace eplb::transport::cuda {

// IoError when this process has no usable CUDA device (no driver, no GPU, IPC unsupported).
std::unique_ptr<Transport> create(const Options& options);

}  // namespace eplb::transport::cuda
