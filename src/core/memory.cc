#include "eplb/core/memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>

#include "eplb/core/error.h"

namespace eplb {

namespace {

// Kibibytes after "<key>:" in /proc/<file>, or -1.
int64_t proc_kib(const char* file, std::string_view key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 &&
        line[key.size()] == ':') {
      long long kib = -1;
      if (std::sscanf(line.c_str() + key.size() + 1, "%lld", &kib) == 1) return kib;
    }
  }
  return -1;
}

// What a resource limit leaves of what /proc/self/status says is used under it; -1: no limit.
int64_t left_under(int resource, std::string_view used_key) {
  rlimit limit{};
  if (::getrlimit(resource, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return -1;
  const int64_t used_kib = proc_kib("/proc/self/status", used_key);
  const auto cap = static_cast<int64_t>(
      std::min<rlim_t>(limit.rlim_cur, std::numeric_limits<int64_t>::max()));
  return std::max<int64_t>(0, cap - std::max<int64_t>(used_kib, 0) * 1024);
}

}  // namespace

int64_t memory_available() {
  int64_t out = -1;
  const int64_t available_kib = proc_kib("/proc/meminfo", "MemAvailable");
  if (available_kib >= 0) out = available_kib * 1024;
  for (const int64_t left : {left_under(RLIMIT_AS, "VmSize"), left_under(RLIMIT_DATA, "VmData")}) {
    if (left >= 0) out = out < 0 ? left : std::min(out, left);
  }
  return out;
}

std::string human_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  int u = 0;
  while (value >= 1024 && u < 6) {
    value /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", value, units[u]);
  }
  return buf;
}

void check_fits_in_memory(int64_t bytes, std::string_view what, std::string_view fix) {
  const int64_t available = memory_available();
  if (available >= 0 && bytes > available) {
    fail(what, " needs ", human_bytes(bytes), " (", bytes, " B) of memory, more than the ",
         human_bytes(available), " this process can have (MemAvailable, ulimit -v)",
         fix.empty() ? "" : "; ", fix);
  }
}

int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) {
    fail(what, ": ", a, " x ", b, " does not fit a 64-bit count");
  }
  return out;
}

int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    fail(what, ": ", a, " + ", b, " does not fit a 64-bit count");
  }
  return out;
}

}  // namespace eplb
