#pragma once
// mpi: OpenMPI's world when the program runs under mpirun. MPI is initialized on first use
// (MPI_THREAD_SERIALIZED: any thread, one at a time) and finalized at exit. Collectives are
// non-blocking MPI calls completed by a MPI_Test loop against the deadline, so a stopped peer
// gives Timeout instead of a hang. MPI cannot recover from that: the outstanding request can
// be neither finished nor cancelled, so after a Timeout the process must exit (MPI is then not
// finalized; mpirun reports the job as failed). A peer that dies is mpirun's business: by
// default it ends the whole job.

#include <memory>

#include "eplb/control/communicator.h"

namespace eplb::control::mpi {

std::unique_ptr<Communicator> connect(const Options& options);

}  // namespace eplb::control::mpi
