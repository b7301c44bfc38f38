#pragma once
// How much memory this process may still take, for checks made before a large allocation:
// a window, a trace or a rank count that would not fit is refused with both figures instead
// of ending in std::bad_alloc (or the kernel's OOM killer) part way through.

#include <cstdint>
#include <string>
#include <string_view>

namespace eplb {

// The bytes this process can still allocate: the machine's MemAvailable (/proc/meminfo), or
// less under an address-space or data limit (ulimit -v / -d). -1 when neither can be read.
int64_t memory_available();

// "3.8 GiB", "512 KiB", "17 B".
std::string human_bytes(int64_t bytes);

// Throws InvalidArgument when `bytes` (what `what` needs, e.g. "the load window of 1000000
// steps x 8 layers x 64 experts") is more than memory_available(), naming both and the fix.
void check_fits_in_memory(int64_t bytes, std::string_view what, std::string_view fix);

// a * b, or InvalidArgument naming `what` when the product does not fit an int64 (a, b >= 0).
int64_t checked_mul(int64_t a, int64_t b, std::string_view what);
// a + b, likewise.
int64_t checked_add(int64_t a, int64_t b, std::string_view what);

}  // namespace eplb
