// What a run will take before any rank process starts (RunOptions::check_resources): the
// memory every rank holds from its first step, and the compute of one step against
// --timeout-ms.
// Both are lower bounds, so that only a run that cannot work is refused: a run that fits them
// may still be slow, never refused for being close.

#include <fmt/core.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>

#include "emu/emulator.h"
#include "eplb/core/error.h"
#include "eplb/core/memory.h"

namespace eplb::emu {
namespace {

// Cores this process may run on (its ranks inherit the set).
int64_t usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// Faster than the emulator's fp32 expert kernel runs on any one core (it does about 5e9
// multiply-adds per second on a 2024 server core): a step estimated at this pace takes at
// least that long.
constexpr double kMaxMacsPerSecond = 1e10;

}  // namespace

void RunOptions::check_resources(const Workload& workload, int64_t local_ranks) const {
  check_window_fits(workload, local_ranks);
  const int64_t G = ranks, T = tokens_per_rank, k = workload.top_k, L = workload.layers;
  const int64_t physical = workload.experts + redundant_slots(workload.experts);
  const int64_t spr = physical / G;
  const int64_t expert = shape.expert_bytes();

  // Step 1: memory. Per rank: the weights of its slots in every layer and one staging layer,
  // its share of the backup copies, every sender's routed experts and slots of a layer (int32
  // each), and its own share of the tokens (an entry each, the outputs it verifies). Not the
  // figures of every step (about 1 KiB a step and rank at 6 layers): a run of many steps is
  // meant to be stopped at any step (Ctrl-C), and its figures grow only as it serves them.
  const int64_t entries = checked_mul(checked_mul(G, T, "--ranks x --tokens-per-rank"), k,
                                      "the top-k choices of a step");
  const int64_t own = checked_mul(T, k, "--tokens-per-rank x top-k");
  const int64_t weight_bytes =
      checked_mul(checked_mul(L + 1, spr, "the slots of a rank"), expert, "a rank's weights");
  const int64_t backup =
      checked_mul(checked_mul(backup_copies_resolved(), workload.experts, "the backup copies"),
                  checked_mul(L, expert, "an expert's weights in every layer"),
                  "the backup copies") /
      G;
  const int64_t routing = checked_mul(entries, 8, "the routed experts and slots of a step");
  const int64_t tokens =
      checked_add(checked_mul(own, 16, "the entries a rank receives"),
                  checked_mul(own / verify_every, checked_add(4 * shape.hidden, 24, "an output"),
                              "the outputs a rank verifies"),
                  "a rank's tokens");
  int64_t rank_bytes = 0;
  for (const int64_t part : {weight_bytes, backup, routing, tokens}) {
    rank_bytes = checked_add(rank_bytes, part, "a rank's memory");
  }
  const int64_t all = checked_mul(rank_bytes, local_ranks, "the memory of this machine's ranks");
  const int64_t available = memory_available();
  if (available >= 0 && all > available) {
    // Named by what dominates, with the option that lowers it.
    struct Part {
      int64_t bytes;
      std::string what, fix;
    };
    const Part parts[] = {
        {weight_bytes,
         fmt::format("the weights of --hidden {} x --intermediate {} ({} per expert, {} slots per "
                     "rank in {} layers)",
                     shape.hidden, shape.intermediate, human_bytes(expert), spr, L),
         "--hidden, --intermediate or --layers"},
        {backup,
         fmt::format("--backup-copies {} (of every expert in {} layers)", backup_copies_resolved(),
                     L),
         "--backup-copies"},
        {routing,
         fmt::format("--tokens-per-rank {} ({} ranks x {} tokens x top-{} expert ids and slots, "
                     "on every rank)",
                     T, G, T, k),
         "--tokens-per-rank"},
        {tokens,
         fmt::format("--tokens-per-rank {} (the {} token-expert pairs a rank computes)", T, own),
         "--tokens-per-rank"},
    };
    const Part& most =
        *std::max_element(std::begin(parts), std::end(parts),
                          [](const Part& a, const Part& b) { return a.bytes < b.bytes; });
    fail(most.what, " needs at least ", human_bytes(all), " of memory",
         local_ranks == 1
             ? std::string()
             : fmt::format(" for {} ranks ({} each)", local_ranks, human_bytes(rank_bytes)),
         ", more than the ", human_bytes(available),
         " this process can have (MemAvailable, ulimit -v): lower ", most.fix,
         local_ranks > 1 ? " or --ranks" : "");
  }

  // Step 2: time. Each rank computes its tokens through their experts (3 x hidden x
  // intermediate multiply-adds each, and again for the outputs it verifies); the ranks of this
  // machine share its cores. A step longer than --timeout-ms would time out the collective at
  // its end, where the ranks that finished first wait for the last.
  const double macs = static_cast<double>(own) * (1.0 + 1.0 / static_cast<double>(verify_every)) *
                      3.0 * static_cast<double>(shape.hidden) *
                      static_cast<double>(shape.intermediate) * static_cast<double>(L);
  const double sharing =
      std::max(1.0, static_cast<double>(local_ranks) / static_cast<double>(usable_cores()));
  const double step_s = macs * sharing / kMaxMacsPerSecond;
  if (step_s * 1000.0 > static_cast<double>(timeout_ms)) {
    fail("--tokens-per-rank ", T, " makes a step of at least ", fmt::format("{:.3g}", step_s),
         " s: each rank computes ", fmt::format("{:.3g}", macs), " multiply-adds (", T,
         " tokens x top-", k, " x ", L, " layers x 3 x --hidden ", shape.hidden,
         " x --intermediate ", shape.intermediate, ", its verified outputs again), at most ",
         fmt::format("{:g}", kMaxMacsPerSecond), " per second on a core, ", local_ranks,
         local_ranks == 1 ? " rank" : " ranks", " on ", usable_cores(),
         usable_cores() == 1 ? " core" : " cores", "; that is more than --timeout-ms ", timeout_ms,
         ", the longest a rank waits for its peers at the end of a step: lower --tokens-per-rank "
         "(or --hidden, --intermediate, --layers), or raise --timeout-ms");
  }
}

}  // namespace eplb::emu
