// Placeholder until the control layer lands: registers nothing.
#include "cli/commands.h"

namespace eplb::cli {
void add_bench_control(CLI::App&) {}
}  // namespace eplb::cli
