#pragma once
// The migration figures `migrate-plan --json` prints, shared with `plan --previous`.

#include <nlohmann/json.hpp>

#include "eplb/migration/migration.h"

namespace eplb::cli {

// slots_* by action, reads, bytes_* (total, intra/inter node, local copy), max rank bytes in/out,
// rounds and rounds_lower_bound, staging_slots.
nlohmann::json migration_summary_json(const migration::MigrationTotals& totals);

}  // namespace eplb::cli
