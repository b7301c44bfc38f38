// Placeholder until the transport layer lands: registers nothing.
#include "cli/commands.h"

namespace eplb::cli {
void add_bench_transport(CLI::App&) {}
}  // namespace eplb::cli
