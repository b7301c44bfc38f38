#include "cli/layout_options.h"

#include "eplb/core/error.h"
#include "eplb/core/types.h"

namespace eplb::cli {

int64_t physical_slots(int64_t experts, int64_t ranks, std::optional<int64_t> physical,
                       std::optional<int64_t> redundant) {
  if (physical && redundant) {
    fail("give either --physical or --redundant, not both (physical = experts + redundant)");
  }
  if (!redundant) return physical.value_or(experts);
  if (*redundant < 0) {
    fail("--redundant ", *redundant, " must not be negative (-1, one per rank, is known only "
         "to eplb run)");
  }
  if (*redundant > kMaxPhysical - experts) {
    fail("--redundant ", *redundant, " gives more than ", kMaxPhysical,
         " physical slots per layer, the most eplb supports");
  }
  const int64_t slots = experts + *redundant;
  if (ranks > 0 && slots % ranks != 0) {
    fail("--redundant ", *redundant, " gives ", slots,
         " physical slots, not a multiple of --ranks ", ranks,
         " (physical slots must divide evenly)");
  }
  return slots;
}

}  // namespace eplb::cli
