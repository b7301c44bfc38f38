// A rank's transport and its run without elastic (run_rank); the serving loop itself is
// serve.cc's RankServer, the options run_options.cc.
#include "emu/emulator.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "emu/serve.h"
#include "eplb/control/communicator.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/transport.h"

namespace eplb::emu {

std::unique_ptr<transport::Transport> make_transport(const RunOptions& options, int rank, int seat) {
  const std::string name = options.transport_backend();
  // Emulated nodes: reads across them go over TCP, as between machines, unless the caller chose
  // UCX's transports; reads within one (hybrid) stay in shared memory.
  if ((name == "ucx" || name == "hybrid") && options.nodes > 1) ::setenv("UCX_TLS", "tcp", 0);
  const int ranks_per_node = options.ranks / std::max(options.nodes, 1);
  return transport::create(
      name, transport::Options{.rank = rank,
                               .node = "emulated-node-" + std::to_string(seat / ranks_per_node)});
}

std::string run_rank(const RunOptions& options, const Workload& workload,
                     control::Communicator& communicator, control::Communicator& lockstep,
                     transport::Transport& transport, const std::atomic<int>* stop) {
  Group group;
  group.communicator = &communicator;
  group.lockstep = &lockstep;
  group.transport = &transport;
  for (int g = 0; g < communicator.size(); ++g) group.seats.push_back(g);
  return serve(options, workload, std::move(group), nullptr, stop);
}

}  // namespace eplb::emu
